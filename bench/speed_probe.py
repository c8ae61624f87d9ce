"""Issue 28: which quick benchmark follows the engine's own step speed as a VM's speed wanders?

The trial's host watch times a pure-Python integer loop before each probe (trial/hostwatch.py
speed_benchmark) and compare scales the profile by it ("at the trial's speed"). On session 34's
Zen 4 VM the engines' steps moved 0.86-1.54x the profile's models between runs of one hour while
that loop's readings did not follow them at all (correlation -0.05 over 59 runs). This times, in
turn, every `--every` seconds for `--seconds`, in one process at 1 thread:

    engine   an in-process EngineCore step as `splitserve profile` drives it: one fresh 128-token
             prompt alone (median of 3)
    loop     the host watch's Python loop (units/s)
    matmul   a fixed fp32 matmul at the engine's shapes (64 x 576 by 576 x 1536), units/s
    stream   a copy of 64 MiB (memory bandwidth), GB/s

and prints how well each benchmark's speed tracks the engine's (the correlation of 1/seconds
with its rate over the readings, and each one's spread).

    python bench/speed_probe.py [--seconds 240] [--every 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.control.profile import StepTimer
    from splitserve.models.loader import load_model
    from splitserve.engine.core import EngineCore
    from splitserve.trial.hostwatch import speed_benchmark

    torch.set_num_threads(1)
    loaded = load_model(None)
    core = EngineCore(EngineConfig(model=None, num_threads=1,
                                   cache=CacheConfig(kv_cache_memory=256 * 2**20, enable_prefix_caching=True),
                                   scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)), loaded)
    timer = StepTimer(core, 1, lambda *_: None, seed=9)
    a, b = torch.randn(64, 576), torch.randn(576, 1536)
    src, dst = torch.empty(16 * 2**20), torch.empty(16 * 2**20)  # 64 MiB of fp32 each

    def matmul_rate(duration: float = 0.15) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            torch.mm(a, b)
            n += 1
        return n / (time.perf_counter() - t0)

    def stream_rate(duration: float = 0.15) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            dst.copy_(src)
            n += 1
        return n * src.numel() * 4 / 1e9 / (time.perf_counter() - t0)

    def engine_s() -> float:
        return timer.prefill([], 128)[0]

    readings = []
    try:
        for _ in range(3):
            engine_s(), matmul_rate(), stream_rate()  # warm every path
        stop = time.monotonic() + args.seconds
        while time.monotonic() < stop:
            t0 = time.monotonic()
            prompt = statistics.median(engine_s() for _ in range(3))
            readings.append({"at_s": round(time.monotonic() - stop + args.seconds, 2), "prompt128_s": prompt,
                             "loop": speed_benchmark(0.15), "matmul": matmul_rate(), "stream_gb_s": stream_rate()})
            time.sleep(max(0.0, args.every - (time.monotonic() - t0)))
    finally:
        core.close()
    engine_rate = [1 / r["prompt128_s"] for r in readings]
    out = {"seconds": args.seconds, "every": args.every, "readings": readings, "tracking": {}}
    print(f"{len(readings)} readings; engine 128-token prompt {min(r['prompt128_s'] for r in readings) * 1e3:.0f}-"
          f"{max(r['prompt128_s'] for r in readings) * 1e3:.0f} ms")
    for name in ("loop", "matmul", "stream_gb_s"):
        values = [r[name] for r in readings]
        corr = statistics.correlation(values, engine_rate) if len(values) > 2 else None
        spread = max(values) / min(values)
        out["tracking"][name] = {"correlation_with_engine_speed": corr, "max_over_min": spread}
        print(f"  {name:12} correlation with the engine's speed {corr:+.2f}; max/min {spread:.2f} "
              f"(the engine's {max(engine_rate) / min(engine_rate):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
