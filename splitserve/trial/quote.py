"""A capacity a buyer can quote, read from a results document: each arrangement's fitted capacity
and 90% interval (overall and per class), the best separated against the best colocated with a
paired-bootstrap ratio, the one decision that follows, and how the host behaved.

The decision: "yes" (separate prefill) when the ratio's interval lies above 1, "no" when below,
"unclear" (no clear difference) whenever it reaches 1, except where it ends at exactly 1 because
the two capacities meet at one probed rate from either side (curve.meet_apart: one held that rate
or crosses above it by its own fit, the other failed it or crosses below): they are ordered.
Where a capacity is only a bound, the ratio is a bound too: 1P1D holding at least S against a
colocated interval topping at C gives a ratio of at least S / C, "yes" only if that is above 1.

A fixed-rate run is a comparison only with at least MIN_PER_CLASS requests of every class in
every arrangement's run (one request then moves a class's share by at most 5 points); else it is
shown as an illustration and no sentence draws a winner from it.
"""
from __future__ import annotations

import math

import numpy as np

from splitserve.trial import curve
from splitserve.trial.engine_steps import run_speeds

MIN_PER_CLASS = 20
OTHER_TARGETS = (-0.05, 0.05)   # attainment targets, beside the spec's, that the verdict also reads
SEPARATED, COLOCATED = "separated", "colocated"


def probes_of(arr_doc: dict) -> list[curve.ProbeOutcomes]:
    """Every fitted probe of an arrangement, over all repeats (round ids kept apart per repeat)."""
    out = []
    for run in arr_doc["runs"]:
        s = run["summary"]
        if run.get("purpose") != "probe" or "outcomes" not in s or not s.get("offered_rate_rps"):
            continue
        o = s["outcomes"]
        out.append(curve.ProbeOutcomes(s["offered_rate_rps"], dict(zip(o["index"], o["good"])),
                                       run.get("repeat", 0) * 1000 + s.get("round", 0),
                                       dict(zip(o["index"], o["class"]))))
    return out


def _score(c: dict) -> float:
    if c["estimate_rps"] is None:
        return 0.0
    return c["estimate_rps"] * (0.5 if c["kind"] == "at_most" else 1.0)


def decide(ratio: dict | None) -> str:
    """yes | no | unclear, from the ratio's interval (or bound)."""
    if ratio is None:
        return "unclear"
    lo, hi = ratio.get("lo"), ratio.get("hi")
    if lo is not None and lo > 1.0:
        return "yes"
    if hi is not None and hi < 1.0:
        return "no"
    return decided_by_meeting(ratio) or "unclear"


def decided_by_meeting(ratio: dict) -> str | None:
    """"yes" or "no" where the ratio's end is exactly 1 only because the two capacities meet at a
    probed rate from either side (with_meeting, curve.meet_apart), else None."""
    def at_one(end):
        return end is not None and math.isclose(end, 1.0, abs_tol=1e-9)

    if ratio.get("meets") == "above" and at_one(ratio.get("lo")):
        return "yes"
    if ratio.get("meets") == "below" and at_one(ratio.get("hi")):
        return "no"
    return None


def with_meeting(ratio: dict | None, sep: curve.Capacity, col: curve.Capacity) -> dict | None:
    """The ratio, marked where the separated and colocated capacities meet at one probed rate from
    either side (curve.meet_apart): its end there is exactly 1, and yet the two are ordered."""
    if ratio is None:
        return None
    above, below = curve.meet_apart(sep, col), curve.meet_apart(col, sep)
    if above is None and below is None:
        return ratio
    return {**ratio, "meets": "above" if above is not None else "below",
            "meets_at_rps": above if above is not None else below}


def bound_ratio(sep: dict, col: dict) -> dict | None:
    """The ratio where one capacity (or both) is a bound: only its certain side."""
    lo_s = sep["lo_rps"] if sep["kind"] in ("point", "at_least") else None
    hi_s = sep["hi_rps"] if sep["kind"] in ("point", "at_most") else None
    lo_c = col["lo_rps"] if col["kind"] in ("point", "at_least") else None
    hi_c = col["hi_rps"] if col["kind"] in ("point", "at_most") else None
    lo = lo_s / hi_c if lo_s and hi_c else None
    hi = hi_s / lo_c if hi_s and lo_c else None
    if lo is None and hi is None:
        return None
    return {"estimate": None, "lo": lo, "hi": hi, "paired": False}


