"""Continuous batching: which requests run this step, and how many tokens each.

A request's path:
  add() puts it in `waiting`. Each schedule() call
    chunked policy: (1) every running decode gets its one token, preempting the newest
      running requests if blocks run out; (2) short waiting prompts (at most half the step's
      token budget, together at most half of it) are admitted and prefilled whole; (3) running,
      partly prefilled requests get a chunk; (4) other waiting requests are admitted (blocks
      for the whole sequence) while the step's token budget and max_num_seqs allow, their
      first chunk capped by the budget.
      Decodes never wait behind a prompt: that is stall-free batching (Sarathi-Serve). Short
      prompts never wait behind a long one's remaining chunks either (like vLLM's
      long_prefill_token_threshold): a chat arriving during a document's prefill gets its
      first token the next step, while the document keeps at least half of every step.
    whole policy: if a waiting prompt fits, the step prefills whole prompts only (the first
      one even if it alone exceeds the budget); otherwise the step decodes every running
      request. A long prompt therefore stalls every running stream for its whole prefill.
  Scheduling policy: fcfs keeps arrival order and preempts the newest running request;
    priority (as vLLM) keeps `waiting` and `prefilled` sorted by (priority, arrival), lower
    first, gives running prompts their chunks in that order, and preempts the running request
    with the highest (priority, arrival) first. The policy never depends on the role.
  update() advances num_computed_tokens, appends sampled tokens, and retires finished
  requests from the running batch; the engine then asks its connector whether their blocks
  are freed or kept for a handover. A `remote_decode` request (marked by a prefill connector)
  finishes after its first token.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splitserve.config import SchedulerConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilled: deque[Request] = deque()  # KV received from a prefill instance
        self.num_preemptions = 0

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def _enqueue(self, queue: deque[Request], request: Request, front: bool = False) -> None:
        if not self.by_priority:
            queue.appendleft(request) if front else queue.append(request)
            return
        # a preempted request keeps its arrival time, so it goes back ahead of later equals
        key = _priority_key(request)
        queue.insert(next((i for i, r in enumerate(queue) if _priority_key(r) > key), len(queue)), request)

    def add(self, request: Request) -> None:
        self._enqueue(self.waiting, request)

    def add_prefilled(self, request: Request) -> None:
        """A request whose prompt KV already sits in its blocks: it joins as a decode."""
        self._enqueue(self.prefilled, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    def remove(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks (abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.prefilled:
            self.prefilled.remove(request)
        self.blocks.free(request)

    def schedule(self) -> ScheduledBatch:
        while self.prefilled and len(self.running) < self.config.max_num_seqs:
            request = self.prefilled.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        if self.config.prefill_policy == "whole":
            return self._schedule_whole()
        return self._schedule_chunked()

    def _preempt(self, request: Request) -> None:
        # Recompute later: drop the KV, keep the generated tokens, go to the front of the queue.
        self.running.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, request, front=True)

    def _in_order(self, requests: list[Request]) -> list[Request]:
        return sorted(requests, key=_priority_key) if self.by_priority else list(requests)

    def _victim(self) -> Request:
        return max(self.running, key=_priority_key) if self.by_priority else self.running[-1]

    def _reserve_decodes(self) -> list[Request]:
        """Blocks for one more token for every running decode, preempting (newest, or lowest
        priority) if short."""
        decodes = []
        # in priority order the victim (the last in that order) is never one already given its slot
        for request in self._in_order(self.running):
            if request not in self.running or request.is_prefilling:
                continue
            while not self.blocks.can_append(request):
                victim = self._victim()
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self.blocks.append_slots(request)
                decodes.append(request)
        return decodes

    def _admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if not self.blocks.can_allocate(request, request.num_tokens):
            return False
        self.waiting.remove(request)
        self.blocks.allocate(request, request.num_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _schedule_chunked(self) -> ScheduledBatch:
        batch = ScheduledBatch(decodes=self._reserve_decodes())
        budget = self.config.max_num_batched_tokens - len(batch.decodes)
        short_budget = min(budget, self.config.max_num_batched_tokens // 2)
        jumped = set()
        for request in list(self.waiting):
            if short_budget <= 0:
                break
            if request.num_tokens - request.num_computed_tokens > short_budget:
                continue
            if not self._admit(request):
                break
            chunk = min(request.num_tokens - request.num_computed_tokens, budget)
            batch.prefills.append((request, chunk))
            jumped.add(request.request_id)
            budget -= chunk
            short_budget -= chunk
        for request in self._in_order(self.running):
            if budget <= 0:
                break
            if request.is_prefilling and request.request_id not in jumped:
                chunk = min(request.num_tokens - request.num_computed_tokens, budget)
                batch.prefills.append((request, chunk))
                budget -= chunk
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            request = self.running[-1]
            chunk = min(request.num_tokens - request.num_computed_tokens, budget)
            batch.prefills.append((request, chunk))
            budget -= chunk
        return batch

    def _schedule_whole(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        while self.waiting:
            request = self.waiting[0]
            remaining = request.num_tokens - request.num_computed_tokens
            if batch.prefills and remaining > budget:
                break
            if not self._admit(request):
                break
            # num_computed_tokens may have jumped on a prefix-cache hit
            chunk = request.num_tokens - request.num_computed_tokens
            batch.prefills.append((request, chunk))
            budget -= chunk
        if batch:
            return batch
        batch.decodes = self._reserve_decodes()
        return batch

    def update(self, batch: ScheduledBatch, sampled: dict[Request, int]) -> list[Request]:
        """Account the step's work; returns the requests that finished this step."""
        for request in batch.decodes:
            request.num_computed_tokens += 1
        for request, chunk in batch.prefills:
            request.num_computed_tokens += chunk
        finished = []
        for request, token in sampled.items():
            request.output_token_ids.append(token)
            self.blocks.publish_computed(request)
            status = self._stop_status(request, token)
            if status is not None:
                request.status = status
                finished.append(request)
        for request, _ in batch.prefills:
            if request not in sampled:
                self.blocks.publish_computed(request)
        for request in finished:
            self.running.remove(request)
        return finished

    @staticmethod
    def _stop_status(request: Request, token: int) -> RequestStatus | None:
        params = request.params
        n = request.num_output_tokens
        if n >= params.min_tokens:
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n >= params.max_tokens or request.num_tokens >= request.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.remote_decode:
            return RequestStatus.FINISHED_PREFILL_DONE
        return None


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
