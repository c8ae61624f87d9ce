"""Shared helpers for engine tests: build an EngineCore on a tiny checkpoint and run it dry."""
from __future__ import annotations

import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.models.loader import load_model


def make_engine(model_dir, *, policy="chunked", budget=64, kv="2MiB", block_size=16, max_num_seqs=64,
                prefix=True, role="colocated") -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(prefill_policy=policy, max_num_batched_tokens=budget,
                                  max_num_seqs=max_num_seqs, role=role))
    return EngineCore(config, load_model(str(model_dir)))


def run_to_end(engine: EngineCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    """Greedy continuation by transformers, ignoring EOS (the engine runs with ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                                                                                           dtype=torch.long))
    return out[0, len(prompt):].tolist()