def quote(doc: dict) -> dict | None:
    arrs = [a for a in doc["arrangements"] if any(c.get("method") == "fitted" for c in a.get("capacity", []))]
    if not arrs:
        return None
    target = doc["slo"].get("attainment", 0.9)
    rng = np.random.default_rng(doc.get("seed", 0))
    per, probes, caps = {}, {}, {}
    for a in arrs:
        probes[a["name"]] = probes_of(a)
        found = caps[a["name"]] = curve.capacity(probes[a["name"]], target, rng)
        classes = sorted({c for p in probes[a["name"]] for c in p.classes.values()})
        per[a["name"]] = {**found.to_dict(), "name": a["name"], "kind_of_arrangement": a["kind"], "target": target,
                          "by_class": {c: curve.capacity([p.of_class(c) for p in probes[a["name"]]], target,
                                                         rng).to_dict() for c in classes},
                          "points": [_point(p) for p in probes[a["name"]]]}
    best = {}
    for kind in (SEPARATED, COLOCATED):
        cands = [c for c in per.values() if c["kind_of_arrangement"] == kind and c["kind"] != "none"]
        best[kind] = max(cands, key=_score)["name"] if cands else None
    ratio = None
    sep, col = best[SEPARATED], best[COLOCATED]
    if sep and col:
        if per[sep]["kind"] == "point" and per[col]["kind"] == "point":
            ratio = curve.paired_ratio(probes[sep], probes[col], target, rng, caps=(caps[sep], caps[col]))
        else:
            ratio = bound_ratio(per[sep], per[col])
        ratio = with_meeting(ratio, caps[sep], caps[col])
    steps = step_check(doc)
    others = (at_other_targets(probes[sep], probes[col], target, rng)
              if sep and col and per[sep]["kind"] != "none" and per[col]["kind"] != "none" else [])
    return {"target": target, "level": curve.LEVEL, "arrangements": per, "separated": sep, "colocated": col,
            "ratio": ratio, "decision": decide(ratio) if sep and col else None, "other_targets": others,
            "held_nothing": all(c["kind"] in ("at_most", "none") for c in per.values()),
            "host": host_summary(doc), "steps": steps, "engine_speed": engine_speed_summary(steps)}


def at_other_targets(sep: list[curve.ProbeOutcomes], col: list[curve.ProbeOutcomes], target: float,
                     rng: np.random.Generator) -> list[dict]:
    """The same two arrangements' probes read against the targets OTHER_TARGETS away from the spec's:
    where one curve levels off near the target (1P1D's chats all good, its documents failing from
    some rate on), the decision can turn on the target itself, and a buyer whose target differs
    should see that. Nothing is probed for it: the same outcomes, another crossing."""
    out, sep_points, col_points = [], [_point(p) for p in sep], [_point(p) for p in col]
    for step in OTHER_TARGETS:
        t = round(target + step, 4)
        if not 0.5 <= t <= 0.99:
            continue
        found = curve.capacity(sep, t, rng), curve.capacity(col, t, rng)
        s, c = found[0].to_dict(), found[1].to_dict()
        if s["kind"] == "none" or c["kind"] == "none":
            continue
        ratio = with_meeting(curve.paired_ratio(sep, col, t, rng, caps=found) if s["kind"] == c["kind"] == "point"
                             else bound_ratio(s, c), *found)
        out.append({"target": t, "separated": {**s, "target": t, "points": sep_points},
                    "colocated": {**c, "target": t, "points": col_points},
                    "ratio": ratio, "decision": decide(ratio)})
    return out


def _point(p: curve.ProbeOutcomes) -> dict:
    lo, hi = curve.wilson(p.k, p.n)
    by_class = {}
    for c in sorted(set(p.classes.values())):
        q = p.of_class(c)
        by_class[c] = {"n": q.n, "good": q.k}
    return {"rate_rps": p.rate, "n": p.n, "good": p.k, "lo": lo, "hi": hi, "round": p.round, "by_class": by_class}


WATCHED = ("probe", "probe-disturbed", "fixed", "fixed-disturbed")
SLOW_ENGINE = 2.0   # a run's median decode step past this many times its arrangement's probes' median
# a run's engine speed past this many times its arrangement's median run (or under its inverse): on a
# VM whose lone step moved 340-524 ms within four minutes, 59 runs of session 34 spread 0.86-1.18
# of their arrangement's median, so 1.25 marks a run beyond what that drift gave
OFF_SPEED = 1.25


