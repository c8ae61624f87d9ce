"""One simulated engine instance: the engine's own scheduler, block manager and connector decisions,
with a step model in place of the model runner.

What decides is engine/scheduler.py and engine/block_manager.py themselves (chunked or whole,
fcfs or priority, preemption, the prefix cache), so the simulator cannot drift from the engine.
This file adds only what the model runner and the KV transfer would do:
  - a step samples SAMPLED_TOKEN for every decode and every prompt its chunk completes, exactly
    the requests the runner samples; Scheduler.update then retires them as in EngineCore.step;
  - a step lasts what the step model says for engine.core's step shape;
  - a colocated instance uses the engine's ColocatedConnector; the prefill and decode roles use
    stand-ins for the transfer that keep the connectors' scheduler-side decisions: a prefill
    instance marks requests remote_decode and keeps their blocks until the decode side has
    pulled them; a decode instance queues arriving KV (most urgent first under the priority
    policy, as the KV receiver), takes blocks through engine.connectors.take_blocks_for_kv (the
    scheduler may preempt for them) and, when the transfer ends, lands it with kv_landed; a prompt
    sent to it without a handover (the disaggregation policy kept it local) it prefills itself, its
    steps' prompt tokens capped as the engine's DecodeConnector caps them.
Prompts are token ids unique to each request (a trial cuts each prompt from its own place of a
long text, so requests share no prefix), which still lets a preempted request find its own
freed blocks in the prefix cache when it is recomputed, as on the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.config import ROLES, SchedulerConfig
from splitserve.control.stepmodel import StepModel
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.connectors import ColocatedConnector, kv_landed, take_blocks_for_kv
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import ScheduledBatch, Scheduler
from splitserve.kv_transfer.config import KVTransferConfig
from splitserve.protocol import EngineStats
from splitserve.sampling import SamplingParams
from splitserve.stepfeatures import step_shape

SAMPLED_TOKEN = 1  # what every simulated step samples; requests ignore EOS, so it never stops one
_KV_LIMITS = KVTransferConfig()  # the receiver's puller limits, as serve starts it


@dataclass(slots=True, frozen=True)
class InstanceSpec:
    role: str = "colocated"
    threads: int = 1
    policy: str = "chunked"           # prefill policy: chunked | whole
    budget: int = 256                 # max_num_batched_tokens
    max_num_seqs: int = 64
    scheduling: str = "fcfs"          # fcfs | priority

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance role must be one of {ROLES}, got {self.role!r}")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        self.scheduler_config()  # the engine's own checks of policy, budget and max_num_seqs

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.budget, self.policy, self.scheduling)


def sim_request(request_id: str, unique: int, prompt_tokens: int, answer_tokens: int, priority: int,
                arrival_s: float, first_token: bool = False) -> Request:
    """An engine request of that shape; `unique` makes its first block (so its prefix) its own.
    first_token: it comes from a prefill instance with its first token (a decode instance's)."""
    prompt = [SAMPLED_TOKEN + 1 + unique] + [0] * (prompt_tokens - 1)
    params = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    request = Request(request_id, prompt, params, arrival_time=arrival_s, priority=priority)
    if first_token:
        request.output_token_ids = [SAMPLED_TOKEN]
    return request


def _block_hash(parent: int | None, token_ids: list[int]) -> int:
    """The prefix cache's chained block hash without SHA-256: the simulator's token ids are its
    own, so no client can build collisions, and 64 bits make a chance one negligible."""
    return hash((parent, *token_ids))


class SimPrefillConnector(ColocatedConnector):
    """PrefillConnector's decisions: a request stops after its first token and its blocks stay
    held until the decode instance has pulled them (release)."""

    role = "prefill"

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.held: dict[str, Request] = {}

    def on_add(self, request: Request, descriptor) -> bool:
        request.remote_decode = True
        return False

    def on_finished(self, request: Request):
        if request.status is not RequestStatus.FINISHED_PREFILL_DONE:
            return False, None  # finished on its first token: nothing to hand over
        self.held[request.request_id] = request
        return True, None

    def release(self, request_id: str) -> None:
        self.blocks.free(self.held.pop(request_id))

    def has_unfinished(self) -> bool:
        return bool(self.held)


class SimDecodeConnector(ColocatedConnector):
    """DecodeConnector with the transfer simulated: start() takes blocks for pending KV in the
    receiver's order and limits; the simulator calls land() when the link time has passed."""

    role = "decode"

    def __init__(self, blocks: BlockManager, scheduler: Scheduler, chunk_tokens: int | None = None):
        self.blocks, self.scheduler = blocks, scheduler
        self.chunk_tokens = chunk_tokens  # a prompt it prefills itself: chunks this small (as DecodeConnector)
        self.by_priority = scheduler.by_priority
        self.pending: dict[str, tuple[Request, str]] = {}  # insertion order = arrival order
        self.active: dict[str, str] = {}  # transferring: request id -> its source instance
        self.landed: list[Request] = []

    def on_add(self, request: Request, descriptor) -> bool:
        if descriptor is None:
            return False
        request.status = RequestStatus.WAITING_FOR_KV
        self.pending[request.request_id] = (request, descriptor)
        return True

    def start(self) -> list[tuple[Request, str]]:
        """Transfers that take their blocks now: (request, its source), as KVReceiver.poll."""
        started, per_source = [], {}
        for source in self.active.values():
            per_source[source] = per_source.get(source, 0) + 1
        for rid, (request, source) in sorted(self.pending.items(),
                                             key=lambda kv: kv[1][0].priority if self.by_priority else 0):
            if len(self.active) >= _KV_LIMITS.max_concurrent_transfers:
                break
            if per_source.get(source, 0) >= _KV_LIMITS.max_transfers_per_source:
                continue
            if not take_blocks_for_kv(self.blocks, self.scheduler.make_room_for_kv, request, False):
                break  # full for now; keep the order
            del self.pending[rid]
            self.active[rid] = source
            per_source[source] = per_source.get(source, 0) + 1
            started.append((request, source))
        return started

    def land(self, request: Request) -> None:
        del self.active[request.request_id]
        kv_landed(self.blocks, request)
        self.landed.append(request)

    def poll(self):
        arrivals = super().poll()
        arrivals.decode, self.landed = self.landed, []
        return arrivals

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.active or self.landed)


