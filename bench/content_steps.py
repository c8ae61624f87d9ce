"""Issue 28: does what a prompt says change how long its step takes?

The profile and bench/served_steps.py time prompts of random token ids; a trial sends windows of
real text (trial/workload.py's PromptSource over the bundled texts). The compute of a step does
not depend on the ids, but the numbers it computes do: real text gives peaked attention and
activations whose tails can fall below float32's normal range (denormals), which many x86 cores
handle by a slow microcode assist unless flush-to-zero / denormals-are-zero is set. This times
one in-process 1-thread EngineCore (as `splitserve profile` drives it) on lone prompts of each size,
four ways in turn, request by request so drift reads on all alike:

    random   fresh random ids (the profile's prompts)
    text     a fresh window of the bundled text (a trial's prompts)
    and each again with torch.set_flush_denormal(True) on the engine thread (random+ftz, text+ftz)

    python bench/content_steps.py [--sizes 32,64,128,256] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("random", "text", "random+ftz", "text+ftz")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,64,128,256")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]

    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.control.profile import StepTimer
    from splitserve.engine.core import EngineCore
    from splitserve.models.loader import load_model
    from splitserve.trial.workload import PromptSource

    torch.set_num_threads(1)
    loaded = load_model(None)
    source = PromptSource(lambda text: loaded.tokenizer.encode(text, add_special_tokens=False))
    core = EngineCore(EngineConfig(model=None, num_threads=1,
                                   cache=CacheConfig(kv_cache_memory=256 * 2**20, enable_prefix_caching=True),
                                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max(sizes) + 64)),
                      loaded)
    timer = StepTimer(core, 1, lambda *_: None, seed=7)
    random_prompt = timer.prompt
    text_rng = np.random.default_rng(5)
    rng = random.Random(3)
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {(m, n): [] for m in MODES for n in sizes}
    try:
        def one(mode: str, n: int) -> tuple[float, float]:
            torch.set_flush_denormal(mode.endswith("+ftz"))
            timer.prompt = random_prompt if mode.startswith("random") else (lambda k: source.prompt(k, text_rng))
            cpu0 = time.thread_time()
            seconds, _ = timer.prefill([], n)
            return seconds, time.thread_time() - cpu0

        for n in sizes:  # warm every path for every shape
            for mode in MODES:
                one(mode, n)
        for _ in range(args.repeats):
            for n in sizes:
                for mode in rng.sample(MODES, len(MODES)):
                    samples[(mode, n)].append(one(mode, n))
    finally:
        torch.set_flush_denormal(False)
        core.close()
    med = statistics.median
    out = {"sizes": sizes, "repeats": args.repeats, "rows": []}
    print(f"{'tokens':>6} | " + " | ".join(f"{m:>10} ms" for m in MODES) + " | text/random  ftz: random, text")
    for n in sizes:
        row = {"tokens": n}
        for m in MODES:
            row[m] = {"wall_s": [round(w, 6) for w, _ in samples[(m, n)]],
                      "cpu_s": [round(c, 6) for _, c in samples[(m, n)]]}
        wall = {m: med(row[m]["wall_s"]) for m in MODES}
        row["text_over_random"] = wall["text"] / wall["random"]
        row["ftz_over_plain"] = {"random": wall["random+ftz"] / wall["random"], "text": wall["text+ftz"] / wall["text"]}
        out["rows"].append(row)
        print(f"{n:>6} | " + " | ".join(f"{wall[m] * 1e3:13.1f}" for m in MODES)
              + f" | {row['text_over_random']:.2f}x  {row['ftz_over_plain']['random']:.2f}x, "
                f"{row['ftz_over_plain']['text']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
