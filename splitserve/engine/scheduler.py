"""Continuous batching: which requests run this step, and how many tokens each.

A request's path:
  add() puts it in `waiting`. Each schedule() call
    chunked policy: (1) every running decode gets its one token, preempting the newest
      running requests if blocks run out; (2) short waiting prompts (at most half the configured
      token budget, together at most half of it) are admitted and prefilled whole; where the
      step's live budget is narrower than such a prompt (a chunk knob, a decode instance's local
      prefill, a step full of decodes), the first one that does not fit is admitted with what the
      lane has, and keeps the lane's first tokens in later steps until its prompt is done; (3) running,
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
    first, and preempts the running request with the highest (priority, arrival) first. Each
    step's prompt work is planned one priority level at a time, the chunked steps (2)-(4) above
    within a level, so a document's remaining chunks never take the budget from a waiting chat
    of a more urgent level. A waiting (or prefilled) request that finds no free batch slot or
    KV blocks preempts running requests of a strictly lower priority, lowest then newest first,
    until it fits (vLLM v0's priority preemption); equals never preempt each other, so two
    requests cannot take turns evicting one another. The victims are recomputed later, as
    under memory pressure. The policy never depends on the role.
  Late prompts last (fcfs): a waiting prompt past its first-token deadline (the frontend sends
    one per request under serve --adaptive: its SLO class's TTFT target) goes behind the waiting
    prompts that can still meet theirs, once (_demote_late).
  Stream cap: `max_streams` (set live by the mix controller) holds waiting and prefilled
    requests that would answer here once that many streams run; they are admitted as streams end
    (a batch slot short, as under max_num_seqs).
  update() advances num_computed_tokens, appends sampled tokens, and retires finished
  requests from the running batch; the engine then asks its connector whether their blocks
  are freed or kept for a handover. A `remote_decode` request (marked by a prefill connector)
  finishes after its first token.
"""
from __future__ import annotations

import heapq
import itertools
import time
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


