"""Live role changes, a survivor taking over a lost stage, and the per-instance load view.

    change_role(id, role):  refuse (RoleChangeRefused, 409) if no instance could then prefill or
        none could decode -> the router stops sending the instance new work -> a decode instance
        first takes the streams already planned onto it and prefilling elsewhere (recomputing them
        after the change stalled them for seconds); those not begun there are dropped by their
        prefill instance (ReleaseUnstarted) and placed again after the change -> SetRole -> the
        engine swaps its connector once the old one holds nothing in flight (prompts handed over,
        leases confirmed, pulls landed; running decodes just carry on) -> RoleChanged -> the
        router sends it work of its new kind, and requests parked meanwhile are dispatched.

A colocated instance counts as both stages. When an instance dies and leaves a stage with no
instance (`on_dead`), a survivor takes the missing role at once (colocated when it is the only
one left), so the requests of the dead instance, parked while it swaps, go on within ~1 s.

`load_view()` is the read-only picture a mix controller decides on (control/, not here).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from splitserve.coordinator.engine_link import EngineLink
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.router import Router
from splitserve.protocol import RoleChanged, SetRole, StepSample
from splitserve.roles import DECODE_CAPABLE, PREFILL_CAPABLE, ROLES, take_over_survivor

log = logging.getLogger(__name__)

ROLE_CHANGE_TIMEOUT_S = 60.0  # a drain waits for leases (30 s by default) at worst
HANDOVER_POLL_S = 0.01


class RoleChangeRefused(Exception):
    """The change cannot be made; `status` is the HTTP answer (404 unknown instance, 409 otherwise)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class InstanceLoadView:
    instance_id: str
    role: str
    alive: bool
    changing_role: bool
    num_requests: int  # the router's: admitted and not finished
    outstanding_tokens: int  # the router's: prompt + answer tokens still to do
    num_queued_prompt_tokens: int  # the engine's last report, as the rest below
    num_running_requests: int
    num_kv_tokens_used: int
    step_seconds: float  # moving average of recent model steps
    step_tokens: float
    step_samples: tuple[StepSample, ...] = ()  # its last measured steps (request_state.STEP_WINDOW)
    num_step_samples: int = 0  # step samples received since it joined


def check_coverage(roles: dict[str, str]) -> str | None:
    """Why a set of serving roles leaves a stage with no instance, or None."""
    if not any(r in PREFILL_CAPABLE for r in roles.values()):
        return "no instance would be left able to prefill (a prefill or colocated instance is needed)"
    if not any(r in DECODE_CAPABLE for r in roles.values()):
        return "no instance would be left able to decode (a decode or colocated instance is needed)"
    return None


