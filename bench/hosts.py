"""What the link costs: a 2k-token handover between hosts of the bed, per link speed, with and
without a bulk flow (the "backup") sharing the link.

    .venv/bin/python bench/hosts.py \
        --rates 10gbit,1gbit,100mbit --bulk off,on --requests 2 --out bench/results/hosts_handover.json

One bed (hosts a and b), the bundled model: `splitserve serve --topology` in the root namespace,
the prefill engine on host a and the decode engine on host b (1 thread each, KV over tcp with
its secret), started once; the links are reshaped between measurements (`NetBed.set_link`).
For each (rate, bulk) it sends `--requests` distinct 2k-token prompts one after another
(streamed, 4 answer tokens, greedy) and records TTFT, the time from the first to the second
token (where the transfer and the handover sit), and the transfer's bytes and seconds from the
response's `splitserve.kv_transfer` report. A colocated engine on host a (2 threads) gives the
reference first-to-second-token time. `--engine-arg` passes flags to every engine (e.g. the
KV send mode, to compare them on the same links).
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from splitserve.testbed.across import serve_across
from splitserve.testbed.netbed import LinkSpec, NetBed


def one_request(base_url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    start, stamps, report = time.monotonic(), [], None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            report = chunk.get("splitserve", report)
            for choice in chunk.get("choices") or []:
                stamps += [time.monotonic() - start] * len(choice.get("token_ids") or [])
    kv = (report or {}).get("kv_transfer") or {}
    return {"ttft_s": stamps[0], "first_to_second_s": stamps[1] - stamps[0], "num_tokens": len(stamps),
            "kv_bytes": kv.get("bytes"), "kv_seconds": kv.get("seconds"), "kv_outcome": kv.get("outcome"),
            "kv_gbps": (kv["bytes"] / kv["seconds"] / 1e9) if kv.get("seconds") else None}


VOCAB = 40000  # token ids drawn below this (the bundled model has 49152); --vocab for another model


def prompts(count: int, length: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)  # distinct prompts: the prefix cache must not shorten any prefill
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def summarize(rows: list[dict]) -> dict:
    keys = ("ttft_s", "first_to_second_s", "kv_seconds", "kv_gbps", "kv_bytes")
    return {k: statistics.median(r[k] for r in rows) for k in keys if all(r.get(k) is not None for r in rows)}


def measure(bed: NetBed, server_url: str, rates: list[str], bulk_modes: list[str], n: int, length: int,
            seed: int, vocab: int) -> list[dict]:
    out = []
    one_request(server_url, prompts(1, 64, seed + 999, vocab)[0])  # warm-up: first forward passes, connections
    for rate in rates:
        for k, bulk in enumerate(bulk_modes):
            for host in bed.hosts:
                bed.set_link(host, LinkSpec.parse(rate))
            batch = prompts(n, length, seed + 10 * len(out) + k, vocab)
            flow = bed.bulk_flow("a", "b", port=5300 + len(out)) if bulk == "on" else None
            try:
                if flow:
                    time.sleep(1.0)  # let the backup reach its share of the link
                rows = [one_request(server_url, p) for p in batch]
            finally:
                if flow:
                    flow.stop()
            entry = {"rate": rate, "bulk": bulk, "runs": rows, "median": summarize(rows),
                     "bulk_mbps": flow.rate_bps / 1e6 if flow else None}
            print(json.dumps({k: entry[k] for k in ("rate", "bulk", "median", "bulk_mbps")}), flush=True)
            out.append(entry)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10gbit,1gbit,100mbit")
    p.add_argument("--bulk", default="off,on", help="off, on, or both")
    p.add_argument("--requests", type=int, default=2, help="per (rate, bulk)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--model", default=None)
    p.add_argument("--engine-arg", action="append", default=[], help="a flag for every engine (repeat)")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=VOCAB, help="prompt token ids are drawn below this")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/logs"))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the bed and servers come down
    rates, bulk_modes = args.rates.split(","), args.bulk.split(",")
    engine = ["--kv-cache-memory", "256MiB", *args.engine_arg]
    doc = {"prompt_tokens": args.prompt_tokens, "requests": args.requests, "engine_args": engine,
           "note": "2-core box shared with other engineers' builds and tests (nice 19); medians"}
    with NetBed(("a", "b"), LinkSpec.parse(rates[0])) as bed:
        placement = {"prefill-0": ("prefill", "a"), "decode-0": ("decode", "b")}
        with serve_across(bed, placement, args.model, ["--log-level", "warning"],
                          ["--threads-per-instance", "1", *engine],
                          log_path=args.log_dir / "hosts-split.log") as server:
            doc["split"] = measure(bed, server.base_url, rates, bulk_modes, args.requests, args.prompt_tokens,
                                   args.seed, args.vocab)
        if not args.no_colocated:
            with serve_across(bed, {"colocated-0": ("colocated", "a")}, args.model, ["--log-level", "warning"],
                              ["--threads-per-instance", "2", *engine],
                              log_path=args.log_dir / "hosts-colocated.log") as server:
                doc["colocated"] = measure(bed, server.base_url, rates[:1], ["off"], args.requests,
                                           args.prompt_tokens, args.seed, args.vocab)
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
