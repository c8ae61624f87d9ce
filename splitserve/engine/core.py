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
from splitserve.engine.kv_handover import DecodeIntake, PrefillHandover, allocate_pool
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request, RequestOutput, RequestStatus
from splitserve.engine.scheduler import Scheduler
from splitserve.kv_transfer import TransferOutcome
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
    kv_sender: dict | None = None  # prefill role: SenderStats fields
    kv_receiver: dict | None = None  # decode role: ReceiverStats fields

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_free_blocks


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None, kv_network=None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if loaded is None:
            from splitserve.models.loader import load_model
            loaded = load_model(config.model, device=config.device, weight_format=config.weight_format)
        # Keep the tokenizer, not `loaded`: the runner holds its own fused copies of the
        # weights, and the caller's dict can be freed once it lets go of it.
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model_config: ModelConfig = loaded.config
        self.role = config.scheduler.role
        self._pool_handle = None

        def allocate(shape, dtype):
            pool, self._pool_handle = allocate_pool(config.kv_transfer, self.role, config.instance_id,
                                                    shape, dtype, config.device)
            return pool

        self.runner = ModelRunner(self.model_config, loaded.weights, config.cache, config.device,
                                  allocate_pool=allocate)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.handover = self.intake = None
        if self.role == "prefill":
            self.handover = PrefillHandover(config.kv_transfer, self.runner.kv_cache, config.instance_id,
                                            self.block_manager,
                                            shm_name=self._pool_handle.name if self._pool_handle else "")
        elif self.role == "decode":
            self.intake = DecodeIntake(config.kv_transfer, self.runner.kv_cache, self.block_manager,
                                       config.kv_failure_policy, network=kv_network)
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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_descriptor=None, first_token_ids: list[int] | None = None) -> None:
        """kv_descriptor (decode role): the prompt's KV waits on a prefill instance, which already
        produced first_token_ids; this instance pulls the KV and continues from there."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if kv_descriptor is not None and (self.intake is None or not first_token_ids):
            raise ValueError("a KV descriptor can only go to a decode-role instance, with the first token")
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, arrival_time=time.monotonic(),
                          eos_token_ids=self.model_config.eos_token_ids,
                          max_model_len=self.max_model_len)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        self.requests[request_id] = request
        if kv_descriptor is not None:
            request.output_token_ids = list(first_token_ids)
            self.intake.add(request, kv_descriptor)
        else:
            self.scheduler.add(request)

    def abort_request(self, request_id: str) -> bool:
        if self.handover is not None and self.handover.abort(request_id):
            return True  # its prompt was done here; the KV was waiting for a decode instance
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if self.intake is not None and self.intake.abort(request_id):
            request.status = RequestStatus.FINISHED_ABORTED  # blocks come back via the receiver
            return True
        self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return True

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished()
                or (self.handover is not None and self.handover.has_unfinished())
                or (self.intake is not None and self.intake.has_unfinished()))

    def _poll_transfers(self) -> list[RequestOutput]:
        outputs = []
        if self.handover is not None:
            self.handover.poll()
        if self.intake is None:
            return outputs
        for request, record in self.intake.poll():
            if request.request_id not in self.requests:
                continue  # aborted meanwhile
            if record.outcome is TransferOutcome.DONE:
                request.kv_transfer = record
                self.scheduler.add_prefilled(request)
            elif self.config.kv_failure_policy == "recompute":
                request.kv_transfer = record
                request.status = RequestStatus.WAITING
                self.scheduler.add(request)  # prefill prompt + first token here instead
            else:
                self.requests.pop(request.request_id)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(RequestOutput(
                    request.request_id, [], finished=True, finish_reason="error",
                    num_prompt_tokens=request.num_prompt_tokens, kv_transfer=record,
                    error=f"KV transfer from the prefill instance failed ({record.error_kind}): {record.error}"))
        return outputs

    def step(self) -> list[RequestOutput]:
        outputs = self._poll_transfers()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        sampled = self.runner.execute(batch, self.generator)
        finished = set(self.scheduler.update(batch, sampled))
        self.num_steps += 1
        for request, token in sampled.items():
            done = request in finished
            out = RequestOutput(
                request.request_id, [token], finished=done,
                finish_reason=request.status.value if done else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens)
            if done:
                self.requests.pop(request.request_id, None)
                out.kv_transfer = request.kv_transfer
                if request.status is RequestStatus.FINISHED_PREFILL_DONE:
                    out.kv_descriptor = self.handover.hand_over(request)
            outputs.append(out)
        return outputs

    def close(self) -> None:
        """Stop KV-transfer threads and release a shared-memory pool."""
        if self.handover is not None:
            self.handover.close()
        if self.intake is not None:
            self.intake.close()
        if self._pool_handle is not None:
            self._pool_handle.close()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            role=self.config.scheduler.role, num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running), num_blocks_total=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks, block_size=bm.block_size,
            prefix_cache_queries=bm.num_prefix_queries, prefix_cache_hits=bm.num_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            kv_sender=self.handover.stats() if self.handover else None,
            kv_receiver=self.intake.stats() if self.intake else None)
