"""Does a fresh prompt's step cost depend on what its tokens are? (issue 28)

In trials a request's first prompt step runs 1.2-1.4x what the profile's step model predicts,
while later chunks of long prompts run 1.06-1.13x and decode steps match (docs/benchmarks.md,
"Planner", session 16). The profile times fresh prompts of random token ids; a trial sends real
text cut from the bundled texts. The arithmetic of a dense forward pass does not depend on the
values, unless some of them are subnormal floats, which x86 cores compute far slower unless
flush-to-zero is on; a compute-bound step (a prompt) would show it, a memory-bound one (a decode)
would hide it. This times one engine step that prefills one fresh prompt of L tokens, in-process,
bundled model, one thread, for: random ids (as `splitserve profile`), real text (as a trial), and
real text with torch.set_flush_denormal(True); best and median of the repeats, and each case
against random ids.

    python bench/prompt_tokens.py [--lengths 48,96,192] [--repeats 9] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from splitserve_runs import _params, _random_prompt, _run_until_first_token, build_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="48,96,192")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from splitserve.models.loader import load_tokenizer
    from splitserve.trial.workload import PromptSource

    torch.set_num_threads(args.threads)
    tokenizer, _ = load_tokenizer(None)
    source = PromptSource(lambda text: list(tokenizer.encode(text, add_special_tokens=False)))
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = build_engine(max_prompt_tokens=max(lengths) + 64, max_batch=8)
    engine.add_request("warm", _random_prompt(engine, 64, gen), _params(1))
    _run_until_first_token(engine, {"warm"})
    cases = {"random ids": lambda n: _random_prompt(engine, n, gen),
             "real text": lambda n: source.prompt(n, rng),
             "real text, flush denormals": lambda n: source.prompt(n, rng)}
    print(f"one fresh prompt per step, {args.threads} thread(s), bundled model, {args.repeats} repeats, "
          "cases interleaved")
    for n in lengths:
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.repeats):
            for name, make in cases.items():  # interleaved, so drift hits every case alike
                torch.set_flush_denormal(name.endswith("flush denormals"))
                rid = f"{name}-{n}-{r}"
                engine.add_request(rid, make(n), _params(1))
                t0 = time.perf_counter()
                steps = _run_until_first_token(engine, {rid})
                times[name].append(time.perf_counter() - t0)
                if steps != 1:
                    raise SystemExit(f"a prompt of {n} took {steps} steps")
        torch.set_flush_denormal(False)
        base = min(times["random ids"])
        for name, t in times.items():
            print(f"  {n:4d} tokens, {name:28}: best {min(t) * 1000:7.1f} ms, median "
                  f"{statistics.median(t) * 1000:7.1f} ms, best vs random ids {min(t) / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
