"""Greedy tokens of the engine against transformers' on the same device, for prompts of many lengths.

The engine runs every prompt in one batch, chunked (so a long prompt's later chunks attend to
its cached blocks through the paged path), as it serves; transformers runs each prompt alone with
its own cache. In fp32 the tokens must be equal; where they are not, the gap between
transformers' two best logits at the first difference says whether it was a near-tie (two
orders of summation that round differently) or a bug. In bf16 the two round differently at every
layer, so only the number of leading tokens that agree is reported.
"""
from __future__ import annotations

import gc
import random

import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.devices import torch_dtype
from splitserve.engine.core import EngineCore
from splitserve.sampling import SamplingParams

NEAR_TIE = 1e-3  # a top-2 logit gap below this at a difference: a rounding tie, not a wrong token


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_greedy(model: str, device: str, dtype: str, prompts: list[list[int]], num_tokens: int,
                  chunk_tokens: int, kv_cache_memory: str) -> list[list[int]]:
    config = EngineConfig(model=model, device=device, dtype=dtype,
                          cache=CacheConfig(kv_cache_memory=kv_cache_memory),
                          scheduler=SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=chunk_tokens,
                                                    prefill_policy="chunked"))
    core = EngineCore(config)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"p{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.error:
                raise RuntimeError(f"engine failed {out.request_id}: {out.error}")
            tokens[out.request_id].extend(out.new_token_ids)
    core.close()
    del core
    free_device_memory()
    return [tokens[f"p{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def hf_greedy_one(model, prompt: list[int], num_tokens: int, device: str) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for one prompt, and its top-2 logit gap at each of them."""
    out = model.model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens, gaps = [], []
    while True:
        logits = model.lm_head(out.last_hidden_state[:, -1]).float()  # [1, vocab]
        top = logits.topk(2, dim=-1)
        tokens.append(int(top.indices[0, 0]))
        gaps.append(float(top.values[0, 0] - top.values[0, 1]))
        if len(tokens) == num_tokens:
            return tokens, gaps
        out = model.model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                          past_key_values=out.past_key_values, use_cache=True)


def hf_greedy(model_path: str, device: str, dtype: str, prompts: list[list[int]], num_tokens: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype)).to(device).eval()
    results = [hf_greedy_one(model, p, num_tokens, device) for p in prompts]
    del model
    free_device_memory()
    return results


def compare(model: str, device: str, dtype: str, prompts: list[list[int]], num_tokens: int,
            chunk_tokens: int, kv_cache_memory: str) -> dict:
    ours = engine_greedy(model, device, dtype, prompts, num_tokens, chunk_tokens, kv_cache_memory)
    theirs = hf_greedy(model, device, dtype, prompts, num_tokens)
    rows = []
    for prompt, mine, (reference, gaps) in zip(prompts, ours, theirs):
        first_diff = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), None)
        if first_diff is None and len(mine) != len(reference):
            first_diff = min(len(mine), len(reference))
        gap = gaps[first_diff] if first_diff is not None and first_diff < len(gaps) else None
        rows.append({"prompt_tokens": len(prompt), "equal": first_diff is None,
                     "leading_equal": len(mine) if first_diff is None else first_diff,
                     "hf_top2_gap_at_difference": gap,
                     "near_tie": gap is not None and gap < NEAR_TIE})
    return {"dtype": dtype, "num_tokens": num_tokens, "prompts": rows,
            "all_equal": all(r["equal"] for r in rows),
            "leading_equal_mean": sum(r["leading_equal"] for r in rows) / len(rows),
            "differences_not_near_ties": sum(not r["equal"] and not r["near_tie"] for r in rows)}
