"""Where a decode step's time goes: torch.profiler over a few engine steps at one batch size.

    python bench/profile_step.py --batch-size 32 --threads 1
    python bench/profile_step.py --prefill 2048 --threads 1     # one whole prefill instead

The C++ kernels are pybind functions, invisible to the profiler, so each is wrapped in a
record_function named `kernel::<name>`; the table lists operators by self CPU time, and the
summary splits the step into the quantized matmuls, decode attention and everything else.
"""
from __future__ import annotations

import argparse
import functools
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from splitserve import kernels
from splitserve_runs import _params, _random_prompt, _run_until_first_token, build_engine

WRAPPED = ("linear", "linear_q8", "paged_decode_attention", "paged_prefill_attention", "dequantize", "add_rms_norm",
           "rope_kv_write", "silu_mul")


def wrap_kernels() -> None:
    module = kernels.load()
    if module is None:
        raise SystemExit("kernels not built: run `python -m splitserve.kernels.build` first")
    for name in WRAPPED:
        fn = getattr(module, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _name=name):
            with record_function(f"kernel::{_name}"):
                return _fn(*args)
        setattr(module, name, timed)


def matmul_rates(model, rows: int, threads: int) -> None:
    """GFLOP/s of every layer matrix plus the LM head at `rows` rows of x: the block kernel as the
    engine calls it, against fp32 F.linear on the same (dequantized) weights and a large fp32 GEMM."""
    import hardware
    from splitserve.models.gguf_blocks import GGUFBlocks, linear

    torch.set_num_threads(threads)
    mats = [layer[name] for layer in model.layers for name in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
    if not all(isinstance(m, GGUFBlocks) for m in mats):
        print("weights are not GGUF blocks: no block-kernel rate to measure")
        return
    fp32 = [m.dequantize() for m in mats]
    flops = sum(2.0 * rows * m.shape[0] * m.shape[1] for m in mats)
    xs = {m.shape[1]: torch.randn(rows, m.shape[1]) for m in mats}

    def best(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.process_time() if threads == 1 else time.perf_counter()
            fn()
            times.append((time.process_time() if threads == 1 else time.perf_counter()) - t0)
        return min(times)

    blocks_s = best(lambda: [linear(xs[m.shape[1]], m) for m in mats])
    fp32_s = best(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in fp32])
    gemm = hardware.matmul_gflops(2048, 576, 1536, threads, min_seconds=0.3, max_repeats=5).quiet_gflops
    print(f"matmuls at {rows} rows, {threads} thread(s) ({'CPU' if threads == 1 else 'wall'} time): "
          f"block kernel {blocks_s * 1e3:.1f} ms = {flops / blocks_s / 1e9:.1f} GFLOP/s; fp32 F.linear "
          f"{fp32_s * 1e3:.1f} ms = {flops / fp32_s / 1e9:.1f} GFLOP/s; fp32 GEMM [2048,576]x[576,1536] "
          f"{gemm:.1f} GFLOP/s -> block kernel at {flops / blocks_s / 1e9 / gemm:.0%} of the GEMM rate")


def profile_prefill(args) -> None:
    """One whole prefill of --prefill tokens (after a warm-up prefill of the same length)."""
    engine = build_engine(args.prefill, 1, kv_cache_memory="512MiB", weight_format=args.weight_format)
    generator = torch.Generator().manual_seed(0)
    engine.add_request("warm", _random_prompt(engine, args.prefill, generator), _params(1))
    _run_until_first_token(engine, {"warm"})
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("p", _random_prompt(engine, args.prefill, generator), _params(1))
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("engine_step"):
            engine.step()
    wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    step_ms = next(e.cpu_time_total for e in events if e.key == "engine_step") / 1e3
    print(f"prefill of {args.prefill} tokens, {args.threads} thread(s): {step_ms:.1f} ms under the profiler "
          f"({wall_ms:.1f} ms wall); by self CPU time:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"  {e.key:<40}{e.self_cpu_time_total / 1e3:9.1f} ms  {e.self_cpu_time_total / 1e3 / step_ms:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--weight-format", default="auto", choices=["auto", "fp32", "gguf", "gguf-q8act"])
    parser.add_argument("--prefill", type=int, default=0,
                        help="profile one whole prefill of this many tokens instead of decode steps")
    parser.add_argument("--matmul-rate", action="store_true",
                        help="also time the step's matmuls alone against fp32 F.linear and a large GEMM")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wrap_kernels()
    if args.prefill:
        return profile_prefill(args)
    engine = build_engine(args.prompt_len, args.batch_size, kv_cache_memory="512MiB",
                          weight_format=args.weight_format)
    generator = torch.Generator().manual_seed(0)
    ids = [f"p{i}" for i in range(args.batch_size)]
    for request_id in ids:
        engine.add_request(request_id, _random_prompt(engine, args.prompt_len, generator),
                           _params(args.steps + 8))
    _run_until_first_token(engine, set(ids))
    engine.step()  # warm-up
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function("engine_step"):
                engine.step()
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    step_ms = next(e.cpu_time_total for e in events if e.key == "engine_step") / 1e3 / args.steps
    by_kernel = {e.key: e.cpu_time_total / 1e3 / args.steps for e in events if e.key.startswith("kernel::")}
    matmul = by_kernel.get("kernel::linear", 0.0) + by_kernel.get("kernel::dequantize", 0.0)
    attention = by_kernel.get("kernel::paged_decode_attention", 0.0)
    aten_mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm")) / 1e3 / args.steps
    print(f"batch {args.batch_size}, {args.threads} thread(s): step {step_ms:.1f} ms under the profiler "
          f"({wall_ms:.1f} ms wall)")
    for name, ms in sorted(by_kernel.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34}{ms:8.2f} ms  {ms / step_ms:6.1%}")
    rest = step_ms - matmul - attention - aten_mm
    print(f"  matmul (block kernel + aten mm)   {matmul + aten_mm:8.2f} ms  {(matmul + aten_mm) / step_ms:6.1%}")
    print(f"  decode attention                  {attention:8.2f} ms  {attention / step_ms:6.1%}")
    print(f"  everything else                   {rest:8.2f} ms  {rest / step_ms:6.1%}")
    if args.matmul_rate:
        matmul_rates(engine.runner.model, args.batch_size, args.threads)


if __name__ == "__main__":
    main()
