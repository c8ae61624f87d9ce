"""What this CPU can do at best: fp32 matmul FLOP/s and memory bandwidth.

The engine benchmark divides its own figures by these to say how close to the
hardware it runs; the KV-transfer benchmark reuses `copy_bandwidth` as the limit
for moving KV blocks between processes on one host.

Run alone:  .venv/bin/python bench/hardware.py [--threads 1 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from records import quiet

GIB = 1 << 30

# Shapes the bundled SmolLM2-135M runs in a 2,048-token prefill (hidden 576,
# MLP 1,536), plus a large square product that shows the BLAS peak.
MODEL_SHAPES: tuple[tuple[int, int, int], ...] = (
    (2048, 576, 1536),  # gate / up projections
    (2048, 1536, 576),  # down projection
    (2048, 576, 576),  # q / o projections
)
SQUARE_SHAPE = (2048, 2048, 2048)
MATMUL_SHAPES = MODEL_SHAPES + (SQUARE_SHAPE,)


@dataclass(slots=True)
class MatmulResult:
    threads: int
    m: int
    k: int
    n: int
    seconds: float  # best of the repeats, wall time
    cpu_seconds: float  # best of the repeats, process CPU time (see records.quiet)
    gflops: float
    quiet_gflops: float


@dataclass(slots=True)
class BandwidthResult:
    threads: int
    kind: str  # "read" (sum over a tensor) or "copy" (clone: bytes copied, traffic is 2x)
    num_bytes: int
    seconds: float  # best of the repeats, wall time
    cpu_seconds: float
    gb_per_s: float  # decimal GB (1e9 bytes) per second
    quiet_gb_per_s: float


def matmul_gflops(m: int, k: int, n: int, threads: int, min_seconds: float = 0.5,
                  max_repeats: int = 20) -> MatmulResult:
    """Best-of-N GFLOP/s of a [m,k] x [k,n] fp32 matmul (2*m*k*n FLOPs per product)."""
    torch.set_num_threads(threads)
    a = torch.randn(m, k)  # a: [m, k]
    b = torch.randn(k, n)  # b: [k, n]
    out = torch.empty(m, n)  # out: [m, n], preallocated so allocation is not timed
    torch.matmul(a, b, out=out)  # warm-up: BLAS picks kernels and touches pages
    best, best_cpu = _best_of(lambda: torch.matmul(a, b, out=out), max_repeats, min_seconds)
    flops = 2.0 * m * k * n
    return MatmulResult(threads, m, k, n, best, best_cpu, flops / best / 1e9,
                        flops / quiet(best, best_cpu, threads) / 1e9)


def _best_of(fn, max_repeats: int, min_seconds: float = 0.0) -> tuple[float, float]:
    """Best wall and best CPU time of fn over up to max_repeats calls (stop after min_seconds)."""
    best = best_cpu = float("inf")
    spent = 0.0
    for _ in range(max_repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        best, best_cpu, spent = min(best, dt), min(best_cpu, dc), spent + dt
        if min_seconds and spent >= min_seconds:
            break
    return best, best_cpu


def read_bandwidth(threads: int, num_bytes: int = GIB, repeats: int = 5) -> BandwidthResult:
    """Best-of-N bytes/s of summing a fp32 tensor: the rate at which weights can stream in.

    The tensor is far larger than any cache, so each pass reads DRAM. This is the
    bound for batch-1 decode, which must read every weight once per step.
    """
    torch.set_num_threads(threads)
    x = torch.ones(num_bytes // 4)  # x: [num_bytes / 4] fp32, pages touched by the fill
    x.sum()
    best, best_cpu = _best_of(x.sum, repeats)
    return BandwidthResult(threads, "read", num_bytes, best, best_cpu, num_bytes / best / 1e9,
                           num_bytes / quiet(best, best_cpu, threads) / 1e9)


def copy_bandwidth(threads: int, num_bytes: int = GIB // 2, repeats: int = 5) -> BandwidthResult:
    """Best-of-N bytes copied per second by an fp32 copy into a preallocated tensor.

    Reported as bytes copied (not read + written), which is what a KV transfer
    that copies blocks through shared memory is limited by.
    """
    torch.set_num_threads(threads)
    src = torch.ones(num_bytes // 4)  # src: [num_bytes / 4] fp32
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best, best_cpu = _best_of(lambda: dst.copy_(src), repeats)
    return BandwidthResult(threads, "copy", num_bytes, best, best_cpu, num_bytes / best / 1e9,
                           num_bytes / quiet(best, best_cpu, threads) / 1e9)


def measure(threads_list: list[int], quick: bool = False) -> dict:
    """Every hardware figure at each thread count, as plain dicts for JSON."""
    shapes = MATMUL_SHAPES[:1] if quick else MATMUL_SHAPES
    read_bytes = GIB // 8 if quick else GIB
    out: dict[str, list[dict]] = {"matmul": [], "bandwidth": []}
    for threads in threads_list:
        for m, k, n in shapes:
            out["matmul"].append(asdict(matmul_gflops(m, k, n, threads)))
        out["bandwidth"].append(asdict(read_bandwidth(threads, read_bytes)))
        out["bandwidth"].append(asdict(copy_bandwidth(threads, read_bytes // 2)))
    return out


def model_shape_gflops(results: dict, threads: int, quiet_figures: bool = True) -> float:
    """The matmul rate on the model's own prefill shapes: the ceiling a 2k prefill is held to.

    Total FLOPs / total time over the model-shaped products (not the big square one).
    """
    rows = [r for r in results["matmul"]
            if r["threads"] == threads and (r["m"], r["k"], r["n"]) in MODEL_SHAPES]
    flops = sum(2.0 * r["m"] * r["k"] * r["n"] for r in rows)
    seconds = sum(quiet(r["seconds"], r["cpu_seconds"], threads) if quiet_figures else r["seconds"]
                  for r in rows)
    return flops / seconds / 1e9


def bandwidth(results: dict, threads: int, kind: str = "read", quiet_figures: bool = True) -> float:
    """GB/s of the given kind at the given thread count."""
    for r in results["bandwidth"]:
        if r["threads"] == threads and r["kind"] == kind:
            return r["quiet_gb_per_s"] if quiet_figures else r["gb_per_s"]
    raise KeyError(f"no {kind} bandwidth measured at {threads} threads")


def format_table(results: dict) -> str:
    lines = [f"{'matmul fp32 [m,k]x[k,n]':<28}{'threads':>8}{'GFLOP/s':>10}{'quiet':>8}"]
    for r in results["matmul"]:
        lines.append(f"{'[%d,%d]x[%d,%d]' % (r['m'], r['k'], r['k'], r['n']):<28}"
                     f"{r['threads']:>8}{r['gflops']:>10.1f}{r['quiet_gflops']:>8.1f}")
    lines.append(f"{'memory':<28}{'threads':>8}{'GB/s':>10}{'quiet':>8}")
    for r in results["bandwidth"]:
        label = f"{r['kind']} {r['num_bytes'] / GIB:.2f} GiB"
        lines.append(f"{label:<28}{r['threads']:>8}{r['gb_per_s']:>10.1f}{r['quiet_gb_per_s']:>8.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="one shape, 128 MiB buffers")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results = measure(args.threads, args.quick)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
