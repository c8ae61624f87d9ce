"""Scheduled stage failures during a replay, and what they cost.

A fault (spec `faults:`) SIGKILLs one engine process of the arrangement under test at a fixed
second of the replay (scaled with the rate in a sweep, like the arrivals), found through the
server's `GET /admin/instances` (role and pid). With `restart_after_s` it then asks the server
for a replacement of the same role (`POST /admin/instances`), as an operator restarting the
node would. The injector only records when things happened; `fault_outcomes` judges them
against the request records:

- lost in flight: requests sent before the kill that ended in failure after it;
- failed after: requests sent at or after the kill that failed (no instance for their stage,
  a retry that found none, ...);
- time to recover: from the kill until the first request sent after the last such failure
  (0 if none failed: the router routed around the dead instance or retried in time); None if
  requests still failed at the end of the run.
A colocated arrangement has no separate stages: `kill: prefill` or `decode` hits its
colocated instance there, which does both.

A rolling update (`restart: all`) kills nothing: at its second the injector lists the serving
instances and asks the server to restart each in turn (POST /admin/instances/{id}/restart, one
answered before the next is asked: what `splitserve admin restart --all` does), stopping at the
first refusal. Its window runs from the first request to the server until the last answer;
lost in flight, failed after and time to recover are counted from its start as for a kill, and
beside them the requests whose time in the system overlapped the window that missed the SLO
(failed or late), with the same count for the rest of the run to compare with.

A coordinator restart (`restart: coordinator`) asks `serve` to restart itself in place (POST
/admin/coordinator/restart: the requests in flight end with an error, the engines keep running;
entrypoints/coordinator_restart.py) and polls /health until the server serves again with every
engine it kept, under the same pid. Its window runs from the request until then (the time until
the arrangement served again); the server's own count of the requests it ended is kept beside
the trial's lost in flight, and the same window counts apply.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Callable

import httpx

from splitserve.trial.metrics import RequestRecord, is_good, request_metrics, slo_of
from splitserve.trial.spec import SLO, FaultSpec

ADMIN_POLL_S = 0.05
OUT_OF_ROTATION_TIMEOUT_S = 30.0   # a server that never notices a dead engine must not hang the trial
REJOIN_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 900.0  # one instance: its replacement loads (300 s at most), then the old one drains


def pick_victim(instances: list[dict], kill: str) -> dict | None:
    """The first alive instance serving the stage: its own role first, else a colocated one."""
    alive = [i for i in instances if i.get("alive")]
    if kill == "any":
        return alive[0] if alive else None
    for role in (kill, "colocated"):
        for inst in alive:
            if inst.get("role") == role:
                return inst
    return None


async def inject_fault(base_url: str, fault: FaultSpec, t0: float, multiplier: float = 1.0,
                       clock: Callable[[], float] = time.perf_counter) -> dict:
    """Wait until the fault's second, kill, watch the instance leave, optionally restart one.
    Returns the event timeline in seconds after t0 (the replay's zero). `restart:` faults go
    to inject_restart."""
    if fault.restart == "coordinator":
        return await inject_coordinator_restart(base_url, fault, t0, multiplier, clock)
    if fault.restart is not None:
        return await inject_restart(base_url, fault, t0, multiplier, clock)
    event: dict = {"at_s": fault.at_s / multiplier, "kill": fault.kill, "instance": None, "pid": None,
                   "killed_s": None, "out_of_rotation_s": None, "restart_requested_s": None,
                   "replacement": None, "rejoined_s": None, "error": None}
    await asyncio.sleep(max(0.0, t0 + event["at_s"] - clock()))
    async with httpx.AsyncClient(timeout=10.0) as http:
        try:
            victim = pick_victim((await _instances(http, base_url))["instances"], fault.kill)
            if victim is None:
                event["error"] = f"no alive instance serves {fault.kill!r}"
                return event
            event["instance"], event["pid"] = victim["id"], victim["pid"]
            os.kill(int(victim["pid"]), signal.SIGKILL)
            event["killed_s"] = clock() - t0
            deadline = clock() + OUT_OF_ROTATION_TIMEOUT_S
            while not await _is_out(http, base_url, victim["id"]):
                if clock() >= deadline:
                    event["error"] = (f"the server still listed {victim['id']} as alive "
                                      f"{OUT_OF_ROTATION_TIMEOUT_S:.0f} s after it was killed")
                    return event
                await asyncio.sleep(ADMIN_POLL_S)
            event["out_of_rotation_s"] = clock() - t0
            if fault.restart_after_s is None:
                return event
            await asyncio.sleep(max(0.0, t0 + event["killed_s"] + fault.restart_after_s / multiplier - clock()))
            event["restart_requested_s"] = clock() - t0
            resp = await http.post(f"{base_url}/admin/instances", json={"role": victim["role"]})
            if resp.status_code != 202:
                event["error"] = f"restart refused: HTTP {resp.status_code}: {resp.text[:200]}"
                return event
            event["replacement"] = resp.json()["id"]
            deadline = clock() + REJOIN_TIMEOUT_S
            while clock() < deadline:
                rows = {i["id"]: i for i in (await _instances(http, base_url))["instances"]}
                if rows.get(event["replacement"], {}).get("alive"):
                    event["rejoined_s"] = clock() - t0
                    break
                await asyncio.sleep(ADMIN_POLL_S * 4)
            else:
                event["error"] = f"the replacement did not join within {REJOIN_TIMEOUT_S:.0f} s"
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            event["error"] = f"{type(exc).__name__}: {exc}"
    return event


async def inject_restart(base_url: str, fault: FaultSpec, t0: float, multiplier: float = 1.0,
                         clock: Callable[[], float] = time.perf_counter) -> dict:
    """Wait until the fault's second, then restart every serving instance, one at a time."""
    event: dict = {"at_s": fault.at_s / multiplier, "restart": fault.restart, "instances": [],
                   "began_s": None, "ended_s": None, "error": None}
    await asyncio.sleep(max(0.0, t0 + event["at_s"] - clock()))
    async with httpx.AsyncClient(timeout=RESTART_TIMEOUT_S) as http:
        try:
            rows = (await _instances(http, base_url))["instances"]
            ids = [i["id"] for i in rows if i.get("alive") and not i.get("draining")]
            if not ids:
                event["error"] = "no instance serves"
                return event
            event["began_s"] = clock() - t0
            for engine_id in ids:
                asked = clock() - t0
                resp = await http.post(f"{base_url}/admin/instances/{engine_id}/restart",
                                       json={"drain_deadline_s": fault.drain_deadline_s})
                if resp.status_code != 200:
                    event["error"] = f"restart of {engine_id} refused: HTTP {resp.status_code}: {resp.text[:200]}"
                    break
                event["instances"].append({**resp.json(), "requested_s": asked, "answered_s": clock() - t0})
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            event["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if event["began_s"] is not None:
                event["ended_s"] = clock() - t0
    return event


async def inject_coordinator_restart(base_url: str, fault: FaultSpec, t0: float, multiplier: float = 1.0,
                                     clock: Callable[[], float] = time.perf_counter) -> dict:
    """Wait until the fault's second, restart `serve` in place, wait until it serves again."""
    event: dict = {"at_s": fault.at_s / multiplier, "restart": fault.restart, "instances": [],
                   "began_s": None, "ended_s": None, "failed_requests": None, "error": None}
    await asyncio.sleep(max(0.0, t0 + event["at_s"] - clock()))
    async with httpx.AsyncClient(timeout=30.0) as http:
        try:
            asked = clock() - t0
            resp = await http.post(f"{base_url}/admin/coordinator/restart")
            if resp.status_code != 202:
                event["error"] = f"coordinator restart refused: HTTP {resp.status_code}: {resp.text[:200]}"
                return event
            event["began_s"] = asked
            done = resp.json()
            event["failed_requests"] = done["failed_requests"]
            kept = {e["id"]: e for e in done["engines"]}
            deadline = clock() + REJOIN_TIMEOUT_S
            while True:
                alive = await _alive_pids(http, base_url, done.get("restart", 0))
                if alive is not None and all(alive.get(i) == e["pid"] for i, e in kept.items()):
                    break
                if clock() >= deadline:
                    event["error"] = f"not serving again with the same engines {REJOIN_TIMEOUT_S:.0f} s after the restart"
                    break
                await asyncio.sleep(ADMIN_POLL_S * 2)
            alive = alive or {}
            event["instances"] = [{**e, "kept": alive.get(i) == e["pid"], "resumed_requests": 0}
                                  for i, e in kept.items()]
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            event["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if event["began_s"] is not None:
                event["ended_s"] = clock() - t0
    return event


async def _alive_pids(http: httpx.AsyncClient, base_url: str, restart: int) -> dict[str, int] | None:
    """{id: pid} of the alive instances once the new process (the one that counts `restart`
    coordinator restarts: not the old one, still stopping) answers /health with 200, else None."""
    try:
        counted = 0
        for line in (await http.get(f"{base_url}/metrics", timeout=5.0)).text.splitlines():
            if line.startswith("splitserve_coordinator_restarts_total "):
                counted = int(float(line.split()[1]))
        if counted < restart:
            return None
        resp = await http.get(f"{base_url}/health", timeout=5.0)
    except (httpx.HTTPError, ValueError):
        return None
    if resp.status_code != 200:
        return None
    return {i["id"]: i["pid"] for i in resp.json()["instances"] if i["alive"]}


def fault_start(event: dict) -> float | None:
    """When a fault hit: the kill, or a rolling restart's first request to the server."""
    return event.get("began_s") if event.get("restart") else event.get("killed_s")


async def _instances(http: httpx.AsyncClient, base_url: str) -> dict:
    resp = await http.get(f"{base_url}/admin/instances")
    resp.raise_for_status()
    return resp.json()


async def _is_out(http: httpx.AsyncClient, base_url: str, instance_id: str) -> bool:
    rows = {i["id"]: i for i in (await _instances(http, base_url))["instances"]}
    return not rows.get(instance_id, {}).get("alive", False)


def fault_outcomes(events: list[dict], records: list[RequestRecord], slo: SLO,
                   pause_threshold_s: float, class_slos: dict[str, SLO] | None = None) -> list[dict]:
    """Per fault: requests lost and time to recover (see the module docstring). A fault's
    window runs from its kill (or a restart's start) to the next fault's."""
    per = {r.index: request_metrics(r, slo_of(r, slo, class_slos), pause_threshold_s) for r in records}
    failed = {i: m.failure is not None for i, m in per.items()}
    good = {r.index: is_good(per[r.index], slo_of(r, slo, class_slos)) for r in records}
    kills = [fault_start(e) for e in events]
    sent = sorted((r for r in records if r.sent_s is not None), key=lambda r: r.sent_s)
    out = []
    for n, event in enumerate(events):
        start = kills[n]
        row = {**event, "lost_in_flight": 0, "failed_after": 0, "recovery_s": None}
        if start is None:
            out.append(row)
            continue
        if event.get("restart"):
            row.update(update_window(event, sent, good))
        end = next((k for k in kills[n + 1:] if k is not None), float("inf"))
        row["lost_in_flight"] = sum(1 for r in sent if r.sent_s < start and failed[r.index]
                                    and (r.finished_s is None or r.finished_s >= start))
        after = [r for r in sent if start <= r.sent_s < end]
        bad = [r for r in after if failed[r.index]]
        row["failed_after"] = len(bad)
        if not bad:
            row["recovery_s"] = 0.0
        else:
            later = [r for r in after if r.sent_s > bad[-1].sent_s]
            row["recovery_s"] = later[0].sent_s - start if later else None
        out.append(row)
    return out


def update_window(event: dict, sent: list[RequestRecord], good: dict[int, bool]) -> dict:
    """A rolling restart's length, and the SLO misses among the requests in the system during it
    (sent before it ended, not finished before it began) beside those of the rest of the run."""
    began, ended = event["began_s"], event["ended_s"]
    during = [r for r in sent if r.sent_s < ended and (r.finished_s is None or r.finished_s > began)]
    inside = {r.index for r in during}
    outside = [r for r in sent if r.index not in inside]
    return {"seconds": ended - began, "num_restarted": len(event["instances"]),
            "resumed_requests": sum(i.get("resumed_requests", 0) for i in event["instances"]),
            "requests_during": len(during), "slo_missed_during": sum(not good[r.index] for r in during),
            "requests_outside": len(outside), "slo_missed_outside": sum(not good[r.index] for r in outside)}
