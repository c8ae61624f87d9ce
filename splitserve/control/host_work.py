"""What serving costs the host outside the engines' steps, per request and per streamed token
(issue 28 item 3: contention in the model).

A trial's engines share the host's cores with the rest of the serving stack: the HTTP frontend
(parsing, SSE framing, detokenization), the coordinator, each engine process's loop between its
steps (sockets, stats) and the trial's own load generator. Session 30 read, from chat_only's
colocated pair on a 2-core Xeon, that at 3.8-4.5 req/s the engines' steps used 1.56-1.64 cores
and everything else 0.36-0.44 of a core; the simulator ran the steps as if they had both cores.

`measure_host_work` serves one instance (`splitserve serve`, as a trial launches it) and drives
it with the trial's own client (trial/client.py run_load) in three windows, reading the CPU time
of the server's process tree (/proc, trial/hostwatch.process_tree_cpu_s), the client thread's
own CPU time, and the engine threads' CPU time inside their steps (GET /admin/steps):

- **idle**: nothing in flight for a few seconds: what the stack costs per second doing nothing;
- **requests**: many requests of one answer token each: mostly the cost per request;
- **tokens**: a few requests of long answers: mostly the cost per streamed token.

Host work = (server tree CPU - engines' step CPU) + client CPU. Less the idle rate, the two busy
windows give two equations in (CPU per request, CPU per token), solved exactly (a coefficient
that comes out negative is set to 0 and the other refitted on both windows). The simulator
(control/simulator.py) turns it into cores the engines cannot use at the rate it simulates:
load = idle + requests/s x per_request + tokens/s x per_token, and a step that starts while B
engine threads are busy on C cores runs max(1, B / (C - load)) times its profiled time.

    python -m splitserve.control.host_work [--model M] [--threads 1] [--into profile.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

PROMPT_TOKENS = 32
# (requests, answer tokens, requests per second) of each busy window; the rates stay well under
# one 1-thread instance's capacity on the slowest box kind (an AVX2 EPYC), so every request ends
REQUESTS_WINDOW = (72, 1, 6.0)
TOKENS_WINDOW = (16, 96, 1.5)
WARMUP = (6, 8, 3.0)
IDLE_S = 3.0
SETTLE_S = 1.0  # the engines report their steps in batches, a fraction of a second late


def _planned(tokens: list[int], count: int, answer: int, rate: float, seed: int):
    from splitserve.trial.workload import PlannedRequest

    rng = random.Random(seed)
    return [PlannedRequest(i, "host-work", i / rate, [rng.choice(tokens) for _ in range(PROMPT_TOKENS)], answer)
            for i in range(count)]


def _step_cpu_s(base: str, since: dict[str, int]) -> tuple[float, dict[str, int]]:
    """The engine threads' CPU time in steps each instance took since the counts in `since`."""
    import httpx

    doc = httpx.get(f"{base}/admin/steps", params={"tail": 0}, timeout=30.0).json()
    counts = {row["id"]: row["count"] for row in doc["instances"]}
    new = max((counts[k] - since.get(k, 0) for k in counts), default=0)
    if new <= 0:
        return 0.0, counts
    doc = httpx.get(f"{base}/admin/steps", params={"tail": new}, timeout=30.0).json()
    cpu_at = doc["fields"].index("cpu_seconds")
    total = 0.0
    for row in doc["instances"]:
        fresh = counts[row["id"]] - since.get(row["id"], 0)
        total += sum(s[cpu_at] for s in row["samples"][-fresh:] if fresh > 0)
    return total, counts


def _window(base: str, server_pid: int, requests, model_id: str | None, steps_since: dict[str, int],
            idle_s: float = IDLE_S) -> tuple[dict, dict[str, int]]:
    """One window's figures, and each instance's step count at its end (where the next starts)."""
    from splitserve.trial.client import run_load
    from splitserve.trial.hostwatch import process_tree_cpu_s

    tree0, client0, wall0 = process_tree_cpu_s([server_pid]), time.thread_time(), time.perf_counter()
    if requests:
        records = asyncio.run(run_load(base, requests, 300.0, model_id))
        failed = [r for r in records if r.error_kind]
        if failed:
            raise RuntimeError(f"host work: {len(failed)} of {len(records)} requests failed "
                               f"({failed[0].error_kind}: {failed[0].error_message})")
        tokens = sum(r.num_tokens for r in records)
    else:
        time.sleep(idle_s)
        tokens = 0
    time.sleep(SETTLE_S)
    client_s = time.thread_time() - client0
    tree_s = process_tree_cpu_s([server_pid]) - tree0
    wall_s = time.perf_counter() - wall0
    step_s, counts = _step_cpu_s(base, steps_since)
    return {"requests": len(requests), "tokens": tokens, "wall_s": round(wall_s, 3),
            "server_cpu_s": round(tree_s, 3), "engine_step_cpu_s": round(step_s, 3),
            "client_cpu_s": round(client_s, 3), "host_cpu_s": round(max(tree_s - step_s, 0.0) + client_s, 3)}, counts


