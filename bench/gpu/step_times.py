"""Step times of the engine and of transformers on the same device, each clock read after a device
synchronization (CUDA kernels run ahead of Python: an unsynchronized clock times the launches).

    decode   a batch of B sequences with C cached tokens each, one token per sequence per step:
             the engine's whole step (schedule, paged forward, greedy sample) against
             transformers' forward over its DynamicCache plus an argmax
    prefill  one T-token prompt, whole: the engine's step against transformers' forward
             (its last position's logits only, as the engine computes them)

Medians of `repeats` timed steps after `warmup` untimed ones.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from parity import free_device_memory
from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.devices import synchronize, torch_dtype
from splitserve.engine.core import EngineCore
from splitserve.sampling import SamplingParams


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def engine_steps(model: str, device: str, dtype: str, batches: list[int], context: int,
                 prefills: list[int], warmup: int, repeats: int, kv_cache_memory: str, vocab: int) -> dict:
    config = EngineConfig(model=model, device=device, dtype=dtype,
                          cache=CacheConfig(kv_cache_memory=kv_cache_memory, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(prefills),
                                                    prefill_policy="whole"))
    core = EngineCore(config)
    dev, rng, n = torch.device(device), random.Random(1), [0]

    def add(num_prompt_tokens: int, max_tokens: int) -> None:
        n[0] += 1
        core.add_request(f"r{n[0]}", [rng.randrange(3, vocab) for _ in range(num_prompt_tokens)],
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    decode = {}
    for batch in batches:
        for _ in range(batch):
            add(context, warmup + repeats + 2)
        while any(r.is_prefilling for r in core.requests.values()):
            core.step()
        times = [timed(core.step, dev) for _ in range(warmup + repeats)][warmup:]
        decode[str(batch)] = statistics.median(times)
        core.abort_all()
    prefill = {}
    for tokens in prefills:
        times = []
        for _ in range(warmup + repeats):
            add(tokens, 1)
            times.append(timed(core.step, dev))
            assert not core.has_unfinished_requests(), "a whole prefill within the budget ends in one step"
        prefill[str(tokens)] = statistics.median(times[warmup:])
    core.close()
    del core
    free_device_memory()
    return {"decode_step_s": decode, "prefill_step_s": prefill}


@torch.inference_mode()
def hf_steps(model_path: str, device: str, dtype: str, batches: list[int], context: int,
             prefills: list[int], warmup: int, repeats: int, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype)).to(device).eval()
    dev, gen = torch.device(device), torch.Generator().manual_seed(1)

    def ids(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(3, vocab, (rows, cols), generator=gen).to(device)

    decode = {}
    for batch in batches:
        out = model.model(input_ids=ids(batch, context), use_cache=True)
        state = {"cache": out.past_key_values, "tok": ids(batch, 1)}
        del out

        def step() -> None:
            logits = model(input_ids=state["tok"], past_key_values=state["cache"], use_cache=True).logits
            state["tok"] = logits[:, -1].argmax(-1, keepdim=True)

        decode[str(batch)] = statistics.median([timed(step, dev) for _ in range(warmup + repeats)][warmup:])
        del state
        free_device_memory()
    prefill = {}
    for tokens in prefills:
        prompts = iter([ids(1, tokens) for _ in range(warmup + repeats)])  # made before the clock runs

        def forward() -> None:
            hidden = model.model(input_ids=next(prompts), use_cache=True).last_hidden_state
            model.lm_head(hidden[:, -1]).argmax(-1)

        prefill[str(tokens)] = statistics.median([timed(forward, dev) for _ in range(warmup + repeats)][warmup:])
    del model
    free_device_memory()
    return {"decode_step_s": decode, "prefill_step_s": prefill}


def compare(model: str, device: str, dtype: str, batches: list[int], context: int, prefills: list[int],
            warmup: int, repeats: int, kv_cache_memory: str, vocab: int) -> dict:
    ours = engine_steps(model, device, dtype, batches, context, prefills, warmup, repeats, kv_cache_memory, vocab)
    theirs = hf_steps(model, device, dtype, batches, context, prefills, warmup, repeats, vocab)
    ratio = {kind: {k: theirs[kind][k] / v for k, v in ours[kind].items()} for kind in ours}
    return {"dtype": dtype, "context_tokens": context, "engine": ours, "transformers": theirs,
            "speedup_over_transformers": ratio}
