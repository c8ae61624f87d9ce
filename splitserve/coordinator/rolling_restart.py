"""Rolling restart: engine instances replaced one at a time, without failing a request.

    restart(id): start a replacement with the same role and settings under a new id (<id>.rN)
                 -> wait for its hello (from then on the router sends it work)
                 -> drain the old one: no new requests; its running ones finish, and a prefill
                    instance's held KV is pulled, then it is told to stop (dispatcher.on_tick)
                 -> past the drain deadline, what it still runs is resumed elsewhere, as a dead
                    instance's requests are (link.remove)
                 -> wait for its process to exit (under Ray: for its actor's engine to exit, then
                    the actor is ended for good, so Ray neither restarts it nor keeps its share)
    `splitserve admin restart --all` calls it for each instance in turn.

The replacement starts before the old one drains, so no stage is left without an instance, even
with one instance per stage (1P1D), for the price of one more engine's memory during a restart.
If the replacement does not come up, the old instance is left serving. One restart runs at a
time. Only engines this process started, as its children or as its Ray actors, can be restarted
(their settings are its own); one started by hand is refused with the reason.
"""
from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SpawnEngine = Callable[[str, str | None], str]  # (role, engine id or None) -> the new engine's id
GENERATION = re.compile(r"(?P<base>.+?)(?:\.r(?P<n>\d+))?")
EXIT_WAIT_S = 30.0


class RestartRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def replacement_id(engine_id: str, taken) -> str:
    """prefill-0 -> prefill-0.r1 -> prefill-0.r2: the lineage stays readable."""
    match = GENERATION.fullmatch(engine_id)
    base, n = match["base"], int(match["n"] or 0)
    while f"{base}.r{n + 1}" in taken:
        n += 1
    return f"{base}.r{n + 1}"


def wait_exit(process: subprocess.Popen, timeout_s: float = EXIT_WAIT_S) -> int:
    """It was told to stop; one that does not is terminated, then killed."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            return process.wait(timeout=timeout_s if stop is None else 10)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


class LocalEngines:
    """How a restart ends an old engine this process started as its child."""

    @staticmethod
    def owns(engine_id: str, inst) -> bool:
        return inst.process is not None

    @staticmethod
    def stop_engine(engine_id: str, inst) -> int | None:
        return wait_exit(inst.process)


class RollingRestart:
    def __init__(self, client, spawn: SpawnEngine, ready_timeout_s: float = 300.0, engines=None) -> None:
        """engines: owns(id, inst) and stop_engine(id, inst) for where the engines run (LocalEngines,
        or cluster/ray_placement.RayPlacement under `serve --ray`)."""
        self.client, self.spawn, self.ready_timeout_s = client, spawn, ready_timeout_s
        self.engines = engines or LocalEngines()
        self._one_at_a_time = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._one_at_a_time.locked()

    def _check(self, engine_id: str):
        inst = self.client.instances.get(engine_id)
        if inst is None:
            raise RestartRefused(404, f"no engine instance {engine_id!r}; see GET /admin/instances")
        load = self.client.router.instances.get(engine_id)
        if not inst.alive or load is None or load.draining or load.changing_role:
            raise RestartRefused(409, f"engine instance {engine_id!r} is not serving (dead, draining or "
                                      "changing its role)")
        if not self.engines.owns(engine_id, inst):
            raise RestartRefused(409, f"engine instance {engine_id!r} was started by hand: "
                                      "this server does not know its settings; restart it where it runs "
                                      "(it rejoins under its id)")
        return inst, load

    async def restart(self, engine_id: str, drain_deadline_s: float = 60.0) -> dict:
        async with self._one_at_a_time:
            inst, load = self._check(engine_id)
            role, started = inst.hello.role, time.monotonic()
            new_id = self.spawn(role, replacement_id(engine_id, self.client.instances))
            try:
                await self.client.wait_ready([new_id], self.ready_timeout_s)
            except (RuntimeError, TimeoutError) as e:
                raise RestartRefused(503, f"the replacement {new_id} did not start ({e}); {engine_id} "
                                          "goes on serving") from None
            ready_s = time.monotonic() - started
            log.warning("restart: %s is ready (%s); draining %s", new_id, role, engine_id)
            self.client.drain(engine_id)
            deadline = time.monotonic() + drain_deadline_s
            while not inst.removed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            resumed = 0
            if not inst.removed:
                resumed = load.num_requests
                self.client.link.remove(engine_id, f"restart: still busy {drain_deadline_s:g} s into its "
                                                   "drain; what it runs resumes elsewhere")
            code = await asyncio.to_thread(self.engines.stop_engine, engine_id, inst)
            seconds = time.monotonic() - started
            log.warning("restart: %s replaced by %s in %.1f s (exit code %s)", engine_id, new_id, seconds, code)
            return {"id": engine_id, "replacement": new_id, "role": role, "ready_s": round(ready_s, 2),
                    "seconds": round(seconds, 2), "resumed_requests": resumed, "exit_code": code}
