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
"""
from __future__ import annotations

import time

import httpx

SETTLE_S = 0.35  # engine/process.py STATS_INTERVAL_S and a margin: the run's last steps arrive


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
