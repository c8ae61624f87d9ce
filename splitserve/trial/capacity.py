"""Capacity within the SLOs: the highest offered rate at which a target share of requests is good.

DistServe calls this goodput; GuideLLM's goodput profile searches it the same way. One probe
replays the plan's first N requests compressed in time by a rate multiplier and returns its
attainment. The search grows the multiplier while probes pass, shrinks it while they fail,
then bisects (geometrically) between the highest pass and the lowest fail until they are
within `precision` of each other, or the probes or the time budget run out. The budget ends
only the bisection (a search without a held rate, or without a failed one, says nothing about how
arrangements compare), and only of an arrangement out of the running: one whose failing rate
another arrangement held (`beaten`). A contender's bracket is narrowed to `precision` whatever
the budget, bounded by `max_probes`: two leading arrangements stopped in the same coarse bracket
read as "no clear difference" however they differ. The answer is
always a bracket: `passed` (the rate held) and `failed` (the rate not held), either may be None.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable


@dataclass(slots=True)
class Probe:
    multiplier: float
    attainment: float
    offered_rate_rps: float | None
    seconds: float


@dataclass(slots=True)
class CapacityResult:
    passed: Probe | None = None            # highest multiplier that met the target
    failed: Probe | None = None            # lowest multiplier above it that did not
    probes: list[Probe] = field(default_factory=list)
    stopped_by: str = "precision"          # precision | max_probes | budget | floor

    @property
    def capacity_rps(self) -> float | None:
        return self.passed.offered_rate_rps if self.passed else None

    def to_dict(self) -> dict:
        return {"capacity_rps": self.capacity_rps,
                "capacity_multiplier": self.passed.multiplier if self.passed else None,
                "failed_rps": self.failed.offered_rate_rps if self.failed else None,
                "stopped_by": self.stopped_by,
                "probes": [{"multiplier": p.multiplier, "attainment": p.attainment,
                            "offered_rate_rps": p.offered_rate_rps, "seconds": p.seconds} for p in self.probes]}


def search_capacity(probe: Callable[[float], Probe], start: float, target: float, precision: float = 0.1,
                    grow: float = 2.0, max_probes: int = 8, budget_s: float | None = None,
                    min_multiplier: float = 0.1,
                    beaten: Callable[[float], bool] | None = None) -> CapacityResult:
    """Grow-then-bisect on the rate multiplier; `probe(m)` replays at m and reports attainment.
    Below `min_multiplier` it stops: a passing probe there would take 1/min_multiplier times the
    plan's own span, and an arrangement that slow holds nothing worth comparing.
    `beaten(m)`: another arrangement held multiplier m (None: every arrangement is in the running,
    so the budget never ends a bisection)."""
    result = CapacityResult()
    m, spent = start, 0.0
    while True:
        if len(result.probes) >= max_probes:
            result.stopped_by = "max_probes"
            break
        p = probe(m)
        result.probes.append(p)
        spent += p.seconds
        if p.attainment >= target:
            if result.passed is None or p.multiplier > result.passed.multiplier:
                result.passed = p
        elif result.failed is None or p.multiplier < result.failed.multiplier:
            result.failed = p
        lo = result.passed.multiplier if result.passed else None
        hi = result.failed.multiplier if result.failed else None
        if lo is not None and hi is not None:
            if hi <= lo * (1 + precision):
                result.stopped_by = "precision"
                break
            m = math.sqrt(lo * hi)
        elif lo is not None:
            m = lo * grow
        else:
            m = hi / grow
            if m < min_multiplier:
                result.stopped_by = "floor"
                break
        # The budget only ends the bisection. While growing, a lower bound says nothing about how
        # two arrangements compare (a demo once reported "no clear difference" between a search
        # bracketed at x0.25-x0.5 and one stopped after its first pass at x0.25), and each growth
        # probe replays the same requests faster, so all of them together take no longer than the
        # last pass did; max_probes still bounds them.
        # A contender is bisected past the budget: stopping the two leaders in one coarse bracket
        # made a demo say "no clear difference" where the next probe would have told them apart.
        if (budget_s is not None and result.passed is not None and result.failed is not None
                and spent + p.seconds * p.multiplier / m > budget_s
                and beaten is not None and beaten(result.failed.multiplier)):
            result.stopped_by = "budget"
            break
    return result


def spread(values: list[float | None]) -> dict:
    """Median and range over repeats; a missing value (nothing held) counts as 0."""
    vals = [v if v is not None and math.isfinite(v) else (0.0 if v is None else v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def clear_winner(a: dict, b: dict, resolution: float = 0.0) -> int:
    """+1 if a is clearly above b, -1 if clearly below, 0 if not: their ranges over repeats must
    not overlap, and (for a single run) differ by more than `resolution` (relative)."""
    if a["median"] is None or b["median"] is None:
        return 0
    if a["min"] > b["max"] and a["min"] > b["max"] * (1 + resolution):
        return 1
    if b["min"] > a["max"] and b["min"] > a["max"] * (1 + resolution):
        return -1
    return 0
