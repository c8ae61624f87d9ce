"""A busy engine beside the one `splitserve profile` times (issue 28 part 3).

    python -m splitserve.control.profile_neighbour --threads T [--model M] --prompts 32,128,512

In a trial of several instances on one host, an instance's steps run while the other instances
run theirs: a trial's engines took 9-35% longer for prompt steps than the lone profile said
(docs/benchmarks.md, "Planner", session 8). This process is such a neighbour: one engine that
keeps 8 requests in flight, each a fresh prompt (no prefix-cache hit, so it really prefills, in
chunks of a 256-token budget) and a short answer, so it runs the same mix of prompt and decode
steps a trial's busy instance runs, without pause. It prints "ready" once its model is loaded
and stops when killed or when the profile that started it is gone.
"""
from __future__ import annotations

import argparse
import os
import random

IN_FLIGHT = 8
BUDGET = 256


def run(threads: int, model: str | None, prompts: list[int], seed: int) -> None:
    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore
    from splitserve.models.loader import load_model
    from splitserve.sampling import SamplingParams

    torch.set_num_threads(threads)
    loaded = load_model(model)
    kv_tokens = IN_FLIGHT * (max(prompts) + 64) + 1024
    core = EngineCore(EngineConfig(model=model, num_threads=threads,
                                   cache=CacheConfig(kv_cache_memory=kv_tokens * loaded.config.kv_bytes_per_token,
                                                     enable_prefix_caching=False),
                                   scheduler=SchedulerConfig(max_num_seqs=IN_FLIGHT, max_num_batched_tokens=BUDGET)),
                      loaded)
    vocab = core.model_config.vocab_size
    low = min(100, vocab // 2)
    rng = random.Random(seed)
    parent, n = os.getppid(), 0
    print("ready", flush=True)
    while os.getppid() == parent:  # the profile died without killing us: stop
        while len(core.requests) < IN_FLIGHT:
            prompt = [rng.randrange(low, vocab) for _ in range(rng.choice(prompts))]
            core.add_request(f"n{n}", prompt, SamplingParams(max_tokens=rng.randint(16, 48), ignore_eos=True))
            n += 1
        core.step()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", default="32,128,512", help="prompt lengths to draw from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.threads, args.model, [int(p) for p in args.prompts.split(",")], args.seed)


if __name__ == "__main__":
    main()
