"""A discrete-event model of this project's serving, built from its own policy code.

Each instance (control/sim_engine.py) is the engine's Scheduler and BlockManager with the role's
connector decisions; routing is coordinator/router.py's Router itself, told of starts, progress and
ends as the coordinator's dispatcher tells it. Time is virtual and jumps from event to event (an
arrival, the end of an engine step, the end of a KV transfer); nothing sleeps. A step lasts what
the step model (control/stepmodel.py) says for what it holds; its sampled tokens reach the client
at its end. A prefill instance's first token goes to the client and the request to the decode
instance the router chose at arrival; that instance takes blocks for the KV at its next step's
start (the receiver's order and limits), the KV lands the profiled transfer time later and the
request joins its batch at the step after (so the link sits in each separated answer's first gap,
as in a trial); the prefill instance's blocks are freed then.

Separated arrangements ask the coordinator's own DisaggPolicy (serve --disagg-policy) after the
router's pick, as the dispatcher does: a prompt it keeps local goes to the decode instance, which
prefills it beside its streams, and no transfer is charged for it. The policy reads each instance's
counters as the engine would report them; `auto` weighs the step model the simulation runs on
(what its online refit learns from the engines' steps).

The serving stack's CPU outside the steps (the frontend, the coordinator, the engines' loops, a
trial's client; the profile's host_work) takes cores from the engines: at the simulated rates it
keeps `host_load` cores busy: idle cores take it first, the rest takes an equal share of each busy
engine thread's core, and a multi-thread engine waits at its barriers for the slowest of its
threads (Simulation.stretch).

Left out: the frontend's own latency, the engines' stats delay (the router learns a decode
instance's free blocks at each of its step ends, not every 0.25 s), prefix affinity, stop
strings, failures. Admission limits are the frontend's (max_num_seqs + 256 queued per instance):
a request no instance has room for is refused (429), as is one no cache could ever hold (400);
a refused request never gets a token.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from splitserve.config import ROLES
from splitserve.control.sim_engine import SAMPLED_TOKEN, InstanceSpec, SimEngine, sim_request
from splitserve.coordinator.disagg_policy import DisaggPolicy
from splitserve.coordinator.router import NoInstanceAvailable, RoutableRequest, Router, prefix_key
from splitserve.engine.request import RequestStatus
from splitserve.stepfeatures import prefill_attn_ktok2

__all__ = ["ROLES", "Instance", "InstanceSpec", "SimRequest", "Simulation"]

Instance = SimEngine  # an arrangement's instance, as the planner builds it
MAX_QUEUED_REQUESTS = 256  # serve's --max-queued-requests default: the router's admission limit
_STEP_END, _TRANSFER_END = 1, 2


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request of the workload, and what the simulation made of it."""

    index: int
    arrival_s: float
    prompt_tokens: int
    answer_tokens: int
    class_name: str = "default"
    priority: int = 0
    outputs: int = 0
    first_s: float | None = None
    last_s: float = 0.0
    finished_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    refused: bool = False
    decode_instance: str | None = None  # where the router sends it after its prefill
    prefill: str | None = None  # "local" | "remote" where the disaggregation policy reported it (as a trial's record)


class _PolicyView:
    """An instance as the disaggregation policy reads it (the engine link's Instance): its counters
    now, and no measured steps, so `auto` keeps the step model it was given."""

    alive = True
    num_step_samples = 0
    step_samples = ()

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    @property
    def stats(self):
        return self.engine.stats()


