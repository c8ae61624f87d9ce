"""HF transformers on the same GGUF, dequantized to fp32: the reference the engine must beat.

Prefill: one forward over N random token ids, logits only for the last position
(what a server needs to sample the first token).
Decode: the largest batch is prefilled once; the batch is then cut down
(64 -> 32 -> 8 -> 1) by selecting rows of the DynamicCache, and at each size
greedy steps are timed one by one at every thread count.
"""
from __future__ import annotations

import pathlib
import warnings

import torch

from records import DecodeResult, PrefillResult, StepTimer

SYSTEM = "hf"


def load_hf_model(gguf_path: pathlib.Path):
    """transformers' own Llama on the GGUF weights, fp32, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def _forward_next_tokens(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    # input_ids: [batch, new_tokens] -> next greedy token per row: [batch, 1]
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)


def hf_prefill(model, num_tokens: int, threads: int, repeats: int,
               generator: torch.Generator) -> PrefillResult:
    torch.set_num_threads(threads)
    vocab = model.config.vocab_size
    _forward_next_tokens(model, torch.randint(100, vocab, (1, 64), generator=generator),
                         _new_cache(model))  # warm-up at this thread count
    timer = StepTimer()
    for _ in range(repeats):
        prompt = torch.randint(100, vocab, (1, num_tokens), generator=generator)  # [1, N]
        cache = _new_cache(model)
        with timer:
            _forward_next_tokens(model, prompt, cache)
    return PrefillResult(SYSTEM, threads, num_tokens, timer.best, timer.best_cpu, repeats)


def hf_decode(model, batch_sizes: list[int], prompt_len: int, num_steps: int,
              threads_list: list[int], generator: torch.Generator) -> list[DecodeResult]:
    """Decode tok/s at each batch size and thread count from one shared prefill."""
    batch_sizes = sorted(batch_sizes, reverse=True)
    vocab = model.config.vocab_size
    torch.set_num_threads(max(threads_list))
    prompts = torch.randint(100, vocab, (batch_sizes[0], prompt_len), generator=generator)
    cache = _new_cache(model)
    next_ids = _forward_next_tokens(model, prompts, cache)  # next_ids: [batch, 1]
    results = []
    for batch_size in batch_sizes:
        if next_ids.shape[0] != batch_size:
            keep = torch.arange(batch_size)
            cache.batch_select_indices(keep)
            next_ids = next_ids[keep]
        for threads in threads_list:
            torch.set_num_threads(threads)
            next_ids = _forward_next_tokens(model, next_ids, cache)  # warm-up step
            context_start = cache.get_seq_length()
            timer = StepTimer()
            for _ in range(num_steps):
                with timer:
                    next_ids = _forward_next_tokens(model, next_ids, cache)
            context_len = context_start + num_steps // 2
            results.append(DecodeResult(SYSTEM, threads, batch_size, context_len, num_steps,
                                        timer.best, timer.median, timer.best_cpu))
    return results
