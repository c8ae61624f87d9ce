"""A busy engine beside the one `splitserve profile` times (issue 28 part 3).

    python -m splitserve.control.profile_neighbour --threads T [--model M] --prompts 32,128,512

In a trial of several instances on one host, an instance's steps run while the other instances
run theirs: a trial's engines took 9-35% longer for prompt steps than the lone profile said
(docs/benchmarks.md, "Planner", session 8). This process is such a neighbour: one engine that
keeps 8 requests in flight, each a fresh prompt (no prefix-cache hit, so it really prefills, in
chunks of a 256-token budget) and a short answer, so it runs the same mix of prompt and decode
steps a trial's busy instance runs, without pause. It prints "ready" once its model is loaded
and stops when killed or when the profile that started it is gone.

With --served (`splitserve profile --contended served`) the neighbour is an instance as a trial
serves it: a `splitserve serve` of one instance, and a streaming client in this process keeping
the same 8 requests in flight through its HTTP frontend (token-id prompts, as the trial's client
sends them; SSE chunks parsed as it parses them). So the timed engine also shares the host with
a frontend's and a client's work per request and per token, which the engine-only neighbour
leaves out (issue 28: a trial's 1-thread engines were off their core for 4-11% of a step's wall
time). Its server runs in this process's group: the profile stops both with one signal.
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


def run_served(threads: int, model: str | None, prompts: list[int], seed: int) -> None:
    import asyncio
    import json
    import pathlib
    import subprocess
    import sys
    import tempfile

    import httpx

    from splitserve.trial.arrangements import free_port, wait_ready
    from splitserve.trial.client import http_tokenizer

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="splitserve-neighbour-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--instances", "1",
           "--threads-per-instance", str(threads), "--max-num-batched-tokens", str(BUDGET),
           "--max-num-seqs", str(IN_FLIGHT), "--log-level", "warning"] + (["--model", model] if model else [])
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        model_id = wait_ready(base, 300.0, server, pathlib.Path(log.name))
        # token ids this model's tokenizer makes (drawn at random, so no prompt shares a cached prefix)
        rng = random.Random(seed)
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                         for _ in range(2000))
        pool = sorted(set(http_tokenizer(base)(words)))
        parent = os.getppid()
        print("ready", flush=True)

        async def one(client: httpx.AsyncClient, k: int) -> None:
            r = random.Random(seed * 1000 + k)
            while os.getppid() == parent:
                body = {"prompt": [r.choice(pool) for _ in range(r.choice(prompts))], "max_tokens": r.randint(16, 48),
                        "ignore_eos": True, "temperature": 0.0, "stream": True,
                        "stream_options": {"include_usage": True}, "return_token_ids": True}
                if model_id:
                    body["model"] = model_id
                async with client.stream("POST", f"{base}/v1/completions", json=body) as stream:
                    async for line in stream.aiter_lines():
                        if line.startswith("data: {"):
                            json.loads(line[6:])

        async def drive() -> None:
            async with httpx.AsyncClient(timeout=None) as client:
                await asyncio.gather(*(one(client, k) for k in range(IN_FLIGHT)))

        asyncio.run(drive())
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        os.unlink(log.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", default="32,128,512", help="prompt lengths to draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--served", action="store_true",
                        help="serve one instance over HTTP and drive it with a streaming client (see above)")
    args = parser.parse_args(argv)
    (run_served if args.served else run)(args.threads, args.model, [int(p) for p in args.prompts.split(",")],
                                         args.seed)


if __name__ == "__main__":
    main()
