"""splitserve against llama.cpp on the bundled Q4_1 GGUF, side by side in one run (issue 16):

1. the batch-1 decode step at 1 and 2 threads: splitserve's engine step (EngineCore, in process)
   and llama.cpp's `llama_decode` of one token (bench/llamacpp_baseline.py in llama.cpp's venv);
2. the aggregate tokens/s of N concurrent streaming chats through each system's HTTP server:
   `splitserve serve` against `python -m llama_cpp.server`, the same requests, every stream
   checked to the end (a stream that stops without a finish_reason, errors or times out is cut).

    python bench/llamacpp_compare.py --llamacpp-python /path/to/venv/bin/python
    python bench/llamacpp_compare.py --skip http          # the decode steps only

Without a Python that imports llama_cpp the llama.cpp parts are skipped with the command that
installs it (bench/setup_llamacpp.sh). Tokens are counted as streamed chunks with content (both
servers send one token a chunk); the stream's own usage is not asked for, as llama-cpp-python's
server does not report it while streaming.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from engine import LLAMACPP_PYTHON, REPO_DIR, BENCH_DIR, bundled_gguf, cpu_info, llamacpp_missing
from records import as_row
from splitserve_runs import build_engine, engine_decode, system_name

DEFAULT_JSON = BENCH_DIR / "results" / "llamacpp_compare.json"
TOPICS = ["the history of bread", "how tides work", "a day on a fishing boat", "why the sky is blue",
          "the rules of chess", "how a bicycle stays upright", "the life of a honey bee", "volcanoes"]


def decode_rows(args) -> tuple[list[dict], dict, dict]:
    """Batch-1 decode rows of both systems, llama.cpp's build info, and what was skipped."""
    rows = []
    for weight_format in args.weight_formats:
        engine = build_engine(args.prompt_len, 1, kv_cache_memory="256MiB", weight_format=weight_format)
        rows += [as_row(r) for r in engine_decode(engine, [1], args.prompt_len, args.decode_steps, args.threads,
                                                  torch.Generator().manual_seed(0), system_name(weight_format))]
        del engine
    why = llamacpp_missing(args.llamacpp_python)
    if why:
        return rows, {}, {"llama.cpp decode": why}
    cmd = [str(args.llamacpp_python), str(BENCH_DIR / "llamacpp_baseline.py"), "--model", str(bundled_gguf()),
           "--threads", *map(str, args.threads), "--prefill-tokens", "--batch-sizes", "1",
           "--prompt-len", str(args.prompt_len), "--decode-steps", str(args.decode_steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return rows, {}, {"llama.cpp decode": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return rows + report["rows"], report["info"], {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(system: str, args, port: int, log: pathlib.Path) -> subprocess.Popen:
    if system.startswith("splitserve"):
        # "splitserve": one instance on every thread; "splitserve-2x1": two 1-thread instances, etc.
        instances, threads = (1, args.http_threads) if system == "splitserve" else \
            map(int, system.split("-", 1)[1].split("x"))
        if instances * threads != args.http_threads:
            raise SystemExit(f"{system}: {instances}x{threads} threads is not --http-threads {args.http_threads}")
        cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--instances", str(instances),
               "--threads-per-instance", str(threads), "--max-num-seqs", str(args.streams),
               "--log-level", "warning"]
    else:
        cmd = [str(args.llamacpp_python), "-m", "llama_cpp.server", "--model", str(bundled_gguf()),
               "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.http_threads),
               "--n_threads_batch", str(args.http_threads), "--n_ctx", "4096",
               # its default (True) ends a running stream whenever a new request arrives: with 32
               # concurrent clients that cuts 31 of them; False queues them, its best case here
               "--interrupt_requests", "False"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.http_threads)}
    return subprocess.Popen(cmd, cwd=REPO_DIR, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen, base_url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during startup")
        try:
            if httpx.get(base_url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {base_url} not ready after {timeout_s} s")


async def one_stream(client: httpx.AsyncClient, base_url: str, body: dict, timeout_s: float) -> dict:
    start = time.monotonic()
    tokens, finish, ttft, error = 0, None, None, None
    try:
        async with client.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                await r.aread()
                return {"tokens": 0, "finish": None, "error": f"HTTP {r.status_code}: {r.text[:200]}",
                        "ttft": None, "seconds": time.monotonic() - start}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                    break
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        tokens += 1
                        ttft = ttft if ttft is not None else time.monotonic() - start
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    return {"tokens": tokens, "finish": finish, "error": error, "ttft": ttft,
            "seconds": time.monotonic() - start}


async def burst(base_url: str, args) -> dict:
    bodies = [{"stream": True, "temperature": 0, "max_tokens": args.max_tokens,
               "messages": [{"role": "user", "content": f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}. "
                                                         f"Essay number {i}."}]}
              for i in range(args.streams)]
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        model = (await client.get(base_url + "/v1/models")).json()["data"][0]["id"]
        for body in bodies:
            body["model"] = model
        await one_stream(client, base_url, dict(bodies[0], max_tokens=4), 120)  # warm-up
        start = time.monotonic()
        results = await asyncio.gather(*(one_stream(client, base_url, b, args.stream_timeout) for b in bodies))
        seconds = time.monotonic() - start
    cut = [r for r in results if r["error"] or r["finish"] is None]
    total = sum(r["tokens"] for r in results)
    return {"streams": args.streams, "max_tokens": args.max_tokens, "seconds": round(seconds, 2),
            "tokens": total, "tokens_per_s": round(total / seconds, 1), "streams_cut": len(cut),
            "finish_reasons": sorted({str(r["finish"]) for r in results}),
            "errors": [r["error"] for r in cut][:3],
            "median_ttft_s": round(sorted(r["ttft"] or seconds for r in results)[len(results) // 2], 2)}


def http_rows(args, systems: list[str], log_dir: pathlib.Path) -> dict:
    out = {}
    for system in systems:
        port = free_port()
        proc = start_server(system, args, port, log_dir / f"{system}.log")
        try:
            try:
                wait_ready(proc, f"http://127.0.0.1:{port}")
            except (RuntimeError, TimeoutError) as exc:
                tail = (log_dir / f"{system}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{system} server did not start: {exc}\n{tail}") from None
            out[system] = asyncio.run(burst(f"http://127.0.0.1:{port}", args))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"[http] {system}: {out[system]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", type=pathlib.Path, default=LLAMACPP_PYTHON)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-len", type=int, default=224)
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--http-threads", type=int, default=2, help="threads each server may use")
    parser.add_argument("--stream-timeout", type=float, default=600.0)
    parser.add_argument("--weight-formats", nargs="+", default=["auto"], choices=["auto", "gguf", "gguf-q8act", "fp32"],
                        help="engine weight formats for the batch-1 decode rows (auto: 'splitserve'; others "
                             "'splitserve-<format>'; gguf-q8act: 8-bit activations at batch 1-2, as llama.cpp)")
    parser.add_argument("--splitserve-layouts", nargs="+", default=["1x2"],
                        help="splitserve servers to run, instances x threads (each using --http-threads in all); "
                             "the first is reported as 'splitserve', others as 'splitserve-IxT'")
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode", "http"])
    parser.add_argument("--json", type=pathlib.Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_start": os.getloadavg(),
              "cpu_info": cpu_info(), "num_cpus": os.cpu_count(), "skipped": {}}
    if "decode" not in args.skip:
        report["decode"], report["llamacpp_info"], skipped = decode_rows(args)
        report["skipped"].update(skipped)
        for row in report["decode"]:
            print(f"[decode] {row['system']} batch 1, {row['threads']} thread(s): step "
                  f"{row['batch_size'] / row['quiet_tokens_per_s'] * 1e3:.1f} ms (quiet), "
                  f"{row['batch_size'] / row['tokens_per_s'] * 1e3:.1f} ms (wall)", flush=True)
    if "http" not in args.skip:
        systems = ["splitserve" if i == 0 else f"splitserve-{layout}"
                   for i, layout in enumerate(args.splitserve_layouts)]
        if args.splitserve_layouts[0] != f"1x{args.http_threads}":
            systems[0] = f"splitserve-{args.splitserve_layouts[0]}"
        why = llamacpp_missing(args.llamacpp_python)
        if why:
            report["skipped"]["llama.cpp http"] = why
        else:
            systems.append("llama.cpp")
        with tempfile.TemporaryDirectory() as logs:
            report["http"] = http_rows(args, systems, pathlib.Path(logs))
    report["loadavg_end"] = os.getloadavg()
    for name, why in report["skipped"].items():
        print(f"SKIPPED {name}: {why}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
