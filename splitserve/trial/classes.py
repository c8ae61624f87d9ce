"""Service classes: a deadline, a patience and a priority per kind of customer, and what an
arrangement costs. Read from the spec like the rest (errors name the field).

    slo: {ttft_s: 2, gap_s: 0.5, max_pause_s: 2, e2e_s: 60}   # the global SLO
    price_per_core_hour: 0.05            # an arrangement's cost: cores x this, unless it says
    workload:
      classes:
        chat:
          slo: {ttft_s: 1, e2e_s: 20}    # the fields written here replace the global ones
          patience: {ttft_s: 3, total_s: 30}   # the client disconnects past either
          priority: -1                   # sent in the request body; lower is served first
        document:
          slo: {ttft_s: null, gap_s: null, max_pause_s: null, e2e_s: 300}   # null: no deadline
    arrangements:
      - {name: big, serve: [...], cost_per_hour: 1.2}

A class without `slo` is judged by the global SLO; a field it leaves out falls back to the
global one; a field set to null is not a deadline for that class at all.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from splitserve.config import PRIORITY_BOUNDS
from splitserve.trial.section import Section, SpecError

SLO_FIELDS = ("ttft_s", "gap_s", "e2e_s", "max_pause_s")


@dataclass(slots=True)
class SLO:
    """A deadline set; a field that is None is no deadline (a per-class SLO may drop any)."""

    ttft_s: float | None
    gap_s: float | None
    e2e_s: float | None
    max_pause_s: float | None
    gap_percentile: float = 99.0
    attainment: float = 0.9                # share of requests that must be good to "hold" a rate

    def scaled(self, factor: float) -> "SLO":
        def s(x):
            return None if x is None else x * factor
        return SLO(s(self.ttft_s), s(self.gap_s), s(self.e2e_s), s(self.max_pause_s),
                   self.gap_percentile, self.attainment)


@dataclass(slots=True)
class Patience:
    """When the client gives up and disconnects (an "abandoned" request)."""

    ttft_s: float | None = None            # no first token within this after sending
    total_s: float | None = None           # the answer not complete within this after sending


def check_slo(slo: SLO, path: str) -> SLO:
    """Cross-field checks; `path` is the dotted path of the SLO section ("slo.", "workload.classes.chat.slo.")."""
    if not 0 < slo.attainment <= 1:
        raise SpecError(f"{path}attainment: a share of requests in (0, 1], got {slo.attainment}")
    if not 0 < slo.gap_percentile <= 100:
        raise SpecError(f"{path}gap_percentile: a percentile in (0, 100], got {slo.gap_percentile}")
    if slo.e2e_s is not None and slo.ttft_s is not None and slo.e2e_s <= slo.ttft_s:
        raise SpecError(f"{path}e2e_s ({slo.e2e_s}) must be longer than {path}ttft_s ({slo.ttft_s}): "
                        "no request can finish before its first token")
    if slo.max_pause_s is not None and slo.gap_s is not None and slo.max_pause_s < slo.gap_s:
        raise SpecError(f"{path}max_pause_s ({slo.max_pause_s}) is below {path}gap_s ({slo.gap_s}): the "
                        "longest pause is never shorter than a gap percentile; raise max_pause_s")
    return slo


def read_slo_overrides(sec: Section) -> dict:
    """A class's `slo:` as {field: value or None}; fields it leaves out are absent (fall back)."""
    out = {}
    for key in SLO_FIELDS:
        if key in sec.raw and sec.raw[key] is None:
            sec.used.add(key)
            out[key] = None
        elif key in sec.raw:
            out[key] = sec.float(key, positive=True)
    for key in ("gap_percentile", "attainment"):
        if key in sec.raw:
            out[key] = sec.float(key, positive=True)
    sec.finish()
    return out


def class_slo(global_slo: SLO, overrides: dict | None, path: str) -> SLO:
    if overrides is None:
        return global_slo
    slo = check_slo(replace(global_slo, **overrides), path)
    if all(getattr(slo, key) is None for key in SLO_FIELDS):
        raise SpecError(f"{path.rstrip('.')}: every deadline is null, so every completed request would be good; "
                        "keep at least one (e.g. e2e_s), or leave slo out to use the global one")
    return slo


def read_patience(sec: Section) -> Patience | None:
    if sec.empty:
        sec.finish()
        return None
    patience = Patience(ttft_s=sec.float("ttft_s", default=None, positive=True),
                        total_s=sec.float("total_s", default=None, positive=True))
    sec.finish()
    if patience.ttft_s is None and patience.total_s is None:
        raise SpecError(f"{sec.path}ttft_s: give ttft_s or total_s (seconds the client waits), or leave patience out")
    if patience.ttft_s is not None and patience.total_s is not None and patience.total_s <= patience.ttft_s:
        raise SpecError(f"{sec.path}total_s ({patience.total_s}) must be longer than {sec.path}ttft_s "
                        f"({patience.ttft_s}): the client waits for the first token before the whole answer")
    return patience


def read_priority(sec: Section) -> int | None:
    priority = sec.int("priority", default=None)
    if priority is not None and not PRIORITY_BOUNDS[0] <= priority <= PRIORITY_BOUNDS[1]:
        raise SpecError(f"{sec.path}priority: must be within {PRIORITY_BOUNDS[0]}..{PRIORITY_BOUNDS[1]} "
                        f"(lower is served first), got {priority}")
    return priority


def arrangement_cost(cost_per_hour: float | None, cores: int | None, price_per_core_hour: float | None) -> float | None:
    """Cost per hour: stated by the arrangement, else its cores x the spec's price per core-hour."""
    if cost_per_hour is not None:
        return cost_per_hour
    if cores and price_per_core_hour is not None:
        return cores * price_per_core_hour
    return None
