"""Where the GGUF block kernel should hand over to dequantize + fp32 GEMM on this CPU, and what the
engine's prompt steps gain from measuring it (serve --kernel-rows auto) against the fixed 64 rows.

    python bench/kernel_rows.py [--threads 1] [--repeats 5] [--json out.json]

Part 1: each distinct matrix shape of the bundled model, x[M, K] @ W on both paths at M = 8..128
(fastest of --repeats), and the crossover calibrate_kernel_rows picks from its two row counts.
Part 2: one engine per setting (kernel rows 64 and auto), lone prompts of 16..512 tokens, the two
engines alternating step by step, each length --repeats times; the ratio auto / 64 of the fastest.
Run it with nothing else on the box; it names the CPU with every figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.control.profile import StepTimer, machine_info
    from splitserve.engine.core import EngineCore
    from splitserve.models import gguf_blocks
    from splitserve.models.llama import LlamaModel
    from splitserve.models.loader import load_model

    machine = machine_info()
    print(f"CPU: {machine.get('cpu_model')} flags {' '.join(machine.get('flags', []))}; threads {args.threads}")
    loaded = load_model(None)
    mats = {}
    for w in LlamaModel(loaded.config, loaded.weights).block_matrices():
        mats.setdefault((w.fmt, *w.shape), w)
    out = {"machine": machine, "threads": args.threads, "shapes": [], "prompts": []}
    for key, w in mats.items():
        rows = {}
        for m in (8, 16, 24, 32, 48, 64, 96, 128):
            t = gguf_blocks.time_both_paths(w, m, repeats=args.repeats)
            rows[m] = t
        chosen = gguf_blocks.crossover_rows((rows[16][0], rows[64][0]), (rows[16][1], rows[64][1]))
        measured = next((m for m in sorted(rows) if rows[m][1] < rows[m][0]), None)
        print(f"{key[0]} {key[1]}x{key[2]}: " + "  ".join(f"M{m} {k * 1e3:.2f}/{d * 1e3:.2f}" for m, (k, d) in rows.items())
              + f"  (kernel/dense ms) -> calibrated {chosen}, dense first faster at M={measured}")
        out["shapes"].append({"shape": list(key), "ms": {m: [k * 1e3, d * 1e3] for m, (k, d) in rows.items()},
                              "calibrated": chosen, "dense_first_faster_at": measured})
    lengths = (16, 32, 48, 64, 96, 128, 256, 512)
    times: dict[str, dict[int, list[float]]] = {"64": {n: [] for n in lengths}, "auto": {n: [] for n in lengths}}
    timers = {}
    for label, kernel_rows in (("64", 64), ("auto", None)):
        start = time.perf_counter()
        core = EngineCore(EngineConfig(num_threads=args.threads, kernel_rows=kernel_rows,
                                       cache=CacheConfig(kv_cache_memory=64 * 2**20, enable_prefix_caching=True),
                                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048)), loaded)
        print(f"engine kernel rows {label}: {core.kernel_rows} (engine start {time.perf_counter() - start:.2f} s)")
        timers[label] = StepTimer(core, args.repeats, lambda s: None, seed=len(timers))
        timers[label].measure_prefill(64)  # warm-up
    # the two engines alternate step by step, so drift in the host's speed falls on both alike
    for n in lengths:
        for _ in range(args.repeats):
            for label, timer in timers.items():
                times[label][n].append(timer.prefill([], n)[0])
    for timer in timers.values():
        timer.core.close()
    for n in lengths:
        a, b = min(times["64"][n]), min(times["auto"][n])
        print(f"prompt {n:4d}: 64 rows {a * 1e3:7.1f} ms (median {statistics.median(times['64'][n]) * 1e3:.1f}), "
              f"auto {b * 1e3:7.1f} ms (median {statistics.median(times['auto'][n]) * 1e3:.1f}): x{b / a:.2f}")
        out["prompts"].append({"tokens": n, "fixed64_s": times["64"][n], "auto_s": times["auto"][n]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
