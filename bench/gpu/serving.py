"""The stall and the KV handover, through real `splitserve serve` processes on one device.

For each arrangement a server is started through the CLI (`python -m splitserve.cli serve`, so
the check never imports the HTTP layer), then, as bench/kv_transfer_engine.py does at CPU scale:
a long prompt alone (a warm path, and on 1P1D a handover with nothing else running), then
`streams` short prompts decoding (greedy, ignore_eos) until each has `warmup_tokens` tokens, then
the long prompt arrives; each stream's longest pause from that arrival until `settle_s` after
the long answer's last token is the headline, per stream. Everything is timed as a client sees
it, over HTTP/SSE, by the token ids each chunk names (`return_token_ids`).

On 1P1D the two engine processes share the device, each with half the KV memory the colocated
engine has, and the KV moves over the tcp transport (on CUDA: each layer gathered on the device,
staged through a pinned host buffer, sent over loopback, received into one, copied up; the shm
transport maps host memory and so serves CPU pools only; CUDA IPC is not implemented).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_transfer_engine import Server, longest_gap, stream  # noqa: E402

from splitserve.devices import synchronize  # noqa: E402


def arrangements(chunk_tokens: int, long_tokens: int, kv_cache_mib: int, threads: int) -> dict[str, list[str]]:
    whole_budget = str(long_tokens + 256)  # the long prompt and every stream's decode in one step
    return {
        "colocated-whole": ["--instances", "1", "--threads-per-instance", str(2 * threads),
                            "--prefill-policy", "whole", "--max-num-batched-tokens", whole_budget,
                            "--kv-cache-memory", f"{kv_cache_mib}MiB"],
        "colocated-chunked": ["--instances", "1", "--threads-per-instance", str(2 * threads),
                              "--prefill-policy", "chunked", "--max-num-batched-tokens", str(chunk_tokens),
                              "--kv-cache-memory", f"{kv_cache_mib}MiB"],
        "1P1D": ["--prefill", "1", "--decode", "1", "--threads-per-instance", str(threads), "--kv-transport", "tcp",
                 "--prefill-policy", "whole", "--max-num-batched-tokens", whole_budget,
                 "--kv-cache-memory", f"{kv_cache_mib // 2}MiB"],
    }


async def measure(url: str, vocab: int, streams: int, long_tokens: int, stream_tokens: int,
                  warmup_tokens: int, settle_s: float) -> dict:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    async with httpx.AsyncClient(timeout=600) as client:
        lone: list[float] = []
        lone_report: dict = {}
        started = time.perf_counter()
        await stream(client, url, prompt(long_tokens), 2, lone, lone_report)
        lone_ttft = lone[0] - started
        times = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(stream(client, url, prompt(32), stream_tokens, t)) for t in times]
        while min(len(t) for t in times) < warmup_tokens:
            await asyncio.sleep(0.01)
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a stream ended during warmup: {[t.exception() for t in tasks if t.done()]}")
        # the mean gap per stream over the warmup: a decode instance's tokens may reach the client
        # several to a chunk, so single gaps can be zero
        step = statistics.median((t[-1] - t[2]) / (len(t) - 3) for t in times)
        long_times: list[float] = []
        report: dict = {}
        arrival = time.perf_counter()
        await stream(client, url, prompt(long_tokens), 8, long_times, report)
        end = long_times[-1] + settle_s
        while time.perf_counter() < end:
            await asyncio.sleep(0.02)
        if any(t.done() for t in tasks):
            raise RuntimeError("a stream ended before the measurement did: raise stream_tokens")
        pauses = [longest_gap(t, arrival, end)[0] for t in times]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"no_load_step_s": step, "longest_pause_per_stream_s": pauses, "longest_pause_s": max(pauses),
            "pause_over_step": max(pauses) / step, "long_ttft_s": long_times[0] - arrival,
            "lone_long_ttft_s": lone_ttft, "kv_transfer": report.get("kv_transfer"),
            "lone_kv_transfer": lone_report.get("kv_transfer")}


def run_arrangements(model: str, device: str, dtype: str, flags: dict[str, list[str]], log_dir: Path,
                     **sizes) -> dict:
    """{arrangement: measurement or {"error": ..., "log_tail": ...}}."""
    results = {}
    for name, arrangement in flags.items():
        log = log_dir / f"serve-{name}.log"
        started = time.perf_counter()
        server = Server(["--model", model, "--device", device, "--dtype", dtype, *arrangement], log)
        try:
            server.wait_ready(timeout_s=240)  # a hung start must not eat the whole device run
            ready = time.perf_counter()
            results[name] = asyncio.run(measure(server.url, **sizes))
            results[name].update(startup_s=ready - started, measure_s=time.perf_counter() - ready)
        except Exception as e:  # noqa: BLE001 - one arrangement failing must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            server.stop()
        if "error" in results[name]:
            results[name]["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    return results


def copy_rates(num_bytes: int, device: str, repeats: int = 20) -> dict:
    """GB/s of one copy of `num_bytes` from the device to the host: into pinned and into pageable
    memory on CUDA (what the handover's staging is measured against), host to host on the CPU."""
    dev = torch.device(device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=dev).fill_(1)
    targets = {"pinned": torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)} if dev.type == "cuda" else {}
    targets["pageable"] = torch.empty(num_bytes, dtype=torch.uint8)
    rates = {}
    for kind, dst in targets.items():
        seconds = []
        for _ in range(repeats + 1):
            synchronize(dev)
            started = time.perf_counter()
            dst.copy_(src)
            synchronize(dev)
            seconds.append(time.perf_counter() - started)
        rates[f"{'device_to_host' if dev.type == 'cuda' else 'host_to_host'}_{kind}_gbps"] = \
            num_bytes / statistics.median(seconds[1:]) / 1e9
    return rates


def handover(stall: dict, device: str) -> dict:
    """The 1P1D run's transfers as GB/s, beside a device-to-host copy of the same bytes now."""
    split = stall.get("1P1D", {})
    if "error" in split:
        raise RuntimeError(f"the 1P1D arrangement failed: {split['error']}")
    out = {"transport": "tcp",
           "staging": "pinned host buffers (device gather -> pinned -> loopback socket -> pinned -> device)"
           if device.startswith("cuda") else "none: a CPU pool's blocks go to the socket as byte views"}
    for key in ("lone_kv_transfer", "kv_transfer"):
        report = split.get(key) or {}
        if report.get("outcome") != "ok" or not report.get("seconds"):
            raise RuntimeError(f"the long prompt's handover ({key}) did not succeed: {report}")
        out[key] = {"bytes": report["bytes"], "seconds": report["seconds"],
                    "gbps": report["bytes"] / report["seconds"] / 1e9}
    num_bytes = out["lone_kv_transfer"]["bytes"]
    out["copy_same_bytes"] = copy_rates(num_bytes, device)
    best = max(out["copy_same_bytes"].values())
    out["handover_over_best_copy"] = out["lone_kv_transfer"]["gbps"] / best
    return out
