"""Node loss under Ray: SIGKILL an engine placed by Ray while requests stream; how long its stage was missing.

    .venv/bin/python bench/ray_node_loss.py [--ray ADDRESS] [--target decode-0] [--concurrency 4]
        [--max-tokens 48] [--warmup-s 10] [--after-s 15] [--out results.json] [-- SERVE FLAGS...]

Starts `splitserve serve --ray [ADDRESS] --prefill 1 --decode 1 --kv-transport tcp` (bundled model
unless the serve flags name one), keeps `--concurrency` streaming requests going, kills the target
engine's process with SIGKILL after the warm-up, and polls GET /admin/instances every 50 ms:
- detect: kill -> the frontend lists the target as not alive (its silence timeout, 1.5 s by default);
- new engine process: kill -> Ray's restarted actor started the new engine process (/proc start
  time; includes the actor's deliberate wait of the silence timeout + 0.5 s, see cluster/ray_engine.py);
- restart: kill -> the target is alive again under a new pid (the engine loaded the model and said
  hello, the frontend admitted it);
- restored: -> 1P1D again (a survivor took the stage over meanwhile; the drill hands it back with
  POST /admin/instances/{id}/role, as an operator would).
Every request is counted: answered whole, answered after a retry or a resume on another instance
(the `splitserve.retries` of its last chunk), or lost (an error or a cut-off stream). Each engine's host is
its network namespace (`ip netns identify`): bench/ray_node_loss_netbed.sh runs the drill on the bed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client: httpx.AsyncClient, url: str, n: int, max_tokens: int, t0: float) -> dict:
    body = {"prompt": f"Request {n}: tell a long story about rivers and the sea.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    rec = {"n": n, "start": time.monotonic() - t0, "tokens": 0, "retries": 0, "error": None, "max_gap": 0.0,
           "max_gap_at": None}
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:200]
                rec["retries"] = (chunk.get("splitserve") or {}).get("retries", rec["retries"])
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    now = time.monotonic() - t0
                    if choice.get("text") is not None and last is not None and now - last > rec["max_gap"]:
                        rec["max_gap"], rec["max_gap_at"] = now - last, now
                    last = now
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.monotonic() - t0
    if rec["error"] is None and rec["tokens"] < max_tokens:
        rec["error"] = f"cut off after {rec['tokens']} of {max_tokens} tokens"
    return rec


async def load(url: str, concurrency: int, max_tokens: int, stop: asyncio.Event, t0: float) -> list[dict]:
    records, counter = [], iter(range(1 << 30))

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            while not stop.is_set():
                records.append(await one_request(client, url, next(counter), max_tokens, t0))
                if records[-1]["error"]:
                    await asyncio.sleep(0.5)  # a refusal (503) must not turn into a flood of them

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def process_started(pid: int) -> float:
    """Wall-clock time a process started (from /proc: clock ticks after boot)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def netns_of(pid: int) -> str:
    """The bed host (network namespace) a process runs in; 'root' outside any named one."""
    out = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True)
    return out.stdout.strip() or "root"


def instances(url: str) -> dict[str, dict]:
    return {r["id"]: r for r in httpx.get(url + "/admin/instances", timeout=5).json()["instances"]}


async def drill(args, url: str) -> dict:
    t0, stop = time.monotonic(), asyncio.Event()
    loader = asyncio.create_task(load(url, args.concurrency, args.max_tokens, stop, t0))
    await asyncio.sleep(args.warmup_s)
    before = instances(url)
    old_pid, roles = before[args.target]["pid"], {i: r["role"] for i, r in before.items()}
    hosts_before = {i: netns_of(r["pid"]) for i, r in before.items()}
    os.kill(old_pid, signal.SIGKILL)
    t_kill, wall_kill = time.monotonic() - t0, time.time()
    events, timeline = {}, []
    while "restart" not in events:
        await asyncio.sleep(0.05)
        now, rows = time.monotonic() - t0, await asyncio.to_thread(instances, url)
        target = rows[args.target]
        timeline.append((round(now, 3), {i: (r["role"], r["alive"]) for i, r in rows.items()}))
        if not target["alive"]:
            events.setdefault("detect", now)
        elif target["pid"] != old_pid:
            events["restart"] = now
            events["spawned"] = t_kill + process_started(target["pid"]) - wall_kill
        if now - t_kill > args.give_up_s:
            raise TimeoutError(f"{args.target} not back {args.give_up_s} s after the kill")
    for instance_id, role in roles.items():  # hand the stage back to the restarted engine's partner
        while instances(url)[instance_id]["changing_role"]:
            await asyncio.sleep(0.05)
        if instances(url)[instance_id]["role"] != role:
            r = httpx.post(f"{url}/admin/instances/{instance_id}/role", json={"role": role}, timeout=60)
            r.raise_for_status()
    events["restored"] = time.monotonic() - t0
    await asyncio.sleep(args.after_s)
    stop.set()
    records = await loader
    return {"kill": t_kill, "events": events, "roles_before": roles, "hosts_before": hosts_before,
            "host_after": netns_of(instances(url)[args.target]["pid"]), "records": records,
            "timeline": timeline[:: max(1, len(timeline) // 200)]}


def summary(result: dict, target: str) -> dict:
    kill, ev, recs = result["kill"], result["events"], result["records"]
    in_flight = [r for r in recs if r["start"] <= kill <= r["end"]]
    lost = [r for r in recs if r["error"]]
    return {"target": target, "hosts": result["hosts_before"], "target_host_after": result["host_after"],
            "detect_s": round(ev["detect"] - kill, 2), "new_engine_process_s": round(ev["spawned"] - kill, 2),
            "restart_s": round(ev["restart"] - kill, 2),
            "restored_1p1d_s": round(ev["restored"] - kill, 2), "requests": len(recs),
            "in_flight_at_kill": len(in_flight), "retried_or_resumed": sum(r["retries"] > 0 for r in recs),
            "lost": len(lost), "lost_errors": sorted({r["error"] for r in lost})[:5],
            "longest_gap_in_flight_s": round(max((r["max_gap"] for r in in_flight), default=0.0), 2),
            "served_during_restart": sum(1 for r in recs if not r["error"] and kill < r["end"] < ev["restart"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ray", default="", help="Ray address (default: serve starts or joins a local Ray)")
    p.add_argument("--target", default="decode-0", help="engine to kill: decode-0 or prefill-0")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--after-s", type=float, default=15.0)
    p.add_argument("--give-up-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write the summary and every request here (JSON)")
    p.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: more `splitserve serve` flags")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = [f for f in args.serve_flags if f != "--"]
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--ray", *([args.ray] if args.ray else []),
           "--prefill", "1", "--decode", "1", "--kv-transport", "tcp", "--threads-per-instance", "1",
           "--log-level", "warning", *extra]
    server = subprocess.Popen(cmd)
    try:
        t_start = time.monotonic()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"serve exited with {server.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"serve ready in {time.monotonic() - t_start:.1f} s", flush=True)
        result = asyncio.run(drill(args, url))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    report = summary(result, args.target)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": report, "command": cmd, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
