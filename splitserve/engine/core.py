"""The engine: one loop of schedule -> run model -> update state -> report outputs.

Single-threaded and in-process. The engine process (frontend/engine_proc.py) wraps it with
socket threads; the offline LLM class drives it directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitserve.config import EngineConfig, ModelConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request, RequestOutput, RequestStatus
from splitserve.engine.scheduler import Scheduler
from splitserve.sampling import SamplingParams


@dataclass(slots=True)
class EngineStats:
    role: str
    num_waiting: int
    num_running: int
    num_blocks_total: int
    num_free_blocks: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    num_preemptions: int
    num_steps: int

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_free_blocks


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if loaded is None:
            from splitserve.models.loader import load_model
            loaded = load_model(config.model, device=config.device)
        # Keep the tokenizer, not `loaded`: the runner holds its own fused copies of the
        # weights, and the caller's dict can be freed once it lets go of it.
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model_config: ModelConfig = loaded.config
        self.runner = ModelRunner(self.model_config, loaded.weights, config.cache, config.device)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.num_steps = 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run here; touches no state."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {n} tokens and max_tokens is {params.max_tokens}; shorten the prompt or lower max_tokens")
        bm = self.block_manager
        if bm.blocks_needed(n + params.max_tokens) > bm.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{bm.blocks_needed(n + params.max_tokens)} KV blocks but the whole cache has "
                f"{bm.num_blocks}; raise kv_cache_memory or shorten the request")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, arrival_time=time.monotonic(),
                          eos_token_ids=self.model_config.eos_token_ids,
                          max_model_len=self.max_model_len)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = self.runner.execute(batch, self.generator)
        finished = set(self.scheduler.update(batch, sampled))
        self.num_steps += 1
        outputs = []
        for request, token in sampled.items():
            done = request in finished
            outputs.append(RequestOutput(
                request.request_id, [token], finished=done,
                finish_reason=request.status.value if done else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens))
            if done:
                self.requests.pop(request.request_id, None)
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            role=self.config.scheduler.role, num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running), num_blocks_total=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks, block_size=bm.block_size,
            prefix_cache_queries=bm.num_prefix_queries, prefix_cache_hits=bm.num_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps)
