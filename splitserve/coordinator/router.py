"""Which engine instance serves a request.

For N colocated instances: least outstanding tokens, where a request's outstanding tokens
are its prompt tokens not yet prefilled plus the answer tokens it may still produce. The
router is told when a request starts, makes progress and ends, so its picture stays exact
without asking the engines.

Disaggregated (prefill and decode instances live): `pick` names two instances. The prefill
instance is the one with the fewest queued prompt tokens (its outstanding tokens count only
prompts); the decode instance the one with the fewest running tokens (its outstanding tokens
count only answers), ties broken by free KV blocks as the engines last reported them.
With prefix affinity on (`serve --prefix-affinity`), a prompt whose first AFFINITY_TOKENS
tokens were seen before goes back to the instance that prefilled them (its prefix cache holds
them) unless that one is AFFINITY_SLACK_TOKENS busier than the least loaded. A
request is registered on both at once, so admission limits hold on both sides. A drained
instance, or one changing its role, takes no new requests; a dead one is out of rotation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

AFFINITY_TOKENS = 64  # a prompt's first tokens name its prefix (a shared system prompt, a document)
AFFINITY_SLACK_TOKENS = 2048  # follow the prefix unless its instance is this much busier than the least
MAX_AFFINITY_ENTRIES = 4096  # oldest prefixes are forgotten first


def prefix_key(prompt_token_ids: list[int]) -> int | None:
    """What prefix affinity routes on; None for prompts too short to share a useful prefix."""
    if len(prompt_token_ids) < AFFINITY_TOKENS:
        return None
    return hash(tuple(prompt_token_ids[:AFFINITY_TOKENS]))


class NoInstanceAvailable(RuntimeError):
    """Every live instance is at its admission limit (429), or none able to serve is alive (503)."""

    def __init__(self, message: str, retry_after_s: int = 1, status: int = 429) -> None:
        super().__init__(message)
        self.retry_after_s, self.status = retry_after_s, status


@dataclass(slots=True)
class RoutableRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    prefix_key: int | None = None  # prefix_key(prompt): for prefix affinity
    prompt_token_ids: list[int] | None = None  # for a disaggregation policy's prefix-cache estimate


@dataclass(slots=True)
class InstanceLoad:
    instance_id: str
    role: str = "colocated"
    alive: bool = True
    max_requests: int = 1 << 30  # admission limit: running slots + bounded queue
    draining: bool = False  # takes no new requests (admin DELETE); leaves once empty
    changing_role: bool = False  # takes no new requests until its new connector is in place
    num_free_blocks: int = 0  # as last reported by the engine
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

    def __init__(self, prefix_affinity: bool = False) -> None:
        self.instances: dict[str, InstanceLoad] = {}
        self.prefix_affinity = prefix_affinity
        self.affinity: dict[int, str] = {}  # prefix_key -> instance that prefilled it last (insertion = age)

    def add_instance(self, instance_id: str, role: str = "colocated", max_requests: int = 1 << 30) -> None:
        self.instances[instance_id] = InstanceLoad(instance_id, role, True, max_requests)

    def drain(self, instance_id: str) -> None:
        self.instances[instance_id].draining = True

    def set_changing_role(self, instance_id: str, changing: bool) -> None:
        self.instances[instance_id].changing_role = changing

    def set_role(self, instance_id: str, role: str) -> None:
        self.instances[instance_id].role = role

    def serving(self) -> dict[str, str]:
        """instance -> role, of the live instances that are not being drained."""
        return {x.instance_id: x.role for x in self.instances.values() if x.alive and not x.draining}

    def plays(self, instance_id: str | None, role: str) -> bool:
        """Alive and serving as `role` now (for a request it already admitted: no capacity check)."""
        load = self.instances.get(instance_id)
        return load is not None and load.alive and not load.changing_role and load.role == role

    def still_decodes(self, instance_id: str | None) -> bool:
        """Alive with a decode connector, even while changing its role: the engine swaps it only
        once the KV it was sent has landed, so a stream handed over now goes on there."""
        load = self.instances.get(instance_id)
        return load is not None and load.alive and load.role == "decode"

    def remove(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def set_free_blocks(self, instance_id: str, num_free_blocks: int) -> None:
        load = self.instances.get(instance_id)
        if load is not None:
            load.num_free_blocks = num_free_blocks

    def _open(self, role: str) -> list[InstanceLoad]:
        live = [x for x in self.instances.values() if x.alive and not x.draining and x.role == role]
        if not live:
            raise NoInstanceAvailable(f"no {role} engine instance is alive", retry_after_s=5, status=503)
        open_ = [x for x in live if x.num_requests < x.max_requests and not x.changing_role]
        if not open_:
            raise NoInstanceAvailable(f"every {role} engine instance's queue is full; retry later")
        return open_

    def open_instances(self, role: str) -> list[InstanceLoad]:
        """Live instances of `role` that take new requests now ([] when none)."""
        try:
            return self._open(role)
        except NoInstanceAvailable:
            return []

    def mark_dead(self, instance_id: str) -> list[str]:
        """Takes an instance out of rotation; returns the requests it held."""
        load = self.instances[instance_id]
        load.alive = False
        lost = list(load.requests)
        load.requests.clear()
        load.outstanding_tokens = 0
        return lost

    def pick(self, request: RoutableRequest) -> RoutePlan:
        """Colocated instances when any is open, else a prefill + decode pair."""
        try:
            colocated = self._open("colocated")
        except NoInstanceAvailable:
            live_roles = {x.role for x in self.instances.values() if x.alive and not x.draining}
            if not live_roles & {"prefill", "decode"}:
                raise
            missing = {"prefill", "decode"} - live_roles
            if missing:
                raise NoInstanceAvailable(f"no {missing.pop()} engine instance is alive (a prefill and a "
                                          f"decode instance are both needed)", retry_after_s=5, status=503) from None
        else:
            return RoutePlan(self._prefill_target(colocated, request.prefix_key).instance_id)
        prefill = self._prefill_target(self._open("prefill"), request.prefix_key)
        decode = min(self._open("decode"), key=lambda x: (x.outstanding_tokens, -x.num_free_blocks,
                                                           x.num_requests))
        return RoutePlan(decode.instance_id, prefill.instance_id)

    def _prefill_target(self, open_: list[InstanceLoad], key: int | None) -> InstanceLoad:
        """Least outstanding tokens, or the prefix's previous instance when affinity says so."""
        best = min(open_, key=lambda x: (x.outstanding_tokens, x.num_requests))
        if not self.prefix_affinity or key is None:
            return best
        previous = next((x for x in open_ if x.instance_id == self.affinity.get(key)), None)
        if previous is not None and previous.outstanding_tokens <= best.outstanding_tokens + AFFINITY_SLACK_TOKENS:
            best = previous
        self.affinity.pop(key, None)
        self.affinity[key] = best.instance_id
        if len(self.affinity) > MAX_AFFINITY_ENTRIES:
            self.affinity.pop(next(iter(self.affinity)))
        return best

    def on_start(self, plan: RoutePlan, request: RoutableRequest) -> None:
        if plan.prefill_instance_id is None:
            self._add(plan.instance_id, request.request_id, request.num_prompt_tokens + request.max_tokens)
        else:
            self._add(plan.prefill_instance_id, request.request_id, request.num_prompt_tokens)
            self._add(plan.instance_id, request.request_id, request.max_tokens)

    def _add(self, instance_id: str, request_id: str, tokens: int) -> None:
        load = self.instances[instance_id]
        load.requests[request_id] = tokens
        load.outstanding_tokens += tokens

    def on_progress(self, instance_id: str, request_id: str, num_prompt_done: int, num_new_tokens: int) -> None:
        load = self.instances.get(instance_id)
        if load is None or request_id not in load.requests:
            return
        done = min(load.requests[request_id], num_prompt_done + num_new_tokens)
        load.requests[request_id] -= done
        load.outstanding_tokens -= done

    def on_finish(self, instance_id: str, request_id: str) -> None:
        load = self.instances.get(instance_id)
        if load is not None:
            load.outstanding_tokens -= load.requests.pop(request_id, 0)
