"""Link loss across hosts: take a host's link down (`ip link set down`) while streams run.

    .venv/bin/python bench/hosts_drill.py \
        --out bench/results/hosts_drill.json

1P1D on the bed (prefill on host a, decode on host b, 1gbit links, bundled model, 1 thread each).
Per drill: `--streams` greedy streams start (short prompts, `--max-tokens` answer tokens); once
every stream has tokens, one host's link goes down. The drill polls GET /admin/instances every
20 ms and reports the time from the link going down to the frontend declaring that instance dead
(time to detect), the roles afterwards (the survivor takes the lost stage), how many streams
completed with every token, how many were resumed or retried (`splitserve.retries`) and how many
were lost; then the link comes back and it reports whether the instance was admitted again.
Drill "decode": b's link goes down with every stream decoding there. Drill "prefill": a's link
goes down while a 1.5k-token prompt is being prefilled (the short streams decode on b meanwhile).
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from splitserve.testbed.across import serve_across
from splitserve.testbed.netbed import LinkSpec, NetBed


def stream(base_url: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    out.update(tokens=[], error=None, report=None, done=False)
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    out["report"] = chunk.get("splitserve", out["report"])
                    out["error"] = chunk.get("error", out["error"])
                    for choice in chunk.get("choices") or []:
                        out["tokens"] += choice.get("token_ids") or []
    except httpx.HTTPError as e:
        out["error"] = repr(e)


def instances(base_url: str) -> dict[str, dict]:
    rows = httpx.get(base_url + "/admin/instances", timeout=5).json()
    rows = rows.get("instances", rows) if isinstance(rows, dict) else rows
    return {r["id"]: r for r in rows}


def drill(bed: NetBed, base_url: str, host: str, victim: str, args, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(rng.randrange(32, 96))] for _ in range(args.streams)]
    results = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(base_url, p, args.max_tokens, r)) for p, r in zip(prompts, results)]
    long_result: dict = {}
    for t in threads:
        t.start()
    while not all(r.get("tokens") for r in results):
        time.sleep(0.02)
    if victim == "prefill-0":  # a long prompt in prefill on a when its link goes down
        long_prompt = [rng.randrange(10, args.vocab) for _ in range(args.long_prompt_tokens)]
        threads.append(threading.Thread(target=stream, args=(base_url, long_prompt, 8, long_result)))
        threads[-1].start()
        time.sleep(1.0)
    down_at = time.monotonic()
    bed.link_down(host)
    detect_s = None
    while time.monotonic() - down_at < 30:
        if not instances(base_url)[victim]["alive"]:
            detect_s = time.monotonic() - down_at
            break
        time.sleep(0.02)
    roles_after = {i: (r["role"], r["alive"]) for i, r in instances(base_url).items()}
    for t in threads:
        t.join(120)
    bed.link_up(host)
    rejoined = None
    up_at = time.monotonic()
    while time.monotonic() - up_at < 20:
        if instances(base_url)[victim]["alive"]:
            rejoined = time.monotonic() - up_at
            break
        time.sleep(0.1)
    everything = results + ([long_result] if long_result else [])
    complete = [r for r in everything if r.get("done") and not r.get("error")]
    return {"host_down": host, "victim": victim, "detect_s": detect_s, "roles_after": roles_after,
            "streams": len(everything),
            "complete": len(complete),
            "retried_or_resumed": sum(1 for r in everything if (r.get("report") or {}).get("retries")),
            "lost": len(everything) - len(complete),
            "errors": [r.get("error") for r in everything if r.get("error")][:3],
            "rejoined_after_link_up_s": rejoined,
            "roles_at_end": {i: (r["role"], r["alive"]) for i, r in instances(base_url).items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drills", default="decode,prefill")
    p.add_argument("--model", default=None)
    p.add_argument("--vocab", type=int, default=40000, help="prompt token ids are drawn below this")
    p.add_argument("--long-prompt-tokens", type=int, default=1500)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/logs"))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the bed and servers come down
    doc = {"note": "2-core box shared with other engineers' work; one run per drill", "drills": []}
    for n, which in enumerate(args.drills.split(",")):
        host, victim = {"decode": ("b", "decode-0"), "prefill": ("a", "prefill-0")}[which]
        with NetBed(("a", "b"), LinkSpec.parse("1gbit")) as bed:
            placement = {"prefill-0": ("prefill", "a"), "decode-0": ("decode", "b")}
            with serve_across(bed, placement, args.model, ["--log-level", "warning"],
                              ["--threads-per-instance", "1", "--kv-cache-memory", "256MiB"],
                              log_path=args.log_dir / f"hosts-drill-{which}.log") as server:
                result = drill(bed, server.base_url, host, victim, args, seed=n)
        print(json.dumps(result), flush=True)
        doc["drills"].append(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