class Simulation:
    """Runs `requests` on instances; `transfer_s(prompt_tokens)` for P->D moves."""

    fast_forward = True  # run stretches of decode-only steps at once (tests turn it off to compare)

    def __init__(self, instances: list[SimEngine], transfer_s=lambda n: 0.0, contention: float = 1.0,
                 max_queued_requests: int = MAX_QUEUED_REQUESTS, disagg: DisaggPolicy | None = None,
                 host_load: float = 0.0, cores: float | None = None):
        """disagg: where a separated arrangement's prompts are prefilled (None: always remote).
        host_load: cores the serving stack keeps busy outside engine steps (the frontend, the
        coordinator, the client: profile_file.HostWork.load at the simulated rates); cores: the
        host's (default: the instances' threads, which fill it)."""
        self.instances = instances
        self.by_name = {i.name: i for i in instances}
        roles = {i.role for i in instances}
        if "colocated" not in roles and not {"prefill", "decode"} <= roles:
            raise ValueError("an arrangement needs a colocated instance, or a prefill and a decode instance")
        self.colocated_only = roles == {"colocated"}
        self.router = Router()
        for inst in instances:
            self.router.add_instance(inst.name, inst.role, inst.spec.max_num_seqs + max_queued_requests)
        self.disagg = disagg
        self._views = {i.name: _PolicyView(i) for i in instances}
        self.num_transfers = 0
        self.transfer_s = transfer_s
        # a step that starts while another instance on the host is busy runs `contention` times its
        # profiled time (shared memory bandwidth and cache; bench/host_contention.py measures it).
        # Then every step goes through the event queue, so who is busy is known at each start.
        if contention < 1.0:
            raise ValueError(f"host contention must be >= 1 (a busy neighbour never speeds a step up), got {contention}")
        self.contention = contention if len(instances) > 1 else 1.0
        # The stack's host work keeps `host_load` cores busy. Idle cores take it first; what
        # spills onto the B busy engine threads' cores takes an equal share of each. A step of an
        # instance of T threads runs 1 / (1 - spill x T / B) times its profiled time: a 1-thread
        # engine loses its core's share (with every core busy, B / (cores - host_load), the
        # threads sharing what the stack leaves); a multi-thread engine waits at each parallel
        # region's barrier for whichever of its threads the stack preempted, so it loses the
        # share of all its cores together. One instance is always its own B, so its model is
        # scaled once; several go through the event queue.
        if host_load < 0:
            raise ValueError(f"host load must be >= 0 cores, got {host_load}")
        self.cores = float(cores if cores is not None else sum(i.spec.threads for i in instances))
        self.host_load = host_load
        self._stretching = False
        if host_load > 0:
            if len(instances) == 1:
                only = instances[0]
                only.model = only.model.scaled(self.stretch(only.spec.threads, only.spec.threads))
            else:
                self._stretching = True
        self.events: list = []
        self._seq = 0
        self.now = 0.0
        self._pending: dict[SimEngine, None] = {}  # instances with news, started once this instant is done
        self._starting: dict[SimEngine, None] = {}
        self._next_arrival_s = math.inf
        self._live: dict[str, SimRequest] = {}

    def _push(self, time_s: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self.events, (time_s, self._seq, kind, obj))

    # ---- arrivals: the frontend's dispatch -------------------------------------------------

    def _arrive(self, req: SimRequest, unique: int) -> None:
        rid = str(unique)
        request = sim_request(rid, unique, req.prompt_tokens, req.answer_tokens, req.priority, req.arrival_s)
        prompt = request.prompt_token_ids
        routable = RoutableRequest(rid, req.prompt_tokens, req.answer_tokens, prefix_key(prompt), prompt)
        try:
            plan = self.router.pick(routable)
        except NoInstanceAvailable:
            req.refused = True  # 429: every instance's queue is full
            return
        if self.disagg is not None:
            plan, placement = self.disagg.place(plan, routable, self._views, self.router)
            if placement is not None:
                req.prefill = "local" if placement.local else "remote"
        target = self.by_name[plan.prefill_instance_id or plan.instance_id]
        blocks = target.blocks
        if blocks.blocks_needed(req.prompt_tokens + req.answer_tokens) > blocks.num_blocks:
            req.refused = True  # 400, as EngineCore.validate: no cache here could ever hold it
            if self.disagg is not None:
                self.disagg.on_prefilled(target.name, rid)  # as the dispatcher releases a failed request
            return
        self.router.on_start(plan, routable)
        req.decode_instance = plan.instance_id if plan.prefill_instance_id is not None else None
        self._live[rid] = req
        target.add(request)
        self._pending[target] = None

    # ---- steps ---------------------------------------------------------------------------

    def _kick(self, inst: SimEngine) -> None:
        """Start inst's next step. A colocated step that ends before the next arrival is finished
        here at once instead of going through the event queue (only an arrival can touch a
        colocated instance; the same timeline, several times faster at low load)."""
        if inst.busy:
            return
        now, contended = self.now, self.contention != 1.0 or self._stretching
        while True:
            for request, source in inst.begin_step():
                self.num_transfers += 1
                self._push(now + self.transfer_s(request.num_prompt_tokens), _TRANSFER_END, (inst, request, source))
            horizon = self._next_arrival_s
            if (contended or not self.colocated_only) and self.events:
                horizon = min(horizon, self.events[0][0])
            # Contended, a step's time depends on who else is busy. When no other instance starts
            # at this instant, that stays as it is until the next event or arrival (a neighbour's
            # step end is an event; an idle one wakes only on an arrival or an event), so a
            # stretch of steady steps up to then runs at one factor.
            if self.fast_forward and (not contended or len(self._starting) <= 1):
                now = self._fast_forward(inst, now, horizon, self._step_factor(inst) if contended else 1.0)
            batch = inst.scheduler.schedule()
            if not batch:
                return
            step = inst.step_seconds(batch)
            if contended:
                step *= self._step_factor(inst)
            end = now + step
            inst.busy_s += step
            if contended or not self.colocated_only or end >= horizon:
                inst.busy = True
                self._push(end, _STEP_END, (inst, batch))
                return
            self._finish_step(inst, batch, end)
            now = end

    def _step_factor(self, inst: SimEngine) -> float:
        """How many times its profiled time a step of inst starting now takes: the neighbour
        factor while another instance is busy, times the host work's stretch."""
        factor = self.contention if self.contention != 1.0 and self._neighbour_busy(inst) else 1.0
        return factor * self.stretch(self._busy_threads(inst), inst.spec.threads) if self._stretching else factor

    def stretch(self, busy_threads: int, threads: int = 1) -> float:
        """How many times its profiled time a step of an instance of `threads` threads takes while
        `busy_threads` engine threads (its own among them) are busy beside the stack's host work."""
        spill = self.host_load - max(self.cores - busy_threads, 0.0)
        if spill <= 0:
            return 1.0
        return 1.0 / max(1.0 - spill * threads / busy_threads, 0.05)

    def _busy_neighbours(self, inst: SimEngine):
        """The other instances with a step in flight, or starting one at this same instant."""
        return (o for o in self.instances if o is not inst and (o.busy or (o in self._starting and o.has_work())))

    def _busy_threads(self, inst: SimEngine) -> int:
        """inst's threads and those of every busy neighbour."""
        return inst.spec.threads + sum(o.spec.threads for o in self._busy_neighbours(inst))

    def _neighbour_busy(self, inst: SimEngine) -> bool:
        return any(True for _ in self._busy_neighbours(inst))

    def _fast_forward(self, inst: SimEngine, now: float, horizon: float, factor: float = 1.0) -> float:
        """Run, in one go, the steps the scheduler says keep the batch's shape (decodes plus one
        prompt's chunks, nothing admitted, preempted or finished: Scheduler.steady_steps) and that
        end before `horizon`. The same floats as one step at a time: each step's time from the
        same shape, each end the previous end plus that time. Returns the time the last of them
        ends (`now` when none could run). factor: each step's time multiplied (host contention)."""
        sched, model = inst.scheduler, inst.model
        limit, prompt, chunk = sched.steady_steps(1 << 30)
        if limit == 0:
            return now
        decodes = [r for r in sched.running if not r.is_prefilling]
        n = len(decodes)
        kv = sum(r.num_computed_tokens + 1 for r in decodes)
        start = prompt.num_computed_tokens if prompt is not None else 0
        ends, end, busy = [], now, inst.busy_s
        for _ in range(limit):
            if prompt is None:
                step = model.step_s(0, 0.0, n, kv) * factor
            else:
                step = model.step_s(chunk, prefill_attn_ktok2(start, chunk), n, kv) * factor
                start += chunk
            nxt = end + step
            if nxt >= horizon:
                break
            busy += step
            ends.append(nxt)
            end = nxt
            kv += n
        k = len(ends)
        if k == 0:
            return now
        sched.advance_steady(k, SAMPLED_TOKEN, (prompt, chunk))
        inst.busy_s, inst.num_steps = busy, inst.num_steps + k
        if not decodes:
            return end
        tail = [b - a for a, b in zip(ends, ends[1:])]
        for request in decodes:
            req = self._live[request.request_id]
            first = req.first_s is None  # a prompt whose last token runs as a decode samples its first here
            if first:
                req.first_s = ends[0]
            else:
                req.gaps.append(ends[0] - req.last_s)
            req.gaps.extend(tail)
            req.last_s = end
            req.outputs += k
            self.router.on_progress(inst.name, request.request_id, req.prompt_tokens if first else 0, k)
        return end

    def _finish_step(self, inst: SimEngine, batch, now: float) -> None:
        sampled, finished = inst.finish(batch)
        router = self.router
        for request in sampled:
            rid = request.request_id
            req = self._live[rid]
            first = req.first_s is None
            if first:
                req.first_s = now
                if self.disagg is not None:
                    self.disagg.on_prefilled(inst.name, rid)
            else:
                req.gaps.append(now - req.last_s)
            req.last_s = now
            req.outputs += 1
            router.on_progress(inst.name, rid, req.prompt_tokens if first else 0, 1)
            if request not in finished:
                continue
            if request.status is RequestStatus.FINISHED_PREFILL_DONE:  # the frontend hands it over
                router.on_finish(inst.name, rid)
                decode = self.by_name[req.decode_instance]
                # a new request there, stamped with its arrival there (the priority policy's tie-break)
                decode.add(sim_request(rid, int(rid), req.prompt_tokens, req.answer_tokens, req.priority,
                                       now, first_token=True), source=inst.name)
                self._pending[decode] = None
                continue
            req.finished_s = now
            del self._live[rid]
            router.on_finish(inst.name, rid)
            if req.decode_instance is not None:
                router.on_finish(req.decode_instance, rid)
        router.set_free_blocks(inst.name, inst.free_blocks)

    def _step_end(self, inst: SimEngine, batch) -> None:
        inst.busy = False
        self._finish_step(inst, batch, self.now)
        self._pending[inst] = None

    def _transfer_end(self, inst: SimEngine, request, source: str) -> None:
        inst.connector.land(request)
        self.by_name[source].connector.release(request.request_id)
        self._pending[inst] = None
        self._pending[self.by_name[source]] = None

    def _kick_pending(self) -> None:
        # prefill and colocated instances first: a decode instance's fast-forward must see the
        # step ends (handovers) they schedule at this instant
        pending, self._pending = self._pending, {}
        self._starting = pending
        for inst in sorted(pending, key=lambda i: i.role == "decode"):
            self._kick(inst)
        self._starting = {}

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
                self._kick_pending()
                continue
            if next_s == math.inf:
                return requests
            if self._next_arrival_s <= next_event_s:  # an arrival goes before a step ending at the same time
                req = arrivals[i]
                self.now = req.arrival_s
                self._arrive(req, i)
                i += 1
                self._next_arrival_s = arrivals[i].arrival_s if arrivals[i] else math.inf
                continue
            self.now, _, kind, obj = heapq.heappop(self.events)
            if kind == _STEP_END:
                self._step_end(*obj)
            else:
                self._transfer_end(*obj)
