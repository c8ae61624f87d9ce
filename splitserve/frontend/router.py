"""Which engine instance serves a request.

For N colocated instances: least outstanding tokens, where a request's outstanding tokens
are its prompt tokens not yet prefilled plus the answer tokens it may still produce. The
router is told when a request starts, makes progress and ends, so its picture stays exact
without asking the engines. Disaggregation (issue 4) extends `Router` with a prefill/decode
choice: `pick` gets the request and returns a `RoutePlan`, which can then name two instances.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class NoInstanceAvailable(RuntimeError):
    """Every live instance is at its admission limit, or none is alive."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class RoutableRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int


@dataclass(slots=True)
class InstanceLoad:
    instance_id: str
    role: str = "colocated"
    alive: bool = True
    max_requests: int = 1 << 30  # admission limit: running slots + bounded queue
    outstanding_tokens: int = 0
    # request_id -> its outstanding tokens (so progress and the end are O(1))
    requests: dict[str, int] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class RoutePlan:
    instance_id: str  # colocated: the one instance; disaggregated: the decode instance
    prefill_instance_id: str | None = None  # issue 4: set when prefill runs elsewhere


class Router:
    """Least-outstanding-tokens over live instances with room left."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceLoad] = {}

    def add_instance(self, instance_id: str, role: str = "colocated", max_requests: int = 1 << 30) -> None:
        self.instances[instance_id] = InstanceLoad(instance_id, role, True, max_requests)

    def mark_dead(self, instance_id: str) -> list[str]:
        """Takes an instance out of rotation; returns the requests it held."""
        load = self.instances[instance_id]
        load.alive = False
        lost = list(load.requests)
        load.requests.clear()
        load.outstanding_tokens = 0
        return lost

    def pick(self, request: RoutableRequest) -> RoutePlan:
        live = [x for x in self.instances.values() if x.alive and x.role == "colocated"]
        if not live:
            raise NoInstanceAvailable("no engine instance is alive", retry_after_s=5)
        open_ = [x for x in live if x.num_requests < x.max_requests]
        if not open_:
            raise NoInstanceAvailable("every engine instance's queue is full; retry later")
        best = min(open_, key=lambda x: (x.outstanding_tokens, x.num_requests))
        return RoutePlan(best.instance_id)

    def on_start(self, plan: RoutePlan, request: RoutableRequest) -> None:
        load = self.instances[plan.instance_id]
        tokens = request.num_prompt_tokens + request.max_tokens
        load.requests[request.request_id] = tokens
        load.outstanding_tokens += tokens

    def on_progress(self, instance_id: str, request_id: str, num_prompt_done: int, num_new_tokens: int) -> None:
        load = self.instances[instance_id]
        if request_id not in load.requests:
            return
        done = min(load.requests[request_id], num_prompt_done + num_new_tokens)
        load.requests[request_id] -= done
        load.outstanding_tokens -= done

    def on_finish(self, instance_id: str, request_id: str) -> None:
        load = self.instances[instance_id]
        load.outstanding_tokens -= load.requests.pop(request_id, 0)
