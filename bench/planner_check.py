"""Predicted against measured capacity, for every arrangement-run of several trials, from one profile.

Issue 28's must-show: from one profile of a box kind, with no calibration by the trials it is
checked against, the planner's capacity for each arrangement a trial measured with a fitted
interval falls within 15% of the measured estimate or inside the interval, for at least 7 of 8.
For each results.json this runs `control.compare` (the arrangement rebuilt from its serve
arguments, simulated on the trial's own probe workloads) and keeps, per arrangement-run: the
prediction, the measured interval (read again with the current `trial/quote.py`, so runs made
under an older estimator are read the same way), whether the prediction is inside or within 15%,
and the prediction with the step model refitted on that trial's own engine steps: where the
refit lands inside and the profile's does not, the miss is step time; where neither does, it is
the scheduling model (or the measurement).

    python bench/planner_check.py PROFILE.json RESULTS.json [RESULTS.json ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.control.compare import _inside, compare_results, profile_of  # noqa: E402
from splitserve.trial.quote import quote  # noqa: E402

WITHIN = 0.15


def _verdict(p: float | None, c: dict) -> dict:
    est = c.get("estimate_rps")
    rel = (p - est) / est if p is not None and est and c["kind"] == "point" else None
    inside = _inside(p, c)
    return {"error": rel, "inside": inside, "within_15": rel is not None and abs(rel) <= WITHIN,
            "ok": inside or (rel is not None and abs(rel) <= WITHIN)}


def check(profile, path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    now = quote(doc)
    if now is None:
        return []
    doc["quote"] = now  # compare reads the interval from here: today's fit of the same probes
    t0 = time.process_time()
    cmp = compare_results(profile, doc)
    cpu = time.process_time() - t0
    out = []
    for name, c in now["arrangements"].items():
        if c.get("kind") not in ("point", "at_least", "at_most"):
            continue
        rows = [r for r in cmp["rows"] if r["arrangement"] == name and r["rate_multiplier"] is None]
        first = next((r for r in rows if r["metric"].startswith("capacity at")), {})
        pred, agreeing = first.get("predicted"), first.get("runs_agreeing")
        refit = next((r["predicted"] for r in rows if r["metric"] == "capacity, its steps refit"), None)
        speed = next((r for r in rows if r["metric"] == "capacity at the trial's speed"), None)
        ends = {r["band_end"]: r["predicted"] for r in rows if "band_end" in r}
        out.append({"results": str(path.relative_to(ROOT) if path.is_absolute() else path),
                    "trial": doc.get("trial"), "arrangement": name,
                    "measured": {k: c.get(k) for k in ("kind", "estimate_rps", "lo_rps", "hi_rps")},
                    "num_probes": len(c.get("points") or []),
                    "predicted_rps": pred, **_verdict(pred, c),
                    "refit_rps": refit, "refit": _verdict(refit, c) if refit is not None else None,
                    "at_speed_rps": speed["predicted"] if speed else None,
                    "speed_factor": speed["speed_factor"] if speed else None,
                    "at_speed": _verdict(speed["predicted"], c) if speed else None,
                    "runs_agreeing": agreeing, "compare_cpu_s": round(cpu, 2),
                    **({"band_rps": ends, "band_meets": _band_meets(ends, c),
                        "at_median_speed": _verdict(ends["median"], c)} if len(ends) == 3 else {})})
    return out


def _band_meets(ends: dict, c: dict) -> bool:
    """Whether the capacities predicted at the profile's slow and fast ends (its watched step's 90th
    and 10th percentiles) span a point the measurement allows: the band and the measured interval
    (a bound: its side) overlap. Not the must-show's test (that is the point prediction's); what a
    plan that states its host's drift would have promised."""
    slow, fast = ends["slow"] or 0.0, ends["fast"] or 0.0
    if c["kind"] == "point":
        return slow <= c["hi_rps"] and fast >= c["lo_rps"]
    return fast >= c["estimate_rps"] if c["kind"] == "at_least" else slow <= c["estimate_rps"]


def _iv(c: dict) -> str:
    if c["kind"] == "point":
        return f"{c['estimate_rps']:.2f} [{c['lo_rps']:.2f}-{c['hi_rps']:.2f}]"
    return f"{c['kind'].replace('_', ' ')} {c['estimate_rps']:.2f}"


