"""Which reading of the box follows the engine's own step time? (issue 28, session 31)

On one VM an hour apart, the engines' prompt steps ran 10-40% slower while the trial's host-speed
loop (trial/hostwatch.speed_benchmark, pure Python) stayed within 2% (docs/benchmarks.md,
"Planner", session 31). This times, interleaved round after round for --minutes, on one thread:
the Python loop; a 1,024 x 1,024 fp32 matmul (compute, past L2); a 64 MiB copy (memory bandwidth);
and the bundled model's in-process engine steps: a fresh 128-token prompt and a 16-request decode
at context 64. It prints each reading's spread (max / min over rounds) and how each moves with the
engine's steps (the Pearson correlation over rounds, and the spread of step / reading: a reading
that carried step time from one moment to another would hold that ratio flat).

    python bench/box_speed.py [--minutes 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from splitserve_runs import _params, _random_prompt, _run_until_first_token, build_engine  # noqa: E402

from splitserve.trial.hostwatch import speed_benchmark  # noqa: E402


def gemm_gflops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def copy_gb_s(mib: int = 64, repeats: int = 5) -> float:
    src = torch.empty(mib << 18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9  # read + write


def prompt_step_s(engine, gen, k: int) -> float:
    rid = f"p{k}"
    engine.add_request(rid, _random_prompt(engine, 128, gen), _params(1))
    t = time.perf_counter()
    _run_until_first_token(engine, {rid})
    return time.perf_counter() - t


def decode_step_s(engine, gen, k: int, batch: int = 16, context: int = 64) -> float:
    ids = {f"d{k}-{i}" for i in range(batch)}
    for rid in ids:
        engine.add_request(rid, _random_prompt(engine, context, gen), _params(8))
    _run_until_first_token(engine, ids)  # prefills, untimed
    times = []
    for _ in range(4):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = build_engine(16 * 512 + 64, 16)
    gen = torch.Generator().manual_seed(0)
    prompt_step_s(engine, gen, -1)  # warm-up: lazy initialization
    rounds, k, stop = [], 0, time.monotonic() + args.minutes * 60
    while time.monotonic() < stop:
        row = {"t_s": round(args.minutes * 60 - (stop - time.monotonic()), 1),
               "loop_units_per_s": speed_benchmark(), "gemm_gflops": gemm_gflops(), "copy_gb_s": copy_gb_s(),
               "prompt128_s": min(prompt_step_s(engine, gen, 3 * k + j) for j in range(3)),
               "decode16_s": decode_step_s(engine, gen, k)}
        rounds.append(row)
        print(" ".join(f"{key} {value:.4g}" for key, value in row.items()), flush=True)
        k += 1
    engine.close()
    readings = ("loop_units_per_s", "gemm_gflops", "copy_gb_s")
    report = {"rounds": rounds, "spread": {}, "vs_steps": {}}
    for key in readings + ("prompt128_s", "decode16_s"):
        values = [r[key] for r in rounds]
        report["spread"][key] = max(values) / min(values)
    print("spread (max / min over rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in report["spread"].items()))
    for step in ("prompt128_s", "decode16_s"):
        for key in readings:
            speed = np.array([r[key] for r in rounds])
            times = np.array([r[step] for r in rounds])
            corr = float(np.corrcoef(times, 1 / speed)[0, 1]) if len(rounds) > 2 else float("nan")
            ratio = times * speed  # flat if the reading carries the step's time
            report["vs_steps"][f"{step}~{key}"] = {"corr_with_slowness": corr,
                                                   "ratio_spread": float(ratio.max() / ratio.min())}
            print(f"{step} against 1/{key}: correlation {corr:+.2f}, step x reading spread "
                  f"{ratio.max() / ratio.min():.2f} (the step alone {report['spread'][step]:.2f})")
    if args.json:
        args.json.write_text(json.dumps({"machine": _machine(), **report}, indent=1))
    return 0


def _machine() -> dict:
    from splitserve.control.profile import machine_info

    info = machine_info()
    return {k: info[k] for k in ("cpu_model", "flags", "num_cores", "speed_units_per_s")}


if __name__ == "__main__":
    sys.exit(main())