class RoleChanger:
    """Owned by the dispatcher, which tells it of role answers and deaths; `settled` is called
    after each change ends (done or refused), so requests parked meanwhile go out."""

    def __init__(self, link: EngineLink, router: Router, metrics: FrontendMetrics, settled: Callable[[], None],
                 timeout_s: float = ROLE_CHANGE_TIMEOUT_S,
                 num_inbound: Callable[[str], int] = lambda instance_id: 0,
                 release_inbound: Callable[[str], None] = lambda instance_id: None) -> None:
        """num_inbound(id): requests planned to be handed over to decode instance `id`, still
        prefilling elsewhere; release_inbound(id): asks their prefill instances to drop those not
        begun (placed again once the change settles), so the change waits only for the rest."""
        self.link, self.router, self.metrics, self.settled = link, router, metrics, settled
        self.num_inbound, self.release_inbound = num_inbound, release_inbound
        self.timeout_s = timeout_s
        self._pending: dict[str, asyncio.Future] = {}
        self._takeovers: set[asyncio.Task] = set()

    def changing(self) -> bool:
        return bool(self._pending)

    async def change_role(self, instance_id: str, role: str) -> None:
        """Returns once the instance serves in `role`; RoleChangeRefused says why it cannot."""
        future = self._begin(instance_id, role)
        if future is None:
            return
        await self._finish(instance_id, role, future)

    def _begin(self, instance_id: str, role: str) -> asyncio.Future | None:
        if role not in ROLES:
            raise RoleChangeRefused(f"role must be one of {', '.join(ROLES)}, got {role!r}", status=400)
        inst = self.link.instances.get(instance_id)
        if inst is None:
            raise RoleChangeRefused(f"no engine instance {instance_id!r}; see GET /admin/instances", status=404)
        serving = self.router.serving()
        if not inst.alive or instance_id not in serving:
            raise RoleChangeRefused(f"engine instance {instance_id!r} is not serving (dead or draining)")
        if instance_id in self._pending:
            raise RoleChangeRefused(f"engine instance {instance_id!r} is already changing its role")
        if serving[instance_id] == role:
            return None
        why = check_coverage({**serving, instance_id: role})
        if why is not None:
            raise RoleChangeRefused(f"turning {instance_id} ({serving[instance_id]}) into {role} is refused: {why}")
        self.router.set_changing_role(instance_id, True)
        future = asyncio.get_running_loop().create_future()
        self._pending[instance_id] = future
        if serving[instance_id] != "decode" or not self.num_inbound(instance_id):
            self.link.send(instance_id, SetRole(role))
        else:
            self.release_inbound(instance_id)
            asyncio.get_running_loop().create_task(self._after_handovers(instance_id, role, future))
        log.warning("engine %s: changing role %s -> %s", instance_id, serving[instance_id], role)
        return future

    async def _after_handovers(self, instance_id: str, role: str, future: asyncio.Future) -> None:
        """SetRole once no stream is on its way here (the router plans none onto us meanwhile)."""
        while not future.done() and self.num_inbound(instance_id):
            await asyncio.sleep(HANDOVER_POLL_S)
        if not future.done():
            self.link.send(instance_id, SetRole(role))

    async def _finish(self, instance_id: str, role: str, future: asyncio.Future) -> None:
        old = self.router.instances[instance_id].role
        try:
            answer: RoleChanged = await asyncio.wait_for(future, self.timeout_s)
            if answer.error:
                raise RoleChangeRefused(f"engine instance {instance_id!r} cannot become {role}: {answer.error}")
        except asyncio.TimeoutError:
            raise RoleChangeRefused(f"engine instance {instance_id!r} did not finish its change to {role} "
                                    f"within {self.timeout_s:g} s; it keeps serving as {old}") from None
        else:
            inst = self.link.instances[instance_id]
            inst.hello = msgspec.structs.replace(inst.hello, role=answer.role)
            self.router.set_role(instance_id, answer.role)
            self.metrics.role_changes.labels(old, answer.role).inc()
            self.metrics.set_role(instance_id, old, answer.role)
            log.warning("engine %s now serves as %s", instance_id, answer.role)
        finally:
            self._pending.pop(instance_id, None)
            if instance_id in self.router.instances:
                self.router.set_changing_role(instance_id, False)
            self.settled()

    def on_role_changed(self, engine_id: str, message: RoleChanged) -> None:
        future = self._pending.get(engine_id)
        if future is not None and not future.done():
            future.set_result(message)

    def on_dead(self, engine_id: str) -> None:
        future = self._pending.get(engine_id)
        if future is not None and not future.done():
            future.set_exception(RoleChangeRefused(f"engine instance {engine_id!r} died while changing its role"))
        serving = {i: r for i, r in self.router.serving().items() if i not in self._pending}
        if not serving or check_coverage(serving) is None:
            return
        # A stage has no instance left: a survivor takes it over (the rule the mix controller uses too).
        missing = "prefill" if not any(r in PREFILL_CAPABLE for r in serving.values()) else "decode"
        loads = self.router.instances
        survivor = take_over_survivor({i: (r, loads[i].outstanding_tokens) for i, r in serving.items()})
        role = "colocated" if len(serving) == 1 else missing
        try:
            future = self._begin(survivor, role)
        except RoleChangeRefused as e:
            log.error("no survivor can take over the %s stage: %s", missing, e)
            return
        if future is None:
            return
        log.warning("the last %s instance died: %s takes over as %s", missing, survivor, role)
        task = asyncio.get_running_loop().create_task(self._take_over(survivor, role, future))
        self._takeovers.add(task)
        task.add_done_callback(self._takeovers.discard)

    async def _take_over(self, instance_id: str, role: str, future: asyncio.Future) -> None:
        try:
            await self._finish(instance_id, role, future)
        except RoleChangeRefused as e:
            log.error("take-over by %s failed: %s", instance_id, e)

    def load_view(self) -> list[InstanceLoadView]:
        views = []
        for instance_id, load in self.router.instances.items():
            inst = self.link.instances.get(instance_id)
            s = inst.stats if inst is not None else None
            views.append(InstanceLoadView(
                instance_id, load.role, load.alive, load.changing_role, load.num_requests, load.outstanding_tokens,
                s.num_queued_prompt_tokens if s else 0, s.num_running if s else 0,
                s.num_blocks_used * s.block_size if s else 0, s.step_seconds if s else 0.0,
                s.step_tokens if s else 0.0,
                tuple(inst.step_samples) if inst is not None else (), inst.num_step_samples if inst is not None else 0))
        return views
