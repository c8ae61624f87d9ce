"""Each run's model steps as the engines measured them, read from the server's GET /admin/steps.

Before a replay the trial notes how many steps every instance has reported; after it, it keeps
the ones that came since: per instance, its role and one row per step, [prefill_tokens,
prefill_attn_ktok2, decode_seqs, decode_kv_tokens, seconds, loop_seconds] (protocol.STEP_SAMPLE_FIELDS).
`python -m splitserve.control.compare` puts them beside what the profile says the same steps
take, which tells a step-time error (the machine, the engine loop) from a scheduling one.

Steps reach the server with the engines' stats (at most 0.25 s later), so the reader waits that
long before it counts (the warm-up's last steps must not land in the run) and after the run before
it reads; a server that does not answer (an older one, another server, a refused admin route) gives
None and the run simply has no steps.

`run_speeds` reads the same steps as a speed: each run's steps against one step model per role
fitted on every step of the arrangement's runs, so a run whose engines stepped slower than the
same steps did elsewhere in the trial shows it, whatever its batch. The host watch (a loop
benchmark before the run, /proc during it) does not see this: on a VM whose speed moved minute to
minute, the loop read before each of 59 runs did not follow the runs' own step speed (correlation
-0.05, docs/benchmarks.md "Planner", session 34); the engines' own steps are the reading.
"""
from __future__ import annotations

import statistics
import time

import httpx

from splitserve.control.stepmodel import StepShape, fit_step_model

SETTLE_S = 0.35  # engine/process.py STATS_INTERVAL_S and a margin: the run's last steps arrive
MIN_RUN_STEPS = 20  # a run with fewer timed steps gets no speed (one slow step would be its reading)
_SHAPE = ("prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds")


def _fetch(base_url: str, tail: int | None, timeout_s: float) -> dict | None:
    try:
        resp = httpx.get(f"{base_url}/admin/steps", params={} if tail is None else {"tail": tail}, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return resp.json()


def step_counts(base_url: str, timeout_s: float = 5.0) -> dict[str, int] | None:
    """Steps reported so far, per instance id, once the steps of what ran before (a warm-up, the
    previous run) have arrived."""
    doc = _fetch(base_url, 0, timeout_s)
    if doc is None:
        return None
    time.sleep(SETTLE_S)
    doc = _fetch(base_url, 0, timeout_s)
    return None if doc is None else {row["id"]: int(row["count"]) for row in doc.get("instances", [])}


def steps_since(base_url: str, before: dict[str, int] | None, timeout_s: float = 10.0) -> dict | None:
    """Per instance, the steps reported after `before` (step_counts' answer; an instance that joined
    since counts from 0). Steps that fell out of the server's log are gone: `missing` counts them."""
    if before is None:
        return None
    time.sleep(SETTLE_S)
    counts = _fetch(base_url, 0, timeout_s)  # ask for the new steps only, not the whole log
    if counts is None:
        return None
    tail = max((row["count"] - before.get(row["id"], 0) for row in counts.get("instances", [])), default=0)
    doc = _fetch(base_url, max(tail, 0), timeout_s)
    if doc is None:
        return None
    out = {}
    for row in doc.get("instances", []):
        start = before.get(row["id"], 0)
        samples = row["samples"][max(0, start - row["first"]):]
        if samples or row["count"] > start:
            out[row["id"]] = {"role": row["role"], "samples": samples,
                              "missing": max(0, row["first"] - start)}
    return {"fields": doc.get("fields"), "instances": out}


def decode_step_median(steps: dict | None) -> float | None:
    """The median time of a run's decode-only steps (no prompt tokens in them), over all instances:
    the engine's speed on the same kind of work from run to run. None when the run has no steps."""
    if not steps or not steps.get("fields"):
        return None
    fields = steps["fields"]
    prefill, seqs, seconds = (fields.index(f) for f in ("prefill_tokens", "decode_seqs", "seconds"))
    times = sorted(row[seconds] for inst in steps["instances"].values() for row in inst["samples"]
                   if row[prefill] == 0 and row[seqs] > 0)
    if not times:
        return None
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def _role_steps(steps: dict | None):
    """(role, StepShape, seconds) of each timed step of one run (none without the shape fields)."""
    fields = list((steps or {}).get("fields") or ())
    if not set(_SHAPE) <= set(fields):
        return
    at = [fields.index(f) for f in _SHAPE]
    for inst in (steps.get("instances") or {}).values():
        for row in inst.get("samples") or []:
            p, attn, d, kv, seconds = (row[i] for i in at)
            if seconds > 0:
                yield inst.get("role"), StepShape(int(p), float(attn), int(d), int(kv)), float(seconds)


def run_speeds(runs: list[dict]) -> list[float | None]:
    """Per run of one arrangement, how long its engines' steps took against the same steps in the
    arrangement's other runs: one step model per role (control/stepmodel.py: prompt tokens, prompt
    attention, decodes, their KV tokens) fitted on the steps of all `runs`, each run's measured
    seconds over that model's (time-weighted), divided by the median over runs. 1.0 is a typical
    run; 1.3 a run whose steps took 30% longer than the same steps did in the others (a slow minute
    of the VM, another process on a core). A run at a higher rate, with bigger batches, is not
    slower by this reading (its steps are modelled bigger). None for a run with fewer than
    MIN_RUN_STEPS steps, and for every run when fewer than two runs have a reading."""
    per_run = [list(_role_steps((r.get("summary") or {}).get("engine_steps"))) for r in runs]
    pooled: dict[str, tuple[list[StepShape], list[float]]] = {}
    for rows in per_run:
        for role, shape, seconds in rows:
            shapes, times = pooled.setdefault(role, ([], []))
            shapes.append(shape)
            times.append(seconds)
    models = {role: fit_step_model(shapes, times).model
              for role, (shapes, times) in pooled.items() if len(times) >= MIN_RUN_STEPS}
    ratios: list[float | None] = []
    for rows in per_run:
        kept = [(role, shape, seconds) for role, shape, seconds in rows if role in models]
        if len(kept) < MIN_RUN_STEPS:
            ratios.append(None)
            continue
        predicted = sum(models[role].predict(shape) for role, shape, _ in kept)
        measured = sum(seconds for _, _, seconds in kept)
        ratios.append(measured / predicted if predicted > 0 else None)
    read = [r for r in ratios if r is not None]
    if len(read) < 2:
        return [None] * len(runs)
    median = statistics.median(read)
    return [r / median if r is not None else None for r in ratios]