def _cell(p, v) -> str:
    if p is None:
        return "none held"
    err = f" ({v['error']:+.0%})" if v and v.get("error") is not None else ""
    return f"{p:.2f}{err} {'inside' if v['inside'] else 'within 15%' if v['within_15'] else 'MISS'}"


def miss_reads_as(r: dict) -> str:
    """Which step a capacity miss comes from, by its runs (compare's runs_agreeing: each run simulated
    as profiled and at its own engines' step speed): step time where more of its runs land at their
    own speed than as profiled, or where the prediction refit on the trial's steps lands; scheduling
    where neither."""
    a = r.get("runs_agreeing")
    if a and a["with_steps"] and a["own_steps"] > a["profile"]:
        return (f"step time: {a['own_steps']} of {a['with_steps']} runs land at their own step speed, "
                f"{a['profile']} of {a['runs']} as profiled")
    if r.get("refit") and r["refit"]["ok"]:
        return "step time: the prediction on the trial's own steps (refit) lands"
    return "scheduling: neither the runs at their own step speed nor the refit land where the trial did"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    profile = profile_of(json.loads(args.profile.read_text()), str(args.profile))
    rows = []
    for path in args.results:
        rows.extend(check(profile, path))
    print("| trial | arrangement | measured (90%) | probes | predicted | at the trial's speed | refit on its steps "
          "| runs agreeing: profile, own step speed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = (f"{_cell(r['at_speed_rps'], r['at_speed'])} (x{r['speed_factor']:.2f})" if r["at_speed"] else "-")
        a = r.get("runs_agreeing")
        runs = f"{a['profile']}/{a['runs']}, {a['own_steps']}/{a['with_steps']}" if a else "-"
        print(f"| {r['results']} | {r['arrangement']} | {_iv(r['measured'])} | {r['num_probes']} | "
              f"{_cell(r['predicted_rps'], r)} | {speed} | {_cell(r['refit_rps'], r['refit']) if r['refit'] else '-'} "
              f"| {runs} |")
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} arrangement-runs predicted inside the interval or within 15% of the estimate")
    for r in rows:
        if not r["ok"]:
            print(f"  miss: {r['arrangement']} ({r['trial']}): {miss_reads_as(r)}")
    banded = [r for r in rows if "band_rps" in r]
    if banded:
        b = profile.speed_band
        print(f"{sum(r['band_meets'] for r in banded)} of {len(banded)} measured intervals meet the capacities predicted "
              f"at the profile's slow and fast ends (its watched step x{b['p90']:.2f} and x{b['p10']:.2f} the model, "
              f"{b['readings']} readings over {b['span_s']:.0f} s):")
        for r in banded:
            e = r["band_rps"]
            print(f"  {r['arrangement']} ({r['trial']}): {_iv(r['measured'])} against "
                  f"{e['slow'] or 0:.2f}-{e['fast'] or 0:.2f}: {'meets' if r['band_meets'] else 'APART'}; "
                  f"at the median speed {_cell(e['median'], r['at_median_speed'])}")
        print(f"{sum(r['at_median_speed']['ok'] for r in banded)} of {len(banded)} predicted at the profile's median "
              f"watched speed (x{b['p50']:.2f} the model) inside the interval or within 15% of the estimate")
    if any(r["at_speed"] for r in rows):
        fast = sum(r["at_speed"]["ok"] for r in rows if r["at_speed"])
        print(f"{fast} of {sum(1 for r in rows if r['at_speed'])} at the speed each trial's box ran the host-speed "
              "benchmark (the profile's step times scaled by the ratio)")
    if args.json:
        args.json.write_text(json.dumps({"profile": str(args.profile), "rows": rows, "ok": ok, "num": len(rows),
                                         "ok_at_speed": sum(r["at_speed"]["ok"] for r in rows if r["at_speed"]),
                                         "speed_band": profile.speed_band,
                                         "band_meets": sum(r["band_meets"] for r in rows if "band_rps" in r),
                                         "ok_at_median_speed": sum(r["at_median_speed"]["ok"] for r in rows
                                                                   if "band_rps" in r)},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
