"""One simulated engine instance: engine/scheduler.py's decisions, step by step, without a model.

  chunked: every running decode first (the newest preempted when blocks run out), then short
    waiting prompts whole (each at most half the budget, together at most half), then running
    chunks, then new admissions, until the step's token budget is spent;
  whole: waiting prompts whole (the first even past the budget), else a decode of everyone.
KV blocks are counted (admission allocates the whole sequence, a decode one slot), so running
out preempts the newest request, which recomputes later. Prefix-cache hits are not modelled.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splitserve.control.stepmodel import StepModel
from splitserve.roles import ROLES



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

    def decoding_only(self) -> bool:
        """Nothing to admit and every running request past its first token: the next steps are
        decodes of the same batch until one finishes or something arrives."""
        if self.waiting or self.prefilled or not self.running:
            return False
        return all(r.outputs and r.computed == r.prompt_tokens + r.outputs - 1 for r in self.running)

    def decode_steps_with_blocks(self, steps: int) -> int:
        """How many of the next `steps` decode-only steps the free blocks hold without preempting
        (a step's token at position `computed` needs computed < blocks * block_size)."""
        def need(k: int) -> int:
            return sum(max(0, self._need(r.computed + k) - r.blocks) for r in self.running)
        # each request needs at most ceil(steps / block_size) new blocks: the usual, quick answer
        if steps == 0 or len(self.running) * -(-steps // self.block_size) <= self.free_blocks:
            return steps
        if need(steps) <= self.free_blocks:
            return steps
        lo, hi = 0, steps  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= self.free_blocks else (lo, mid)
        return lo

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