def solve(windows: dict) -> dict:
    """CPU per request and per token from the busy windows, less the idle window's rate."""
    idle = windows["idle"]
    idle_rate = idle["host_cpu_s"] / idle["wall_s"] if idle["wall_s"] > 0 else 0.0
    rows = []
    for name in ("requests", "tokens"):
        w = windows[name]
        rows.append((w["requests"], w["tokens"], max(w["host_cpu_s"] - idle_rate * w["wall_s"], 0.0)))
    (n1, t1, c1), (n2, t2, c2) = rows
    det = n1 * t2 - n2 * t1
    per_request = (c1 * t2 - c2 * t1) / det if det else 0.0
    per_token = (n1 * c2 - n2 * c1) / det if det else 0.0
    if per_request < 0 or per_token < 0:  # one coefficient alone, least squares over both windows
        if per_request < 0:
            per_request, per_token = 0.0, (t1 * c1 + t2 * c2) / max(t1 * t1 + t2 * t2, 1e-12)
        else:
            per_request, per_token = (n1 * c1 + n2 * c2) / max(n1 * n1 + n2 * n2, 1e-12), 0.0
    return {"idle_cores": round(idle_rate, 5), "per_request_s": round(per_request, 6),
            "per_token_s": round(per_token, 7)}


def measure_host_work(model: str | None = None, threads: int = 1, log=print, requests_window=REQUESTS_WINDOW,
                      tokens_window=TOKENS_WINDOW, idle_s: float = IDLE_S) -> dict:
    """Serve one instance and time the stack's host work around it (see the module docstring);
    each window is (requests, answer tokens each, requests per second)."""
    from splitserve.trial.arrangements import free_port, stop_process_group, wait_ready
    from splitserve.trial.client import http_tokenizer

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logfile = tempfile.NamedTemporaryFile(prefix="splitserve-hostwork-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--instances", "1",
           "--threads-per-instance", str(threads), "--log-level", "warning"] + (["--model", model] if model else [])
    server = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        model_id = wait_ready(base, 300.0, server, pathlib.Path(logfile.name))
        rng = random.Random(0)
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                         for _ in range(800))
        tokens = sorted(set(http_tokenizer(base)(words)))
        _, counts = _step_cpu_s(base, {})
        _, counts = _window(base, server.pid, _planned(tokens, *WARMUP, seed=1), model_id, counts)
        windows = {}
        for seed, (name, shape) in enumerate((("idle", None), ("requests", requests_window),
                                              ("tokens", tokens_window)), start=2):
            windows[name], counts = _window(base, server.pid, _planned(tokens, *shape, seed=seed) if shape else [],
                                            model_id, counts, idle_s)
        result = solve(windows)
        log(f"  host work beside the engines: {result['per_request_s'] * 1e3:.2f} ms CPU a request, "
            f"{result['per_token_s'] * 1e3:.3f} ms a streamed token, {result['idle_cores']:.3f} core idle")
        return {**result, "threads": threads, "windows": windows,
                "method": "one served instance driven by the trial's client: (server process tree CPU - the "
                          "engine threads' CPU in steps) + the client thread's CPU, per window; idle rate "
                          "subtracted, two busy windows solved for per request and per token"}
    finally:
        stop_process_group(server, grace_s=10.0, whole_group=True)
        logfile.close()
        os.unlink(logfile.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--into", default=None, help="a profile.json to add the figures to (host_work)")
    args = parser.parse_args(argv)
    result = measure_host_work(args.model, args.threads)
    if args.into:
        path = pathlib.Path(args.into)
        doc = json.loads(path.read_text())
        doc["host_work"] = result
        path.write_text(json.dumps(doc, indent=1) + "\n")
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
