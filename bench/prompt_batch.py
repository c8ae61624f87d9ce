"""Does a prompt step cost more when its tokens come from several prompts? (issue 28)

In session 15's trials, prompt steps of under 128 tokens ran 1.27-1.40x what the profile's step
model predicts, while decode steps matched it. The profile times one lone prompt per step; a
trial's prompt steps often carry several short chats. This times one engine step holding k
prompts of L tokens each at a fixed total (k x L), on the bundled model, one thread, whole
prefill (every prompt in one step), and prints each step's best and median time against the
single prompt of the same total: a per-prompt cost the step model lacks shows up as a rise with k.

    python bench/prompt_batch.py [--total 160] [--counts 1,2,4,8] [--repeats 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from splitserve_runs import _params, _random_prompt, _run_until_first_token, build_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=160)
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    engine = build_engine(max_prompt_tokens=max(1024, args.total), max_batch=64)
    engine.add_request("warm", _random_prompt(engine, 64, gen), _params(1))
    _run_until_first_token(engine, {"warm"})
    print(f"{args.total} prompt tokens per step, {args.threads} thread(s), bundled model")
    base = None
    for k in (int(c) for c in args.counts.split(",")):
        length = args.total // k
        times = []
        for r in range(args.repeats):
            ids = {f"k{k}-r{r}-{i}" for i in range(k)}
            for rid in sorted(ids):
                engine.add_request(rid, _random_prompt(engine, length, gen), _params(1))
            t0 = time.perf_counter()
            steps = _run_until_first_token(engine, ids)
            times.append(time.perf_counter() - t0)
            if steps != 1:
                raise SystemExit(f"{k} prompts of {length} took {steps} steps; raise max_num_batched_tokens")
        best, med = min(times), statistics.median(times)
        base = base or best
        print(f"  {k} x {length:4d} tokens: best {best * 1000:7.1f} ms, median {med * 1000:7.1f} ms, "
              f"best vs 1 prompt {best / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
