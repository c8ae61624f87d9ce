"""Decode step time of the engine at 1 and 2 threads, per weight format: a quick check of thread
scaling that takes about a minute (bench/engine.py is the full benchmark).

    python bench/engine_threads.py --weight-format auto      # then: --weight-format fp32

Per batch size: that many 224-token random prompts are prefilled, then one warm-up and 6 timed
pure-decode steps run at each thread count (contexts ~225-240); prints the fastest step's wall
and CPU time.
"""
from __future__ import annotations

import argparse
import time

import torch

from splitserve_runs import _params, _random_prompt, _run_until_first_token, build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weight-format", default="auto", choices=["auto", "fp32", "gguf"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    engine = build_engine(256, max(args.batch_sizes), kv_cache_memory="512MiB", weight_format=args.weight_format)
    generator = torch.Generator().manual_seed(0)
    for batch_size in args.batch_sizes:
        ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
        for request_id in ids:
            engine.add_request(request_id, _random_prompt(engine, 224, generator),
                               _params(len(args.threads) * (args.steps + 1) + 2))
        _run_until_first_token(engine, set(ids))
        for threads in args.threads:
            torch.set_num_threads(threads)
            engine.step()  # warm-up at this thread count
            wall, cpu = [], []
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                engine.step()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            print(f"{args.weight_format} batch {batch_size} threads {threads}: "
                  f"step {min(wall) * 1e3:.1f} ms wall, {min(cpu) * 1e3:.1f} ms CPU", flush=True)
        for request_id in ids:
            engine.abort_request(request_id)


if __name__ == "__main__":
    main()
