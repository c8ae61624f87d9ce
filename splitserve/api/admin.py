"""Changing the set of engine instances while the server runs.

    GET    /admin/instances        every instance: role, alive, draining, router load; and the
                                   address engines connect to
    POST   /admin/instances        {"role": "prefill"|"decode"|"colocated"} starts one more local
                                   engine (202; it takes traffic once its model is loaded)
    DELETE /admin/instances/{id}   drains one: no new requests; once its requests (and, for a
                                   prefill instance, the KV it still holds) are gone it is told
                                   to shut down
    POST   /admin/instances/{id}/restart  [{"drain_deadline_s": 60}]: a replacement with the same
                                   role and settings starts, then this one drains and stops
                                   (rolling_restart.py); 200 once it is replaced
    POST   /admin/coordinator/restart  this process (`serve`) re-executes itself and its engines
                                   rejoin the new one with their model loaded; the requests in
                                   flight end with an error (counted in the 202's failed_requests)
                                   (entrypoints/coordinator_restart.py)
    POST   /admin/instances/{id}/role  {"role": ...}: live role change (role_change.py); 200 once
                                   it serves in the new role, 409 with the reason when refused
                                   (e.g. it would leave no instance able to decode)
    GET    /admin/mix              the adaptive mix controller's decisions and why (coordinator/adaptive.py)
    GET    /admin/steps[?tail=N]   every instance's measured model steps (its last request_state.STEP_LOG):
                                   shape, seconds, the engine loop's turn; `count` numbers them, so a
                                   reader that noted it before a run keeps what came after (a trial
                                   puts each run's beside the profile: control/compare.py)

An engine on another host joins without any call: `splitserve engine --role decode --connect
<engine_address> ...` says hello and the router starts using it. Instances that die or go
silent are taken out by the engine client's watchdog. Who may call these routes (the admin
key, Host checking) and how many engines POST may start (--max-instances, free memory) is
decided in front of them: see http_guard.py and instance_budget.py.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from splitserve.config import ROLES
from splitserve.api.engine_client import EngineClient
from splitserve.api.openai_schema import ApiError
from splitserve.coordinator.adaptive import AdaptiveMix
from splitserve.coordinator.role_change import RoleChangeRefused
from splitserve.coordinator.rolling_restart import RestartRefused, RollingRestart
from splitserve.protocol import STEP_SAMPLE_FIELDS

SpawnEngine = Callable[[str, str | None], str]  # (role, an id or None: one is made up) -> the new engine's id


class AddInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str


class ChangeRole(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str


class RestartInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    drain_deadline_s: float = Field(60.0, gt=0, le=3600)


def add_admin_routes(app: FastAPI, client: EngineClient, spawn: SpawnEngine | None,
                     coordinator_restart=None, restart_engines=None) -> None:
    restarts = RollingRestart(client, spawn, engines=restart_engines) if spawn is not None else None
    if coordinator_restart is not None and restarts is not None:
        coordinator_restart.busy = lambda: ("a rolling restart is under way; restart the coordinator once it "
                                            "is done" if restarts.busy else None)

    @app.post("/admin/coordinator/restart", status_code=202)
    async def restart_coordinator():
        if coordinator_restart is None:
            raise ApiError(400, "this server cannot restart its coordinator in place")
        try:
            return coordinator_restart.request()
        except RestartRefused as e:
            raise ApiError(e.status, str(e)) from None

    @app.get("/admin/instances")
    async def list_instances():
        rows = []
        for engine_id, inst in client.instances.items():
            load = client.router.instances.get(engine_id)
            rows.append({"id": engine_id, "role": inst.hello.role, "alive": inst.alive, "pid": inst.hello.pid,
                         "draining": bool(load and load.draining),
                         "changing_role": bool(load and load.changing_role),
                         "num_requests": load.num_requests if load else 0,
                         "outstanding_tokens": load.outstanding_tokens if load else 0})
        return {"engine_address": client.address, "instances": rows}

    @app.get("/admin/steps")
    async def list_steps(tail: int | None = None):
        if tail is not None and tail < 0:
            raise ApiError(400, f"tail must be >= 0, got {tail}", param="tail")
        rows = []
        for engine_id, inst in client.instances.items():
            skip = 0 if tail is None else max(0, len(inst.step_log) - tail)
            log = list(itertools.islice(inst.step_log, skip, None))
            rows.append({"id": engine_id, "role": inst.hello.role, "alive": inst.alive,
                         "count": inst.num_step_samples, "first": inst.num_step_samples - len(log),
                         # in STEP_SAMPLE_FIELDS' order
                         "samples": [[s.prefill_tokens, round(s.prefill_attn_ktok2, 4), s.decode_seqs, s.decode_kv_tokens,
                                      round(s.seconds, 6), round(s.loop_seconds, 6), round(s.cpu_seconds, 6)]
                                     for s in log]})
        return {"fields": list(STEP_SAMPLE_FIELDS), "instances": rows}

    @app.post("/admin/instances", status_code=202)
    async def add_instance(body: AddInstance):
        if body.role not in ROLES:
            raise ApiError(400, f"role must be one of {', '.join(ROLES)}, got {body.role!r}", param="role")
        if spawn is None:
            raise ApiError(400, "this server cannot start engines itself; start one with `splitserve engine "
                                f"--role {body.role} --connect {client.address}`", param="role")
        engine_id = spawn(body.role)
        return {"id": engine_id, "role": body.role, "status": "starting", "engine_address": client.address}

    @app.delete("/admin/instances/{engine_id}", status_code=202)
    async def drain_instance(engine_id: str):
        inst = client.instances.get(engine_id)
        if inst is None:
            raise ApiError(404, f"no engine instance {engine_id!r}; see GET /admin/instances",
                           "not_found_error", param="engine_id")
        if not inst.alive:
            raise ApiError(409, f"engine instance {engine_id!r} is not alive", param="engine_id")
        client.drain(engine_id)
        return {"id": engine_id, "status": "draining"}

    @app.post("/admin/instances/{engine_id}/restart")
    async def restart_instance(engine_id: str, body: RestartInstance | None = None):
        if restarts is None:
            raise ApiError(400, "this server cannot start engines itself, so it cannot restart one",
                           param="engine_id")
        try:
            return await restarts.restart(engine_id, (body or RestartInstance()).drain_deadline_s)
        except RestartRefused as e:
            raise ApiError(e.status, str(e), "not_found_error" if e.status == 404 else "invalid_request_error",
                           param="engine_id") from None

    @app.post("/admin/instances/{engine_id}/role")
    async def change_role(engine_id: str, body: ChangeRole):
        try:
            await client.change_role(engine_id, body.role)
        except RoleChangeRefused as e:
            raise ApiError(e.status, str(e), "not_found_error" if e.status == 404 else "invalid_request_error",
                           param="role" if e.status == 400 else "engine_id") from None
        return {"id": engine_id, "role": body.role, "status": "serving"}


def add_mix_routes(app: FastAPI, mix: AdaptiveMix | None) -> None:
    @app.get("/admin/mix")
    async def mix_log():
        if mix is None:
            raise ApiError(404, "this server does not adapt its stage mix; start it with `splitserve serve "
                                "--adaptive`", "not_found_error", code="not_adaptive")
        return mix.snapshot()
