"""Offline API: `LLM(...).generate(prompts, params)`, driving an in-process EngineCore."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.devices import check_device, torch_dtype
from splitserve.engine.core import EngineCore
from splitserve.sampling import SamplingParams


@dataclass(slots=True)
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class LLM:
    def __init__(self, model: str | None = None, *, device: str = "cpu", num_threads: int | None = None,
                 kv_cache_memory: str | int = "1GiB", block_size: int = 16,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 256, prefill_policy: str = "chunked", seed: int = 0,
                 weight_format: str = "auto", dtype: str = "float32"):
        config = EngineConfig(
            model=model, device=device, num_threads=num_threads, seed=seed, weight_format=weight_format, dtype=dtype,
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      prefill_policy=prefill_policy))
        from splitserve.models.loader import load_model

        check_device(device)  # one clear line, before any weight is read
        loaded = load_model(model, device=device, dtype=torch_dtype(dtype), weight_format=weight_format)
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.engine = EngineCore(config, loaded)
        self._next_id = 0

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, list):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return prompt

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat rendered with the model's template, ready for the answer."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def _submit(self, prompt: str | list[int], params: SamplingParams) -> tuple[str, list[int]]:
        token_ids = self.encode(prompt)
        request_id = f"offline-{self._next_id}"
        self._next_id += 1
        self.engine.add_request(request_id, token_ids, params)
        return request_id, token_ids

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | None = None) -> list[GenerateResult]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # Validate every prompt before submitting any, so a bad one leaves nothing half-queued.
        encoded = [self.encode(p) for p in prompts]
        for token_ids in encoded:
            self.engine.validate(token_ids, params)
        results: dict[str, GenerateResult] = {}
        for token_ids in encoded:
            request_id, _ = self._submit(token_ids, params)
            results[request_id] = GenerateResult(prompt_token_ids=token_ids)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results[out.request_id]
                    result.token_ids.extend(out.new_token_ids)
                    if out.finished:
                        result.finish_reason = out.finish_reason
        finally:
            for request_id, result in results.items():
                if result.finish_reason is None:
                    self.engine.abort_request(request_id)
        for result in results.values():
            result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return list(results.values())

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Yield one request's tokens as they are produced (runs the engine while iterating)."""
        request_id, _ = self._submit(prompt, params or SamplingParams())
        done = False
        try:
            while not done and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield from out.new_token_ids
                        done = out.finished
        finally:
            if not done:
                self.engine.abort_request(request_id)
