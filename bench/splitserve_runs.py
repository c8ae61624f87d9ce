"""splitserve's own engine, driven through EngineCore exactly as the offline API drives it.

Prefill: one request of N random tokens, max_tokens=1, prefill policy "whole" with a
token budget >= N, so one engine step computes the whole prompt and samples; the
time of that step is the time to the first token.
Decode: 64 requests of ~232-token prompts (ignore_eos, greedy) are prefilled; once
every one has its first token, steps are pure decode steps. The batch is cut down
(64 -> 32 -> 8 -> 1) by aborting requests, which frees their blocks at once, and at
each size the engine's steps are timed one by one at every thread count.
"""
from __future__ import annotations

import torch

from records import DecodeResult, PrefillResult, StepTimer

SYSTEM = "splitserve"
BLOCK_SIZE = 16


def build_engine(max_prompt_tokens: int, max_batch: int, kv_cache_memory: str = "1536MiB",
                 model: str | None = None, weight_format: str = "auto"):
    """An engine sized for the benchmark (None: the bundled model); ImportError if none is built."""
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore

    config = EngineConfig(
        model=model, weight_format=weight_format,
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=kv_cache_memory,
                          enable_prefix_caching=False),  # random prompts: no hits to gain, none to fake
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_prompt_tokens,
                                  prefill_policy="whole"))
    return EngineCore(config)


def _params(max_tokens: int):
    from splitserve.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _random_prompt(engine, num_tokens: int, generator: torch.Generator) -> list[int]:
    vocab = engine.model_config.vocab_size
    return torch.randint(100, vocab, (num_tokens,), generator=generator).tolist()


def _run_until_first_token(engine, request_ids: set[str], timer: StepTimer | None = None) -> int:
    """Step until every id has produced a token; returns the number of steps taken."""
    waiting = set(request_ids)
    num_steps = 0
    while waiting:
        if timer is None:
            outputs = engine.step()
        else:
            with timer:
                outputs = engine.step()
        num_steps += 1
        for out in outputs:
            if out.error:
                raise RuntimeError(f"engine reported an error for {out.request_id}: {out.error}")
            waiting.discard(out.request_id)
    return num_steps


def system_name(weight_format: str) -> str:
    """Rows of the default engine are "splitserve"; other weight formats are named after theirs."""
    return SYSTEM if weight_format == "auto" else f"{SYSTEM}-{weight_format}"


def engine_prefill(engine, num_tokens: int, threads: int, repeats: int,
                   generator: torch.Generator, system: str = SYSTEM) -> PrefillResult:
    torch.set_num_threads(threads)
    engine.add_request(f"warm-{threads}-{num_tokens}", _random_prompt(engine, 64, generator), _params(1))
    _run_until_first_token(engine, {f"warm-{threads}-{num_tokens}"})
    timer = StepTimer()
    for i in range(repeats):
        request_id = f"prefill-{threads}-{num_tokens}-{i}"
        engine.add_request(request_id, _random_prompt(engine, num_tokens, generator), _params(1))
        num_steps = _run_until_first_token(engine, {request_id}, timer)
        if num_steps != 1:
            raise RuntimeError(f"a {num_tokens}-token prefill took {num_steps} steps; the "
                               "benchmark needs max_num_batched_tokens >= the prompt length")
    return PrefillResult(system, threads, num_tokens, timer.best, timer.best_cpu, repeats)


def engine_decode(engine, batch_sizes: list[int], prompt_len: int, num_steps: int,
                  threads_list: list[int], generator: torch.Generator, system: str = SYSTEM) -> list[DecodeResult]:
    """Decode tok/s at each batch size and thread count from one shared prefill."""
    batch_sizes = sorted(batch_sizes, reverse=True)
    steps_needed = len(batch_sizes) * len(threads_list) * (num_steps + 1) + 2
    torch.set_num_threads(max(threads_list))
    request_ids = [f"decode-{i}" for i in range(batch_sizes[0])]
    for request_id in request_ids:
        engine.add_request(request_id, _random_prompt(engine, prompt_len, generator),
                           _params(steps_needed))
    _run_until_first_token(engine, set(request_ids))
    context_len = prompt_len  # every sequence now holds its prompt; its first token is not in the cache yet
    results = []
    for batch_size in batch_sizes:
        for request_id in request_ids[batch_size:]:
            engine.abort_request(request_id)
        request_ids = request_ids[:batch_size]
        for threads in threads_list:
            torch.set_num_threads(threads)
            _decode_step(engine, batch_size)  # warm-up step at this size and thread count
            context_len += 1
            timer = StepTimer()
            for _ in range(num_steps):
                with timer:
                    _decode_step(engine, batch_size)
            results.append(DecodeResult(system, threads, batch_size, context_len + num_steps // 2,
                                        num_steps, timer.best, timer.median, timer.best_cpu))
            context_len += num_steps
    for request_id in request_ids:
        engine.abort_request(request_id)
    return results


def _decode_step(engine, batch_size: int) -> None:
    outputs = engine.step()
    if len(outputs) != batch_size or any(out.finished for out in outputs):
        raise RuntimeError(f"expected a pure decode step over {batch_size} running requests, got "
                           f"{len(outputs)} outputs ({sum(o.finished for o in outputs)} finished)")
