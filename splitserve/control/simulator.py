"""A discrete-event model of this project's serving: its scheduler, its router, its KV handover.

Time jumps from event to event (an arrival, the end of an engine step, the end of a KV
transfer); nothing sleeps. Each instance (control/sim_instance.py) mirrors engine/scheduler.py.
A step lasts what the step model (control/stepmodel.py) says for what it holds; its sampled
tokens reach the client at its end. A prefill-role instance hands a finished prompt to the
decode instance chosen at arrival; the KV lands after the profiled transfer time and the
request joins that instance's batch at its next step. The router is coordinator/router.py's:
least outstanding tokens for colocated instances (prompt + answer), least queued prompt
tokens for prefill, least outstanding answer tokens for decode.
Left out: the frontend's own latency, prefix-cache hits, admission limits (429s), failures.
"""
from __future__ import annotations

import heapq
import math

from splitserve.control.sim_instance import ROLES, Instance, InstanceSpec, SimRequest
from splitserve.control.stepmodel import PANEL_ROWS

__all__ = ["ROLES", "Instance", "InstanceSpec", "SimRequest", "Simulation"]


class Simulation:
    """Runs `requests` (sorted by arrival) on instances; `transfer_s(prompt_tokens)` for P->D moves."""

    fast_forward = True  # batch runs of decode-only steps (tests turn it off to compare timelines)

    def __init__(self, instances: list[Instance], transfer_s=lambda n: 0.0, contention: float = 1.0):
        self.instances = instances
        self.colocated = [i for i in instances if i.role == "colocated"]
        self.prefill = [i for i in instances if i.role == "prefill"]
        self.decode = [i for i in instances if i.role == "decode"]
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("an arrangement needs a colocated instance, or a prefill and a decode instance")
        self.transfer_s = transfer_s
        # a step that starts while another instance on the host is busy runs `contention` times its
        # profiled time (shared memory bandwidth and cache; bench/host_contention.py measures it).
        # Then every step goes through the event queue, so who is busy is known at each start.
        if contention < 1.0:
            raise ValueError(f"host contention must be >= 1 (a busy neighbour never speeds a step up), got {contention}")
        self.contention = contention if len(instances) > 1 else 1.0
        self._starting: dict[Instance, None] = {}
        self.events: list = []
        self._seq = 0
        self.now = 0.0
        self._pending: dict[Instance, None] = {}  # instances with new work, started once this instant is done
        self._next_arrival_s = math.inf

    def _push(self, time_s: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self.events, (time_s, self._seq, kind, obj))

    def _kick(self, inst: Instance) -> None:
        """Start inst's next step. A step that ends before anything else can touch the instance is
        finished here at once instead of going through the event queue (the same timeline, several
        times faster at low load). With colocated instances only, just an arrival can touch one;
        with separated stages, any queued event may (a prefill's step end starts a transfer)."""
        if inst.busy or not inst.has_work():
            return
        now, colocated_only = self.now, not self.prefill
        contended = self.contention != 1.0
        while True:
            horizon = self._next_arrival_s
            if not colocated_only and self.events:
                horizon = min(horizon, self.events[0][0])
            if self.fast_forward and not contended and inst.decoding_only():
                now = self._fast_forward(inst, now, horizon)
            decodes, prefills = inst.schedule()
            if not decodes and not prefills:
                return
            step = inst.step_seconds(decodes, prefills)
            if contended and self._neighbour_busy(inst):
                step *= self.contention
            end = now + step
            inst.busy_s += end - now
            if contended or end >= horizon:
                inst.busy = True
                self._push(end, 1, (inst, decodes, prefills))
                return
            self._finish_step(inst, decodes, prefills, end)
            now = end

    def _neighbour_busy(self, inst: Instance) -> bool:
        """Another instance has a step in flight, or starts one at this same instant."""
        return any(o is not inst and (o.busy or (o in self._starting and o.has_work())) for o in self.instances)

    def _fast_forward(self, inst: Instance, now: float, horizon: float) -> float:
        """Run, in one go, the decode-only steps that end before `horizon` and before any request
        finishes (the batch is fixed, so step k lasts step_s(n, kv0 + k n)). The same floats as
        step by step: each end is the previous end plus that step's time, each gap an end minus the
        previous one. Returns the time the last of them ends (`now` when none could run)."""
        running, model = inst.running, inst.model
        n = len(running)
        max_steps = min(r.answer_tokens - r.outputs for r in running) - 1  # the finishing step goes the normal way
        if max_steps <= 0:
            return now
        kv = sum(r.computed + 1 for r in running)
        # model.step_s(0, 0.0, n, kv) evaluates to exactly ((overhead + per_decode_seq * n) + per_kv * kv)
        # + per_panel_step (the last only past PANEL_ROWS rows)
        base, per_kv = model.overhead_s + model.per_decode_seq_s * n, model.per_decode_kv_token_s
        panel = model.per_panel_step_s if n > PANEL_ROWS else None
        ends, gaps, end = [], [], now  # gaps[j] = ends[j] - ends[j - 1], as one step at a time records it
        for _ in range(max_steps):
            step = base + per_kv * kv
            nxt = end + (step if panel is None else step + panel)
            if nxt >= horizon:
                break
            ends.append(nxt)
            gaps.append(nxt - end)
            end = nxt
            kv += n
        k = inst.decode_steps_with_blocks(len(ends))
        if k == 0:
            return now
        tail = gaps[1:k]
        busy = inst.busy_s
        for gap in gaps[:k]:
            busy += gap
        inst.busy_s = busy
        first, last, bs = ends[0], ends[k - 1], inst.block_size
        for r in running:
            r.gaps.append(first - r.last_s)
            r.gaps.extend(tail)
            r.last_s = last
            r.computed += k
            r.outputs += k
            need = -(-r.computed // bs)
            if need > r.blocks:
                inst.free_blocks -= need - r.blocks
                r.blocks = need
            (r.decode_instance or inst).outstanding -= k
        inst.num_steps += k
        return last

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
                self._starting = pending
                for inst in pending:
                    self._kick(inst)
                self._starting = {}
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
