"""KV transfer throughput: one 2k-token request of SmolLM2-135M's KV, moved from a
prefill process to this (decode) process over shm and tcp, against a memcpy of the
same bytes measured in the same run.

    .venv/bin/python bench/kv_transfer.py                 # shm and tcp, scattered block ids
    .venv/bin/python bench/kv_transfer.py --layout contiguous --repeats 9 --json out.json
    .venv/bin/python bench/kv_transfer.py --secret --skip-prefill --skip-engine   # + HMAC-tagged runs

A transfer's time is what the decode side's connector records: connect + handshake +
Begin + copy + Confirm, i.e. everything between "blocks allocated" and "blocks usable".
Then, unless --skip-engine, the engine-level parts (bench/kv_transfer_engine.py): real
servers with the bundled model at 2 cores in total, colocated-whole, colocated-chunked and
1 prefill + 1 decode; TTFT of a 2k-token prompt, the gap to its second token (where the
transfer sits), and the longest pause of 8 decoding streams when it arrives.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer,  # noqa: E402
                                    KVTransferConfig, TransferDescriptor, TransferOutcome,
                                    allocate_kv_pool,
                                    make_transport, segment_name)

# SmolLM2-135M (the bundled model): 30 layers, 3 KV heads of 64, fp32, blocks of 16 tokens.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return (NUM_LAYERS, 2, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)  # engine layout


def block_ids(layout: str, num_blocks: int, pool_blocks: int, seed: int) -> list[int]:
    if layout == "contiguous":
        return list(range(num_blocks))
    return random.Random(seed).sample(range(pool_blocks), num_blocks)


def serve(args) -> None:
    """The prefill process: hold `--repeats` requests on the same blocks, serve them, exit."""
    torch.set_num_threads(args.threads)
    secret = args.secret_file.read_bytes() if args.secret_file else None
    config = KVTransferConfig(transport=args.serve, lease_s=600, secret=secret)
    shape = pool_shape(args.pool_blocks)
    if args.serve == "shm":
        kv, handle = allocate_kv_pool(shape, torch.float32, segment_name("bench-prefill"))
        kv.copy_(torch.randn(shape))
    else:
        kv, handle = torch.randn(shape), None
    sender = KVSender(config, kv, "bench-prefill", shm_name=handle.name if handle else "")
    ids = block_ids(args.layout, args.num_blocks, args.pool_blocks, seed=1)
    with KVServer(sender):
        for i in range(args.repeats):
            descriptor = sender.register(f"req-{i}", ids, args.tokens)
            print(msgspec.json.encode(descriptor).decode(), flush=True)
        released = 0
        while released < args.repeats:
            released += len(sender.poll())
            time.sleep(0.005)
    if handle is not None:
        handle.close()


class Memcpy:
    """libc memcpy (memmove) of the same number of bytes: the ceiling for a same-host copy."""

    def __init__(self, num_bytes: int):
        self.src = torch.randn(num_bytes // 4)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # first touch of dst's pages is not part of a copy

    def once(self) -> tuple[float, int]:
        num_bytes = self.src.numel() * 4
        start = time.perf_counter()
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), num_bytes)
        return time.perf_counter() - start, num_bytes


class RemotePrefill:
    """A prefill process holding `repeats` requests; `once()` pulls the next one."""

    def __init__(self, transport: str, args, secret_file: Path | None = None):
        secret = ["--secret-file", str(secret_file)] if secret_file else []
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", transport, "--tokens", str(args.tokens),
             "--repeats", str(args.repeats), "--layout", args.layout,
             "--threads", str(args.threads), *secret], stdout=subprocess.PIPE, text=True)
        self.descriptors = [msgspec.json.decode(self.process.stdout.readline(),
                                                type=TransferDescriptor)
                            for _ in range(args.repeats)]
        config = KVTransferConfig(transport=transport, max_concurrent_transfers=1,
                                  secret=secret_file.read_bytes() if secret_file else None)
        dst = torch.zeros(pool_shape(args.pool_blocks))
        dst_ids = block_ids(args.layout, args.num_blocks, args.pool_blocks, seed=2)
        self.receiver = KVReceiver(config, dst, make_transport(config),
                                   allocate=lambda request_id, n: DestinationBlocks(list(dst_ids)),
                                   free=lambda *_: None)

    def once(self) -> tuple[float, int]:
        self.receiver.add(self.descriptors.pop(0))
        ended = []
        while not ended:
            ended = self.receiver.poll()
            time.sleep(0.0005)
        record = ended[0]
        if record.outcome is not TransferOutcome.DONE:
            raise RuntimeError(f"{record.transport} transfer failed: {record.error}")
        return record.seconds, record.num_bytes

    def close(self) -> None:
        self.receiver.close()
        try:
            self.process.wait(timeout=60)
        finally:
            self.process.kill()
            self.process.wait()


def measure_prefill(tokens: int, threads: int) -> float:
    """Seconds for the bundled model to prefill `tokens` tokens in one step (whole prompt)."""
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore
    from splitserve.sampling import SamplingParams

    core = EngineCore(EngineConfig(num_threads=threads, cache=CacheConfig(kv_cache_memory="256MiB"),
                                   scheduler=SchedulerConfig(prefill_policy="whole",
                                                             max_num_batched_tokens=2 * tokens)))
    shape = (core.model_config.num_layers, core.model_config.num_kv_heads,
             core.model_config.head_dim)
    assert shape == (NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), f"bundled model is {shape}"
    rng = random.Random(0)
    prompt = [rng.randrange(100, core.model_config.vocab_size) for _ in range(tokens)]
    core.add_request("prefill", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered",
                        help="block ids on both sides: random (a pool after churn) or in order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--skip-prefill", action="store_true",
                        help="do not time the bundled model's prefill of the same prompt")
    parser.add_argument("--skip-engine", action="store_true",
                        help="skip the end-to-end part (three servers, a few minutes)")
    parser.add_argument("--engine-log-dir", default="/tmp", help="server logs of the end-to-end part")
    parser.add_argument("--secret", action="store_true",
                        help="also time each transport with a KV secret (handshake + an HMAC tag on every "
                             "frame and run of KV bytes), as `serve` sets one by default")
    parser.add_argument("--serve", choices=("shm", "tcp"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--secret-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.num_blocks = -(-args.tokens // BLOCK_SIZE)
    args.pool_blocks = 2 * args.num_blocks
    if args.serve:
        return serve(args)
    torch.set_num_threads(args.threads)

    num_bytes = args.num_blocks * BLOCK_SIZE * NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4
    methods = {"memcpy": Memcpy(num_bytes)}
    secret_file = None
    try:
        if args.secret:
            fd, name = tempfile.mkstemp(prefix="bench-kv-secret-")  # mode 0600
            os.write(fd, os.urandom(32).hex().encode())
            os.close(fd)
            secret_file = Path(name)
        for transport in args.transports.split(","):
            methods[transport] = RemotePrefill(transport, args)
            if secret_file is not None:
                methods[transport + "+hmac"] = RemotePrefill(transport, args, secret_file)
        # Interleaved, so that load from other processes hits every method alike.
        samples = {name: [] for name in methods}
        for _ in range(args.repeats):
            for name, method in methods.items():
                samples[name].append(method.once())
    finally:
        for method in methods.values():
            if isinstance(method, RemotePrefill):
                method.close()
        if secret_file is not None:
            secret_file.unlink()
    rows = {name: ([s for s, _ in runs], runs[0][1]) for name, runs in samples.items()}
    base = num_bytes / statistics.median(rows["memcpy"][0])
    print(f"{args.tokens}-token request, {num_bytes / 1e6:.1f} MB of KV, {args.layout} block ids, "
          f"{args.threads} thread(s), median of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'method':8} {'median ms':>10} {'best ms':>9} {'GB/s':>7} {'vs memcpy':>10}")  # +hmac: with a KV secret
    results = {}
    for name, (seconds, nbytes) in rows.items():
        rate = nbytes / statistics.median(seconds)
        print(f"{name:8} {statistics.median(seconds) * 1e3:10.1f} {min(seconds) * 1e3:9.1f} "
              f"{rate / 1e9:7.2f} {rate / base:9.0%}")
        results[name] = {"seconds": seconds, "num_bytes": nbytes, "gb_per_s": rate / 1e9,
                         "fraction_of_memcpy": rate / base}
    prefill_s = None
    if not args.skip_prefill:
        prefill_s = measure_prefill(args.tokens, args.threads)
        print(f"prefill of the same {args.tokens} tokens by the bundled model (whole, "
              f"{args.threads} thread(s)): {prefill_s:.2f} s; a transfer adds "
              + ", ".join(f"{name} {statistics.median(rows[name][0]) / prefill_s:.1%}"
                          for name in rows if name != "memcpy")
              + " of it (to the second token: the first is streamed by the prefill instance)")
    engine = None
    if not args.skip_engine:
        from kv_transfer_engine import ARRANGEMENTS, run_all

        engine_args = argparse.Namespace(arrangements=",".join(ARRANGEMENTS), streams=8, long_tokens=args.tokens,
                                         stream_tokens=2000, warmup_tokens=12, model=None,
                                         log_dir=args.engine_log_dir)
        print(f"end to end, 2 cores in total, load average {os.getloadavg()[0]:.1f}")
        engine = run_all(engine_args)
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "layout": args.layout,
                                         "threads": args.threads, "prefill_s": prefill_s,
                                         "results": results, "engine": engine}, indent=2))


if __name__ == "__main__":
    main()