class SimEngine:
    """What EngineCore.step does with a batch, minus the model: schedule, time, sample, retire."""

    def __init__(self, name: str, spec: InstanceSpec, model: StepModel, num_blocks: int, block_size: int,
                 local_prefill_chunk_tokens: int | None = None):
        """local_prefill_chunk_tokens: a decode instance's prompt tokens per step when it prefills a
        prompt itself (EngineConfig.local_prefill_chunk_tokens; serve's disaggregation policy sizes it)."""
        self.name, self.spec, self.model, self.role = name, spec, model, spec.role
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True, block_hash=_block_hash)
        self.scheduler = Scheduler(spec.scheduler_config(), self.blocks)
        self.connector = (SimPrefillConnector(self.blocks) if spec.role == "prefill" else
                          SimDecodeConnector(self.blocks, self.scheduler, local_prefill_chunk_tokens)
                          if spec.role == "decode" else ColocatedConnector())
        self._cap_prompt_tokens()
        self.busy = False  # a step is in flight
        self.num_steps = 0
        self.busy_s = 0.0

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def add(self, request: Request, source: str | None = None) -> None:
        """As EngineCore.add_request: the connector keeps a request whose KV is elsewhere (its
        source instance's name), the scheduler queues the rest."""
        if not self.connector.on_add(request, source):
            self.scheduler.add(request)

    def stats(self) -> EngineStats:
        """What the engine would report now (the counters a disaggregation policy reads)."""
        sched, blocks = self.scheduler, self.blocks
        return EngineStats(self.name, self.role, len(sched.waiting), len(sched.running), blocks.num_blocks,
                           blocks.num_free_blocks, block_size=blocks.block_size,
                           num_queued_prompt_tokens=sched.num_queued_prompt_tokens)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(getattr(self.connector, "landed", None))

    def begin_step(self) -> list[tuple[Request, str]]:
        """The start of a step, before the scheduler plans (EngineCore.step's connector poll): KV
        that landed joins as decodes, and a decode instance takes blocks for pending KV; returns
        the transfers that start now, with their sources."""
        arrivals = self.connector.poll()
        for request in arrivals.decode:
            self.scheduler.add_prefilled(request)
        self._cap_prompt_tokens()
        return self.connector.start() if self.role == "decode" else []

    def _cap_prompt_tokens(self) -> None:
        """The connector's cap on this step's prompt tokens, asked before each step as EngineCore.step does."""
        self.scheduler.prompt_tokens_per_step = self.connector.prompt_tokens_per_step(self.scheduler.has_streams())

    def step_seconds(self, batch: ScheduledBatch) -> float:
        return self.model.step_s(*step_shape(batch))

    def finish(self, batch: ScheduledBatch) -> tuple[list[Request], set[Request]]:
        """The end of a step: (the requests that got a token, in the runner's order, and those
        of them that finished here). A finished request's blocks go unless the connector keeps
        them for a handover."""
        sampled = {r: SAMPLED_TOKEN for r in batch.decodes}
        for request, chunk in batch.prefills:
            if request.num_computed_tokens + chunk >= request.num_tokens:
                sampled[request] = SAMPLED_TOKEN
        finished = set(self.scheduler.update(batch, sampled))
        for request in finished:
            keep, _ = self.connector.on_finished(request)
            if not keep:
                self.blocks.free(request)
        self.num_steps += 1
        return list(sampled), finished
