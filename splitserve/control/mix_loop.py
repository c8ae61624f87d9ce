"""Running the mix controller: every interval read the instances, decide, apply, log why.

The frontend gives the callables: `views()` returns one InstanceView per instance,
`change_role(instance_id, role)` (async) performs a live role change, and optionally `demand()`
the Demand of the last few seconds (control/whatif.py) and `set_threshold(tokens)`, which moves
the decode instances' local-prefill threshold, and `set_chunk_tokens(tokens)`, which moves every
instance's prompt tokens per step beside its streams (the controller's cheaper knobs), and
`set_stream_caps({instance id: cap})`, which tells instances how many streams they may hold
(control/stream_cap.py), sent only where a cap changed. How long each
change took to commit goes back to the controller as the measured cost of the next ones. Every decision, change
or not, goes to a bounded in-memory log that /metrics and the trial report can read.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from splitserve.control.mix import Decision, InstanceView, MixController
from splitserve.control.whatif import Demand

log = logging.getLogger(__name__)


class MixLoop:
    def __init__(self, controller: MixController, views: Callable[[], list[InstanceView]],
                 change_role: Callable[[str, str], Awaitable[object]], interval_s: float = 2.0,
                 max_log: int = 512, clock: Callable[[], float] = time.monotonic,
                 demand: Callable[[], Demand] | None = None,
                 set_threshold: Callable[[int], object] | None = None,
                 set_chunk_tokens: Callable[[int], object] | None = None,
                 set_stream_caps: Callable[[dict[str, int | None]], object] | None = None):
        if interval_s <= 0:
            raise ValueError(f"mix interval must be positive seconds, got {interval_s}")
        self.controller, self.views, self.change_role = controller, views, change_role
        self.interval_s, self.clock, self.demand = interval_s, clock, demand
        self.set_threshold, self.set_chunk_tokens = set_threshold, set_chunk_tokens
        self.set_stream_caps = set_stream_caps
        self.stream_caps: dict[str, int | None] = {}  # what each instance was last told
        self.num_cap_moves = 0
        self.num_threshold_moves = self.num_chunk_moves = 0
        self.decisions: deque[dict] = deque(maxlen=max_log)
        self.num_role_changes = 0
        self.num_failed_changes = 0
        self._stopped = asyncio.Event()

    async def run_once(self) -> Decision:
        demand = self.demand() if self.demand is not None else None
        views = self.views()
        decision = self.controller.decide(views, self.clock(), demand)
        entry = decision.to_dict()
        if self.set_stream_caps is not None:
            caps = self.controller.stream_caps(views, demand)
            moved = {k: v for k, v in caps.items() if self.stream_caps.get(k) != v}
            if moved:
                self.set_stream_caps(moved)
                self.stream_caps.update(moved)
                self.num_cap_moves += 1
                entry["stream_caps"] = moved
        if decision.local_prefill_max_tokens is not None and self.set_threshold is not None:
            self.set_threshold(decision.local_prefill_max_tokens)
            self.num_threshold_moves += 1
            entry["applied"] = True
        if decision.chunk_tokens is not None and self.set_chunk_tokens is not None:
            self.set_chunk_tokens(decision.chunk_tokens)
            self.num_chunk_moves += 1
            entry["applied"] = True
        if entry.get("applied"):
            log.info("mix: %s", decision.reason)
        if decision.instance_id is not None:
            try:
                started = time.monotonic()
                await self.change_role(decision.instance_id, decision.to_role)
                self.controller.record_change_cost(time.monotonic() - started)
                entry["change_seconds"] = time.monotonic() - started
                self.num_role_changes += 1
                entry["applied"] = True
                log.info("mix: %s", decision.reason)
            except Exception as exc:  # a refused or failed change must not stop the loop
                self.num_failed_changes += 1
                self.controller.change_failed()
                entry.update(applied=False, error=f"{type(exc).__name__}: {exc}")
                log.warning("mix: change of %s to %s failed: %s", decision.instance_id, decision.to_role, exc)
        else:
            log.debug("mix: no change: %s", decision.reason)
        self.decisions.append(entry)
        return decision

    async def run(self) -> None:
        while not self._stopped.is_set():
            await self.run_once()
            try:
                await asyncio.wait_for(self._stopped.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._stopped.set()

    def changes(self) -> list[dict]:
        """The timeline of role changes (applied or failed), oldest first: for the trial report."""
        return [d for d in self.decisions if d["instance_id"] is not None]