def host_summary(doc: dict) -> dict:
    """How many probes and fixed-rate runs the watched host flagged, how many were redone, the
    speed drift and the idle servers' CPU while another was probed; the tuning grid's probes
    (`tuning_runs`) count with the rest."""
    probes, fixed, disturbed, redone, speeds, idle = 0, 0, 0, 0, [], []
    watched = False
    runs = [run for a in doc["arrangements"] for run in a["runs"]] + list(doc.get("tuning_runs") or [])
    for run in runs:
        s = run["summary"]
        if run.get("purpose") not in WATCHED or "attempt" not in s:
            continue
        probes += run["purpose"].startswith("probe")
        fixed += run["purpose"].startswith("fixed")
        watched = watched or bool(s.get("host"))
        disturbed += bool(s.get("disturbed"))
        redone += run["purpose"].endswith("-disturbed")
        if s.get("speed_units_per_s"):
            speeds.append(s["speed_units_per_s"])
        idle.extend((s.get("idle_cpu_share") or {}).values())
    med = float(np.median(speeds)) if speeds else None
    return {"probes": probes, "fixed": fixed, "disturbed": disturbed, "redone": redone, "watched": watched,
            "speed_median": med,
            "speed_spread": (min(speeds) / med, max(speeds) / med) if speeds and med else None,
            "idle_cpu_share_max": max(idle) if idle else None}


def step_check(doc: dict) -> dict:
    """Per arrangement, every watched run's engine speed (engine_steps.run_speeds: its steps against
    the same steps in the arrangement's other runs, 1.0 the median run), flagged "slow" past
    OFF_SPEED times and "fast" under its inverse, and the range over the runs; with each run's
    median decode-only step beside the median over the arrangement's probes, as before. A measured
    symptom (the engines stepped slower or faster than they did elsewhere in the trial: a slow
    minute of the VM, another process on a core), shown in the report, not an input to the verdict.
    A run without a speed (older results, too few steps) is flagged by its decode step alone,
    past SLOW_ENGINE times the median; decode steps grow with their batch, so that reading can
    flag a run at a much higher rate with nothing wrong, which the speed does not."""
    out = {}
    for a in doc["arrangements"]:
        own = [r["summary"].get("decode_step_median_s") for r in a["runs"] if r.get("purpose") == "probe"]
        own = [x for x in own if x]
        median = float(np.median(own)) if own else None
        speeds = run_speeds(a["runs"])
        runs = []
        for i, r in enumerate(a["runs"]):
            step = r["summary"].get("decode_step_median_s")
            if r.get("purpose") not in WATCHED or (step is None and speeds[i] is None):
                continue
            speed = speeds[i]
            slow = speed > OFF_SPEED if speed is not None else bool(median and step > SLOW_ENGINE * median)
            runs.append({"run": i, "purpose": r["purpose"], "decode_step_median_s": step, "speed": speed,
                         "slow": slow, "fast": speed is not None and speed < 1.0 / OFF_SPEED})
        read = [r["speed"] for r in runs if r["speed"] is not None]
        out[a["name"]] = {"probe_median_s": median, "runs": runs,
                          "speed_range": (min(read), max(read)) if read else None}
    return out


def engine_speed_summary(steps: dict) -> dict | None:
    """Over every arrangement's watched runs: the range of their engine speeds (each against its own
    arrangement's median run) and how many were off (slow or fast); None where no run has a speed."""
    runs = [r for c in steps.values() for r in c["runs"] if r.get("speed") is not None]
    if not runs:
        return None
    return {"runs": len(runs), "lo": min(r["speed"] for r in runs), "hi": max(r["speed"] for r in runs),
            "slow": sum(r["slow"] for r in runs), "fast": sum(r["fast"] for r in runs)}


def fixed_rule(doc: dict, m: float | None) -> tuple[bool, str]:
    """Whether the fixed-rate runs at `m` are a comparison: every class has MIN_PER_CLASS requests
    in every arrangement's run. Returns (comparison, why not)."""
    if m is None:
        return False, "no fixed-rate run"
    short = {}
    for a in doc["arrangements"]:
        for run in a["runs"]:
            if run.get("purpose") == "fixed" and abs(run["rate_multiplier"] - m) < 1e-9:
                for name, g in run["summary"]["by_class"].items():
                    if g["num_requests"] < MIN_PER_CLASS:
                        short[name] = min(short.get(name, g["num_requests"]), g["num_requests"])
    if not short:
        return True, ""
    which = ", ".join(f"{n} {k}" for n, k in sorted(short.items()))
    return False, f"fewer than {MIN_PER_CLASS} requests of a class per arrangement ({which})"
