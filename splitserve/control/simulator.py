"""A discrete-event model of this project's serving: its scheduler, its router, its KV handover.

Time jumps from event to event (an arrival, the end of an engine step, the end of a KV
transfer); nothing sleeps. Each instance mirrors engine/scheduler.py step by step:
  chunked: every running decode first (newest preempted when blocks run out), then short
    waiting prompts whole (each at most half the budget, together at most half), then
    running chunks, then new admissions, until the step's token budget is spent;
  whole: waiting prompts whole (the first even past the budget), else a decode of everyone.
A step lasts what the step model (control/stepmodel.py) says for what it holds; its sampled
tokens reach the client at its end. A prefill-role instance hands a finished prompt to the
decode instance chosen at arrival; the KV lands after the profiled transfer time and the
request joins that instance's batch at its next step. The router is frontend/router.py's:
least outstanding tokens for colocated instances (prompt + answer), least queued prompt
tokens for prefill, least outstanding answer tokens for decode.
Left out: the frontend's own latency, prefix-cache hits, admission limits (429s), failures.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from splitserve.control.stepmodel import StepModel

ROLES = ("colocated", "prefill", "decode")


@dataclass(slots=True, frozen=True)
class InstanceSpec:
    role: str = "colocated"
    threads: int = 1
    policy: str = "chunked"           # chunked | whole
    budget: int = 256                 # max_num_batched_tokens
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance role must be one of {ROLES}, got {self.role!r}")
        if self.policy not in ("chunked", "whole"):
            raise ValueError(f"prefill policy must be chunked or whole, got {self.policy!r}")
        if self.threads < 1 or self.budget < 1 or self.max_num_seqs < 1:
            raise ValueError("threads, budget and max_num_seqs must be >= 1")


@dataclass(slots=True, eq=False)  # identity, not field, equality: list.remove must be O(1) per compare
class SimRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    answer_tokens: int
    class_name: str = "default"
    computed: int = 0                 # num_computed_tokens on the instance that holds it
    outputs: int = 0
    blocks: int = 0
    first_s: float | None = None
    last_s: float = 0.0
    finished_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    decode_instance: "Instance | None" = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.outputs


class Instance:
    def __init__(self, name: str, spec: InstanceSpec, model: StepModel, num_blocks: int, block_size: int):
        self.name, self.spec, self.model = name, spec, model
        self.role = spec.role
        self.free_blocks, self.block_size = num_blocks, block_size
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.prefilled: deque[SimRequest] = deque()
        self.busy = False
        self.outstanding = 0              # the router's count for this instance
        self.num_requests = 0
        self.num_steps = self.num_preemptions = 0
        self.busy_s = 0.0
        # waiting prompts of at most half the budget, in queue order: the only ones that can jump
        # the queue, kept apart so a step never scans a long queue of documents to find them
        self.short_waiting: deque[SimRequest] = deque()

    def _is_short(self, req: SimRequest) -> bool:
        return req.prompt_tokens + req.outputs <= self.spec.budget // 2

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)
        if self._is_short(req):
            self.short_waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    def _need(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _admit(self, req: SimRequest) -> bool:
        need = self._need(req.num_tokens)
        if len(self.running) >= self.spec.max_num_seqs or need > self.free_blocks:
            return False
        self.waiting.remove(req)
        if self.short_waiting and self._is_short(req):
            self.short_waiting.remove(req)
        self.free_blocks -= need
        req.blocks = need
        self.running.append(req)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.free_blocks += req.blocks
        req.blocks = req.computed = 0
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if self._is_short(req):
            self.short_waiting.appendleft(req)

    def _reserve_decodes(self) -> list[SimRequest]:
        """A slot for every running decode's next token, preempting the newest when blocks run out."""
        decodes, bs = [], self.block_size
        preempted = False
        for req in list(self.running):
            if req.computed < req.prompt_tokens + req.outputs - 1 or (preempted and req not in self.running):
                continue
            if req.computed < req.blocks * bs:  # room left in its last block: the common case
                decodes.append(req)
                continue
            while True:
                if self.free_blocks >= 1:
                    self.free_blocks -= 1
                    req.blocks += 1
                    decodes.append(req)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
        return decodes

    def schedule(self) -> tuple[list[SimRequest], list[tuple[SimRequest, int]]]:
        while self.prefilled and len(self.running) < self.spec.max_num_seqs:  # KV arrived from a prefill instance
            req = self.prefilled[0]
            need = self._need(req.num_tokens)
            if need > self.free_blocks:
                break
            self.prefilled.popleft()
            self.free_blocks -= need
            req.blocks, req.computed = need, req.num_tokens - 1
            self.running.append(req)
        if not self.waiting:  # the common case at low load: nothing to admit
            decodes = self._reserve_decodes()
            if len(decodes) == len(self.running) or self.spec.policy == "whole":
                return decodes, []
        elif self.spec.policy == "whole":
            return self._schedule_whole()
        else:
            decodes = self._reserve_decodes()
        prefills = []
        budget = self.spec.budget - len(decodes)
        short_budget = min(budget, self.spec.budget // 2)
        jumped = set()
        if len(self.running) >= self.spec.max_num_seqs:
            short_budget = 0  # nothing can be admitted
        candidates = []
        scan_budget, scan_short = budget, short_budget
        for req in self.short_waiting:
            if scan_short <= 0:
                break
            remaining = req.prompt_tokens + req.outputs - req.computed
            if remaining > scan_short:
                continue
            chunk = min(remaining, scan_budget)
            candidates.append((req, chunk))
            scan_budget -= chunk
            scan_short -= chunk
        for req, chunk in candidates:
            if not self._admit(req):
                break
            prefills.append((req, chunk))
            jumped.add(req.index)
            budget -= chunk
        for req in self.running:
            if budget <= 0:
                break
            if req.computed < req.num_tokens - 1 and req.index not in jumped:
                chunk = min(req.num_tokens - req.computed, budget)
                prefills.append((req, chunk))
                budget -= chunk
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            req = self.running[-1]
            chunk = min(req.num_tokens - req.computed, budget)
            prefills.append((req, chunk))
            budget -= chunk
        return decodes, prefills

    def _schedule_whole(self):
        prefills, budget = [], self.spec.budget
        while self.waiting:
            req = self.waiting[0]
            remaining = req.num_tokens - req.computed
            if prefills and remaining > budget:
                break
            if not self._admit(req):
                break
            prefills.append((req, remaining))
            budget -= remaining
        if prefills:
            return [], prefills
        return self._reserve_decodes(), []

    def step_seconds(self, decodes, prefills) -> float:
        tokens, attn = 0, 0.0
        for req, chunk in prefills:
            tokens += chunk
            attn += chunk * (req.computed + chunk / 2) / 1000.0
        kv = 0
        for req in decodes:
            kv += req.computed + 1
        return self.model.step_s(tokens, attn, len(decodes), kv)

    def release(self, req: SimRequest) -> None:
        if req in self.running:
            self.running.remove(req)
        self.free_blocks += req.blocks
        req.blocks = 0


class Simulation:
    """Runs `requests` (sorted by arrival) on instances; `transfer_s(prompt_tokens)` for P->D moves."""

    def __init__(self, instances: list[Instance], transfer_s=lambda n: 0.0):
        self.instances = instances
        self.colocated = [i for i in instances if i.role == "colocated"]
        self.prefill = [i for i in instances if i.role == "prefill"]
        self.decode = [i for i in instances if i.role == "decode"]
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("an arrangement needs a colocated instance, or a prefill and a decode instance")
        self.transfer_s = transfer_s
        self.events: list = []
        self._seq = 0
        self.now = 0.0
        self._pending: dict[Instance, None] = {}  # instances with new work, started once this instant is done
        self._next_arrival_s = math.inf

    def _push(self, time_s: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self.events, (time_s, self._seq, kind, obj))

    def _kick(self, inst: Instance) -> None:
        """Start inst's next step. With colocated instances only, nothing but an arrival can change an
        instance's state, so steps that end before the next arrival are finished here at once instead
        of going through the event queue: the same timeline, several times faster at low load."""
        if inst.busy or not inst.has_work():
            return
        now, inline = self.now, not self.prefill
        while True:
            decodes, prefills = inst.schedule()
            if not decodes and not prefills:
                return
            end = now + inst.step_seconds(decodes, prefills)
            inst.busy_s += end - now
            if not (inline and end < self._next_arrival_s):
                inst.busy = True
                self._push(end, 1, (inst, decodes, prefills))
                return
            self._finish_step(inst, decodes, prefills, end)
            now = end

    def _route(self, req: SimRequest) -> Instance:
        if self.colocated:
            target = min(self.colocated, key=lambda x: (x.outstanding, x.num_requests))
            target.outstanding += req.prompt_tokens + req.answer_tokens
        else:
            target = min(self.prefill, key=lambda x: (x.outstanding, x.num_requests))
            target.outstanding += req.prompt_tokens
            req.decode_instance = min(self.decode, key=lambda x: (x.outstanding, -x.free_blocks, x.num_requests))
            req.decode_instance.outstanding += req.answer_tokens
            req.decode_instance.num_requests += 1
        target.num_requests += 1
        return target

    def _emit(self, inst: Instance, req: SimRequest, now: float) -> None:
        """A sampled token reaches the client at `now`."""
        if req.first_s is None:
            req.first_s = now
            inst.outstanding -= req.prompt_tokens
        else:
            req.gaps.append(now - req.last_s)
        req.last_s = now
        req.outputs += 1
        counted = req.decode_instance or inst
        counted.outstanding -= 1
        if req.outputs >= req.answer_tokens:
            req.finished_s = now
            inst.release(req)
            inst.num_requests -= 1
            if req.decode_instance is not None and req.decode_instance is not inst:
                req.decode_instance.num_requests -= 1
        elif inst.role == "prefill":
            inst.running.remove(req)  # blocks stay leased until the decode instance has pulled them
            inst.num_requests -= 1
            self._push(now + self.transfer_s(req.prompt_tokens), 2, (inst, req))

    def _finish_step(self, inst: Instance, decodes, prefills, now: float) -> None:
        inst.num_steps += 1
        for req in decodes:
            req.computed += 1
            self._emit(inst, req, now)
        for req, chunk in prefills:
            req.computed += chunk
            if req.computed >= req.num_tokens:
                self._emit(inst, req, now)

    def _step_end(self, inst: Instance, decodes, prefills) -> None:
        inst.busy = False
        self._finish_step(inst, decodes, prefills, self.now)
        self._pending[inst] = None

    def _transfer_end(self, source: Instance, req: SimRequest) -> None:
        source.free_blocks += req.blocks
        req.blocks = 0
        self._pending[source] = None
        target = req.decode_instance
        target.prefilled.append(req)
        self._pending[target] = None

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        arrivals = sorted(requests, key=lambda r: r.arrival_s)
        arrivals.append(None)  # sentinel
        i = 0
        self._next_arrival_s = arrivals[0].arrival_s if arrivals[0] else math.inf
        while True:
            next_event_s = self.events[0][0] if self.events else math.inf
            next_s = min(next_event_s, self._next_arrival_s)
            if self._pending and next_s > self.now:
                # everything due at this instant has landed: now idle instances start a step, so
                # requests arriving together are scheduled together, as an engine's intake does
                pending, self._pending = self._pending, {}
                for inst in pending:
                    self._kick(inst)
                continue
            if next_s == math.inf:
                return requests
            if self._next_arrival_s <= next_event_s:  # an arrival goes before a step ending at the same time
                req = arrivals[i]
                i += 1
                self.now = req.arrival_s
                self._next_arrival_s = arrivals[i].arrival_s if arrivals[i] else math.inf
                inst = self._route(req)
                inst.add(req)
                self._pending[inst] = None
                continue
            self.now, _, kind, obj = heapq.heappop(self.events)
            if kind == 1:
                self._step_end(*obj)
            else:
                self._transfer_end(*obj)