@dataclass(slots=True)
class _StepPlan:
    """What is left of one step's allowances while its prompt work is planned, level by level."""

    short_budget: int  # tokens short prompts may still jump ahead with
    lane: int = 0  # the short budget the step began with
    admitting: bool = True  # False once a waiting request did not fit: nothing behind it is admitted


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilled: deque[Request] = deque()  # KV received from a prefill instance
        self.num_preemptions = 0
        # Prompt tokens one step may carry besides its decodes (None: only max_num_batched_tokens
        # bounds them). The engine sets it from its connector before each step: a decode instance
        # prefilling a prompt itself keeps its chunks small, so its running streams' steps stay
        # near their gap target, and so does a prefill instance while streams it inherited decode.
        self.prompt_tokens_per_step: int | None = None
        # the waiting requests short enough to jump the queue (step (2)), in queue order, and a
        # lower bound on their sizes: a step scans them alone, and stops once its short budget is
        # below every one, instead of walking a long queue of documents to find them
        self._short_waiting: deque[Request] = deque()
        self._shortest_waiting = _NO_SHORT
        # short prompts admitted in part because the step's lane was narrower than they are (a
        # 32-token chunk budget, a chat of 60 tokens): they take the lane first in the next steps,
        # so a chat behind a document's 32-token chunks waits a few steps, not the document's prefill
        self._lane: set[str] = set()
        # The streams (running requests that answer here) this instance may hold, below
        # max_num_seqs; None: max_num_seqs alone. The mix controller sets it live (SetStreamCap)
        # when more streams would step slower than their classes' per-token allowance: a request
        # past it waits for a stream to end instead of slowing every stream past its deadlines.
        # Requests that end on their first token here (remote_decode) do not count and are not
        # held; nor is a stream that has begun its answer (_stream_room).
        self.max_streams: int | None = None
        self.clock = time.monotonic  # the engine's (EngineCore sets its own): first-token deadlines
        # (deadline, arrival order, request) of requests added with a first-token deadline, soonest
        # first: a step looks at the queue only once one has passed (_demote_late), so a server
        # whose requests carry none (no --adaptive) pays nothing on its step loop
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_order = itertools.count()

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

    def _is_short(self, request: Request) -> bool:
        """At most half the step's budget left: the prompts step (2) may prefill ahead of others
        (a waiting request's size does not change while it waits)."""
        return request.num_tokens - request.num_computed_tokens <= self.config.max_num_batched_tokens // 2

    def _to_waiting(self, request: Request, front: bool = False) -> None:
        self._enqueue(self.waiting, request, front)
        if self._is_short(request):
            self._enqueue(self._short_waiting, request, front)  # the same order as in `waiting`
            self._shortest_waiting = min(self._shortest_waiting, request.num_tokens - request.num_computed_tokens)

    def _from_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        if self._is_short(request):
            self._short_waiting.remove(request)
            if not self._short_waiting:
                self._shortest_waiting = _NO_SHORT

    def add(self, request: Request) -> None:
        self._to_waiting(request)
        if request.ttft_deadline is not None and not self.by_priority:
            heapq.heappush(self._deadlines, (request.ttft_deadline, next(self._deadline_order), request))

    def add_prefilled(self, request: Request) -> None:
        """A request whose prompt KV already sits in its blocks: it joins as a decode."""
        self._enqueue(self.prefilled, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens waiting or not yet prefilled (EngineStats; the disaggregation policy reads it)."""
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return queued + sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.is_prefilling)

    def has_streams(self) -> bool:
        """Some running request decodes its answer here (not one that ends on its first token)."""
        return any(not r.remote_decode and not r.is_prefilling for r in self.running)

    def remove(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks (abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self._from_waiting(request)
        elif request in self.prefilled:
            self.prefilled.remove(request)
        self._lane.discard(request.request_id)
        self.blocks.free(request)

    def schedule(self) -> ScheduledBatch:
        if self._deadlines:
            self._demote_late()
        while self.prefilled and self._make_room(self.prefilled[0], 0, None):
            request = self.prefilled.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        if self.config.prefill_policy == "whole":
            return self._schedule_whole()
        return self._schedule_chunked()

    def _demote_late(self) -> None:
        """Late prompts last (fcfs): a waiting request whose first token is past its deadline
        (Request.ttft_deadline, from its SLO class) and that has produced none goes behind every
        waiting request, once, keeping its order among the late. It can no longer meet its
        deadline, while the prompts behind it still can; it is served as soon as they are."""
        now = self.clock()
        passed = set()
        while self._deadlines and self._deadlines[0][0] < now:
            passed.add(heapq.heappop(self._deadlines)[2])
        if not passed:
            return
        late = [r for r in self.waiting if r in passed and not r.demoted and not r.output_token_ids]
        for request in late:
            self._from_waiting(request)
            request.demoted = True
            self._to_waiting(request)

    def _preempt(self, request: Request) -> None:
        # Recompute later: drop the KV, keep the generated tokens, go to the front of the queue.
        self.running.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self._lane.discard(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._to_waiting(request, front=True)

    def _in_order(self, requests: list[Request]) -> list[Request]:
        return sorted(requests, key=_priority_key) if self.by_priority else list(requests)

    def _victim(self) -> Request:
        return max(self.running, key=_priority_key) if self.by_priority else self.running[-1]

    def _make_room(self, request: Request, num_tokens: int, batch: ScheduledBatch | None,
                   need_slot: bool = True) -> bool:
        """True if `request` (not running) fits: a batch slot (need_slot) and blocks for num_tokens
        (0: it holds its blocks already). Under the priority policy it preempts strictly
        lower-priority running requests until it does; a victim given a decode slot in `batch`
        leaves it."""
        def fits() -> bool:
            if need_slot and not (len(self.running) < self.config.max_num_seqs and self._stream_room(request)):
                return False
            return num_tokens == 0 or self.blocks.can_allocate(request, num_tokens)

        while not fits():
            if not (self.by_priority and self.running):
                return False
            victim = self._victim()
            if victim.priority <= request.priority:
                return False
            if batch is not None and victim in batch.decodes:
                batch.decodes.remove(victim)
            assert batch is None or all(r is not victim for r, _ in batch.prefills), "a planned prefill preempted"
            self._preempt(victim)
        return True

    def _stream_room(self, request: Request) -> bool:
        """Under max_streams, may `request` (not running) take a slot? One that ends on its first
        token always may, and so may one that has begun its answer (a stream handed over with its
        first token, or one preempted): held, it would pause with its client waiting (x2, session
        27 on 8f0265e: summaries handed to a capped decode instance waited 7-25 s after their first
        token, and streams preempted for blocks lost their slot to new prompts for 14-17 s)."""
        if self.max_streams is None or request.remote_decode or request.output_token_ids:
            return True
        return sum(1 for r in self.running if not r.remote_decode) < self.max_streams

    def make_room_for_kv(self, request: Request, num_tokens: int) -> bool:
        """For a decode connector, between steps: may blocks for a request's incoming KV be taken
        now? Under the priority policy, lower-priority running requests are preempted for them."""
        return self._make_room(request, num_tokens, None, need_slot=False)

    def _reserve_decodes(self) -> list[Request]:
        """Blocks for one more token for every running decode, preempting (newest, or lowest
        priority) if short."""
        decodes, preempted = [], set()
        # in priority order the victim (the last in that order) is never one already given its slot
        for request in self._in_order(self.running):
            if request in preempted or request.is_prefilling:
                continue
            while not self.blocks.can_append(request):
                victim = self._victim()
                self._preempt(victim)
                preempted.add(victim)
                if victim is request:
                    break
            else:
                self.blocks.append_slots(request)
                decodes.append(request)
        return decodes

    def _admit(self, request: Request, batch: ScheduledBatch) -> bool:
        if not self._make_room(request, request.num_tokens, batch):
            return False
        self._from_waiting(request)
        self.blocks.allocate(request, request.num_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _budget(self, batch: ScheduledBatch) -> int:
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        if self.prompt_tokens_per_step is not None:
            budget = min(budget, self.prompt_tokens_per_step - sum(n for _, n in batch.prefills))
        return budget

    def _schedule_chunked(self) -> ScheduledBatch:
        batch = ScheduledBatch(decodes=self._reserve_decodes())
        lane = max(min(self._budget(batch), self.config.max_num_batched_tokens // 2), 0)
        step = _StepPlan(short_budget=lane, lane=lane)
        if self._lane:  # lane prompts no longer prefilling here (handed over, ended) leave it
            self._lane &= {r.request_id for r in self.running if r.is_prefilling}
        if not self.by_priority:
            self._plan_prompts(batch, step, None, list(self._short_waiting), self.running)
            return batch
        levels = sorted({r.priority for r in self.waiting} | {r.priority for r in self.running if r.is_prefilling})
        for level in levels:
            if self._budget(batch) <= 0:
                break
            self._plan_prompts(batch, step, [r for r in self.waiting if r.priority == level],
                               [r for r in self._short_waiting if r.priority == level],
                               [r for r in self._in_order(self.running) if r.priority == level])
        return batch

    def _plan_prompts(self, batch: ScheduledBatch, step: _StepPlan, waiting: list[Request] | None,
                      short: list[Request], running: list[Request]) -> None:
        """Steps (2)-(4) of the chunked policy over one priority level's requests (all, under fcfs);
        `waiting` (None: the whole queue), its short requests `short` and `running` are in
        scheduling order."""
        jumped, short_refused = set(), False
        if self._lane:
            # short prompts admitted in part in earlier steps finish first, in the lane
            for request in running:
                if request.request_id not in self._lane or step.short_budget <= 0:
                    continue
                chunk = min(request.num_tokens - request.num_computed_tokens, step.short_budget, self._budget(batch))
                if chunk <= 0:
                    break
                batch.prefills.append((request, chunk))
                jumped.add(request.request_id)
                step.short_budget -= chunk
                if chunk == request.num_tokens - request.num_computed_tokens:
                    self._lane.discard(request.request_id)
        for request in short:
            if step.short_budget <= 0 or not step.admitting:
                break
            remaining = request.num_tokens - request.num_computed_tokens
            # in part: only a prompt wider than the whole lane, and only into a lane nobody took yet
            partial = remaining > step.lane and step.short_budget == step.lane
            if remaining > step.short_budget and not partial:
                if step.short_budget < self._shortest_waiting:
                    break
                continue
            if not self._admit(request, batch):
                short_refused = True  # the level's head may still fit (a prefix hit): try it below
                break
            remaining = request.num_tokens - request.num_computed_tokens  # less after a prefix hit
            chunk = min(remaining, step.short_budget, self._budget(batch))
            batch.prefills.append((request, chunk))
            jumped.add(request.request_id)
            step.short_budget -= chunk
            if chunk < remaining:
                self._lane.add(request.request_id)
        for request in running:
            budget = self._budget(batch)
            if budget <= 0:
                break
            if request in self.running and request.is_prefilling and request.request_id not in jumped:
                batch.prefills.append((request, min(request.num_tokens - request.num_computed_tokens, budget)))
        if waiting is None:
            # step (4) passes at most one request per budget token besides those that jumped: a
            # copy of that much of the queue, not of all of it
            waiting = list(itertools.islice(self.waiting, max(self._budget(batch), 0) + len(jumped)))
        for request in waiting:
            if self._budget(batch) <= 0 or not step.admitting:
                break
            if request.request_id in jumped:
                continue
            if not self._admit(request, batch):
                step.admitting = False
                break
            chunk = min(request.num_tokens - request.num_computed_tokens, self._budget(batch))
            batch.prefills.append((request, chunk))
        step.admitting = step.admitting and not short_refused  # a less urgent level must not take its room

    def _schedule_whole(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        while self.waiting:
            request = self.waiting[0]
            remaining = request.num_tokens - request.num_computed_tokens
            if batch.prefills and remaining > budget:
                break
            if not self._admit(request, batch):
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

    def steady_steps(self, limit: int) -> tuple[int, Request | None, int]:
        """How many of the next steps (at most `limit`) are steady, and what prefills in them: each
        decodes every running decode and gives the rest of its token budget to one running prompt
        (the first in scheduling order), with nothing admitted, preempted or finished and no prompt
        completed (so the batch keeps its shape): nothing waits, the free blocks hold that many
        more tokens for every decode, and every request stays short of its length limit.
        Returns (steps, the prompt taking the chunks or None, its chunk per step); 0 steps when the
        next one is anything else. A stop token can end a request earlier, so only a caller that
        knows its tokens (the planner's simulator) may run them at once (advance_steady)."""
        if self.waiting or self.prefilled or not self.running or limit <= 0:
            return 0, None, 0
        steps, decodes, prompt = limit, 0, None
        for request in self._in_order(self.running):
            if request.remote_decode:
                return 0, None, 0  # its first token ends it here
            if request.is_prefilling:
                prompt = prompt or request
                continue
            decodes += 1
            # the step that reaches max_tokens (or the context limit) finishes it: not steady
            left = min(request.params.max_tokens - request.num_output_tokens,
                       request.max_model_len - request.num_tokens)
            steps = min(steps, left - 1)
        chunk = self.config.max_num_batched_tokens - decodes
        if self.prompt_tokens_per_step is not None:
            chunk = min(chunk, self.prompt_tokens_per_step)  # as _budget caps a step's prompt tokens
        if prompt is not None:
            if self.config.prefill_policy == "whole":
                return 0, None, 0
            if chunk > 0:  # it takes the whole rest of every step until the one that completes it
                steps = min(steps, -(-(prompt.num_tokens - prompt.num_computed_tokens) // chunk) - 1)
            else:
                prompt = None
        if steps <= 0:
            return 0, None, 0

        def blocks_for(k: int) -> int:  # new blocks k more decode steps take, all decodes together
            return sum(max(0, self.blocks.blocks_needed(r.num_computed_tokens + k) - len(r.block_table))
                       for r in self.running if not r.is_prefilling)  # a prompt holds its blocks already
        free = self.blocks.num_free_blocks
        if blocks_for(steps) > free:
            lo, hi = 0, steps  # blocks_for(lo) fits, blocks_for(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if blocks_for(mid) <= free else (lo, mid)
            steps = lo
        return (steps, prompt, chunk if prompt is not None else 0) if steps > 0 else (0, None, 0)

    def advance_steady(self, steps: int, token_id: int, plan: tuple[Request | None, int] | None = None) -> None:
        """The state `steps` steady steps (steady_steps said they are) leave, each decode sampling
        `token_id`, without planning each step; `plan`: the (prompt, chunk) steady_steps gave, when
        nothing changed since. The blocks taken are the set a step at a time takes (the front of
        the free queue)."""
        prompt, chunk = plan if plan is not None else self.steady_steps(steps)[1:]
        for request in self.running:
            if request is prompt:
                request.num_computed_tokens += steps * chunk
            elif not request.is_prefilling:
                self.blocks.append_slots(request, steps)
                request.num_computed_tokens += steps
                request.output_token_ids.extend([token_id] * steps)
            self.blocks.publish_computed(request)

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


_NO_SHORT = 1 << 62  # _shortest_waiting while no short request waits


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
