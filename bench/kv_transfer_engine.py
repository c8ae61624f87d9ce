"""Disaggregation end to end: what a 2k-token prompt does to streams already decoding.

    .venv/bin/python bench/kv_transfer_engine.py                  # the three arrangements, 2 cores
    .venv/bin/python bench/kv_transfer.py                         # transfer throughput, then this

For each arrangement, at equal cores (2 torch threads in total), a real `splitserve serve` with
the bundled model:
    colocated-whole    --instances 1 --threads-per-instance 2 --prefill-policy whole
    colocated-chunked  --instances 1 --threads-per-instance 2 --prefill-policy chunked
    1P+1D              --prefill 1 --decode 1 --threads-per-instance 1 --kv-transport shm
1. 8 streams start (short prompts, long answers, greedy, ignore_eos) and run until each has
   streamed `--warmup-tokens` tokens; their gaps until then give the no-load decode step (median).
2. A 2k-token prompt arrives (streamed, 8 answer tokens). Its TTFT is timed; on 1P+1D also the
   gap to its second token, which is where the KV transfer and the handover sit.
3. The longest pause of any of the 8 streams from the arrival until 1 s after the long request
   finished is the headline: target for 1P+1D, <= 2x its no-load decode step.
Everything goes through HTTP/SSE, as a client sees it. Tokens are timed by the ids each chunk
names (`return_token_ids`); the longest pause between chunks that carry text is printed too
(a token whose text is an incomplete character is held back and sent with the next one).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
ARRANGEMENTS = {
    "colocated-whole": ["--instances", "1", "--threads-per-instance", "2", "--prefill-policy", "whole",
                        "--max-num-batched-tokens", "4096"],
    "colocated-chunked": ["--instances", "1", "--threads-per-instance", "2", "--prefill-policy", "chunked",
                          "--max-num-batched-tokens", "256"],
    "1P+1D": ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1", "--kv-transport", "shm",
              "--prefill-policy", "whole", "--max-num-batched-tokens", "4096"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *flags], cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_ready(self, timeout_s: float = 600) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                 times: list[float], report: dict | None = None, text_times: list[float] | None = None) -> None:
    """Appends the arrival time of each token to `times` (the server names them with
    return_token_ids, so a token whose text the detokenizer holds back still counts), and of
    each chunk with text to `text_times`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if report is not None and "splitserve" in chunk:
                report.update(chunk["splitserve"])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            for c in chunk.get("choices") or []:
                times.extend([now] * len(c.get("token_ids") or []))
                if text_times is not None and c.get("text"):
                    text_times.append(now)


def longest_gap(times: list[float], start: float, end: float) -> tuple[float, float]:
    """(length, start time) of the longest gap between tokens within [start, end]."""
    inside = [t for t in times if start <= t <= end]
    points = [start] + inside + ([end] if not inside or inside[-1] < end else [])
    return max((b - a, a) for a, b in zip(points, points[1:]))


async def measure(url: str, args) -> dict:
    rng = random.Random(0)
    vocab = range(100, 40000)
    long_prompt = [rng.choice(vocab) for _ in range(args.long_tokens)]
    async with httpx.AsyncClient(timeout=600) as client:
        lone: list[float] = []  # the long prompt alone first: its TTFT without load, and a warm cache path
        t0 = time.perf_counter()
        await stream(client, url, [rng.choice(vocab) for _ in range(args.long_tokens)], 2, lone)
        lone_ttft = lone[0] - t0
        streams = [[] for _ in range(args.streams)]
        text_streams = [[] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, url, [rng.choice(vocab) for _ in range(32)],
                                            args.stream_tokens, times, text_times=text_times))
                 for times, text_times in zip(streams, text_streams)]
        while min(len(t) for t in streams) < args.warmup_tokens:
            await asyncio.sleep(0.01)
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream ended during warmup; raise --stream-tokens")
        gaps = [b - a for times in streams for a, b in zip(times[2:], times[3:])]
        long_times: list[float] = []
        report: dict = {}
        arrival = time.perf_counter()
        await stream(client, url, long_prompt, 8, long_times, report)
        end = long_times[-1] + 1.0
        while time.perf_counter() < end:
            await asyncio.sleep(0.05)
        pauses = [longest_gap(times, arrival, end) for times in streams]
        worst, worst_at = max(pauses)
        text_worst = max(longest_gap(times, arrival, end)[0] for times in text_streams)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    step = statistics.median(gaps)
    # where the worst pause began, against the long request's first and last token (all from its arrival)
    timing = {"worst_pause_began_s": worst_at - arrival, "long_first_token_s": long_times[0] - arrival,
              "long_last_token_s": long_times[-1] - arrival}
    return {"no_load_step_s": step, "longest_pause_s": worst, "pause_over_step": worst / step, **timing,
            "longest_text_pause_s": text_worst,
            "long_ttft_s": long_times[0] - arrival, "long_second_token_gap_s": long_times[1] - long_times[0],
            "lone_long_ttft_s": lone_ttft, "kv_transfer": report.get("kv_transfer")}


def run_all(args) -> dict:
    results = {}
    for name in args.arrangements.split(","):
        log = Path(args.log_dir) / f"bench-{name}.log"
        server = Server(ARRANGEMENTS[name] + (["--model", args.model] if args.model else []), log).wait_ready()
        try:
            results[name] = asyncio.run(measure(server.url, args))
        finally:
            server.stop()
        r = results[name]
        print(f"{name:18} step {r['no_load_step_s'] * 1e3:6.1f} ms  longest pause {r['longest_pause_s']:6.2f} s "
              f"({r['pause_over_step']:5.1f}x step)  2k TTFT {r['long_ttft_s']:5.2f} s (alone {r['lone_long_ttft_s']:5.2f}"
              f" s)  1st->2nd token {r['long_second_token_gap_s'] * 1e3:6.0f} ms  kv {r['kv_transfer']}", flush=True)
        print(f"{'':18} longest pause between chunks with text {r['longest_text_pause_s']:5.2f} s (the "
              f"detokenizer holds back incomplete characters: random prompts make many)", flush=True)
        print(f"{'':18} worst pause began {r['worst_pause_began_s']:5.2f} s after the arrival; the long request's "
              f"first token at {r['long_first_token_s']:5.2f} s, last at {r['long_last_token_s']:5.2f} s", flush=True)
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arrangements", default=",".join(ARRANGEMENTS))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--stream-tokens", type=int, default=2000, help="answer length of the 8 streams")
    p.add_argument("--warmup-tokens", type=int, default=12)
    p.add_argument("--model", default=None)
    p.add_argument("--log-dir", default="/tmp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start", flush=True)
    results = run_all(args)
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
