"""Before a run: the server has finished (or dropped) everything an earlier run left it.

A probe stopped early cancels its streams, and the server takes a moment to abort them; a run
started meanwhile would share the engines with that leftover work. So before every probe and
fixed-rate run the trial reads the server's /metrics until no instance has a request running or
queued (the gauges coordinator/metrics.py exports from each engine's stats, sent at most 0.25 s
after anything changed), up to a deadline; past it the run goes ahead and its summary says so.
A server that does not export the gauges (another server, an older one) is not checked.
"""
from __future__ import annotations

import time

from splitserve.trial.client import scrape_counters

BUSY_GAUGES = ("splitserve_instance_running_requests", "splitserve_instance_queued_requests")
DEADLINE_S = 30.0
POLL_S = 0.2


def busy_requests(base_url: str) -> float | None:
    """Requests running or queued over all instances, or None if the server exports neither gauge."""
    samples = scrape_counters(base_url, BUSY_GAUGES)
    mine = [v for k, v in samples.items() if k.split("{")[0] in BUSY_GAUGES]
    return sum(mine) if mine else None


def wait_idle(base_url: str, deadline_s: float = DEADLINE_S, poll_s: float = POLL_S) -> dict:
    """Poll until the server is idle; {"checked", "idle", "wait_s", "busy_requests"} for the summary."""
    start = time.monotonic()
    while True:
        busy = busy_requests(base_url)
        waited = time.monotonic() - start
        if busy is None:
            return {"checked": False, "idle": None, "wait_s": waited, "busy_requests": None}
        if busy == 0:
            return {"checked": True, "idle": True, "wait_s": waited, "busy_requests": 0}
        if waited >= deadline_s:
            return {"checked": True, "idle": False, "wait_s": waited, "busy_requests": busy}
        time.sleep(poll_s)
