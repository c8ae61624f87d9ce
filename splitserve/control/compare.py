"""Predicted beside measured: re-simulate what a trial ran, and put the two side by side.

Given a trial's results.json and a profile (or a plan.json, which embeds its profile), each
arrangement the trial launched with `serve` arguments is rebuilt (predict.arrangement_from_serve_args)
and simulated on the trial's exact plan (send times, lengths) at every rate it ran. Errors:
attainment in points (predicted - measured), times relative ((predicted - measured) / measured),
capacity relative when the trial measured one (a sweep, or a capacity search with repeats: the
median). Repeated runs at one rate are pooled by their median. The ranking check compares the
top two by capacity when measured, else by attainment at the trial's own rate.

    python -m splitserve.control.compare plan.json trial-results/x/results.json [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

from splitserve.control.predict import (arrangement_from_serve_args, capacity, offered_rate, predict,
                                        requests_from_results)
from splitserve.control.profile_file import Profile, ProfileError, parse_profile
from splitserve.trial.spec import SLO

METRICS = (("attainment", lambda s: s["attainment"]),
           ("TTFT p50", lambda s: s["ttft_s"]["p50"]),
           ("TTFT p99", lambda s: s["ttft_s"]["p99"]),
           ("gap p99", lambda s: s["gap_s"]["p99"]),
           ("longest pause p99", lambda s: s["longest_pause_s"]["p99"]))


def profile_of(doc: dict, source: str = "plan") -> Profile:
    """A plan.json carries its profile; a profile.json is one."""
    return parse_profile(doc["profile"] if "profile" in doc and "arrangements" in doc else doc, source)


def _error(name: str, predicted, measured):
    if predicted is None or measured is None or not math.isfinite(predicted) or not math.isfinite(measured):
        return None  # a request that never got a token is infinitely late: no error to put on that
    if name == "attainment":
        return predicted - measured
    return (predicted - measured) / measured if measured else None


def _measured_capacity(arr_doc: dict) -> float | None:
    """The trial's capacity: `sweep_capacity_rps` (a sweep), or `capacity_rps` (a capacity
    search; with repeats a {median, min, max} mapping)."""
    value = arr_doc.get("sweep_capacity_rps") or arr_doc.get("capacity_rps")
    return value.get("median") if isinstance(value, dict) else value


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _main_multiplier(results: dict) -> float:
    """The rate the trial calls its own: the calibrated fixed rate when there is one, else x1."""
    return float((results.get("calibration") or {}).get("rate_multiplier") or 1.0)


def compare_results(profile: Profile, results: dict, target: float = 0.9, with_capacity: bool = True) -> dict:
    """Every run the trial made (repeats at one rate pooled by their median) beside the prediction
    at that rate; capacity beside capacity when the trial measured one."""
    slo_doc = results["slo"]
    slo = SLO(slo_doc["ttft_s"], slo_doc["gap_s"], slo_doc["e2e_s"], slo_doc["max_pause_s"],
              slo_doc.get("gap_percentile", 99.0))
    target = slo_doc.get("attainment", target)
    requests = requests_from_results(results)
    if not requests:
        raise ValueError("results.json has an empty plan: nothing to simulate")
    base, main = offered_rate(requests), _main_multiplier(results)
    rows, skipped, at_main, capacities = [], [], [], []
    for arr_doc in results["arrangements"]:
        launch = arr_doc.get("launch") or {}
        if not launch.get("serve") or not arr_doc["runs"]:
            skipped.append(f"{arr_doc['name']}: {'failed to start' if arr_doc.get('error') else 'not launched by serve'}")
            continue
        arr = arrangement_from_serve_args(arr_doc["name"], launch["serve"], launch.get("cores"))
        kv_per_instance = (arr_doc.get("resources") or {}).get("kv_per_instance")
        if kv_per_instance:  # the trial splits one KV budget between an arrangement's instances
            arr = dataclasses.replace(arr, kv_cache_bytes=int(kv_per_instance))
        by_rate: dict[float, list[dict]] = {}
        for run in arr_doc["runs"]:
            by_rate.setdefault(run["rate_multiplier"], []).append(run["summary"])
        for multiplier in sorted(by_rate):
            summaries = by_rate[multiplier]
            predicted = predict(arr, profile, requests, slo, multiplier)
            for name, get in METRICS:
                p, m = get(predicted), _median([get(x) for x in summaries])
                rows.append({"arrangement": arr.name, "rate_multiplier": multiplier, "num_runs": len(summaries),
                             "metric": name, "predicted": p, "measured": m, "error": _error(name, p, m)})
                if name == "attainment" and multiplier == main:
                    at_main.append((arr.name, p, m))
        measured_cap = _measured_capacity(arr_doc)
        if measured_cap is not None and with_capacity:
            cap = capacity(arr, profile, requests, slo, target)
            p = cap * base if cap else None
            rows.append({"arrangement": arr.name, "rate_multiplier": None, "num_runs": None,
                         "metric": f"capacity at {target:.0%}", "predicted": p, "measured": measured_cap,
                         "error": _error("capacity", p, measured_cap)})
            capacities.append((arr.name, p or 0.0, measured_cap))
    ranking, by = (capacities, "capacity") if capacities else (at_main, f"attainment at x{main:g}")
    top_pred = [n for n, _, _ in sorted(ranking, key=lambda x: -(x[1] or 0))[:2]]
    top_meas = [n for n, _, _ in sorted(ranking, key=lambda x: -(x[2] or 0))[:2]]
    return {"trial": results.get("trial"), "rows": rows, "skipped": skipped,
            "ranking": {"by": by, "predicted_top_two": top_pred, "measured_top_two": top_meas,
                        "same_top_two": top_pred == top_meas}}


def _cell(metric: str, value) -> str:
    if value is None:
        return "n/a"
    if metric == "attainment":
        return f"{value:.0%}"
    if metric.startswith("capacity"):
        return f"{value:.2f}/s"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def render(doc: dict) -> str:
    lines = [f"predicted vs measured: {doc['trial']}",
             f"{'arrangement':26} {'rate':>5} {'metric':22} {'predicted':>10} {'measured':>10} {'error':>8}"]
    for r in doc["rows"]:
        err = r["error"]
        err_text = "n/a" if err is None else (f"{err * 100:+.0f} pt" if r["metric"] == "attainment" else f"{err:+.0%}")
        rate = "" if r["rate_multiplier"] is None else f"x{r['rate_multiplier']:g}"
        if r.get("num_runs", 1) and r.get("num_runs", 1) > 1:
            rate += f"({r['num_runs']})"
        lines.append(f"{r['arrangement']:26} {rate:>5} {r['metric']:22} {_cell(r['metric'], r['predicted']):>10} "
                     f"{_cell(r['metric'], r['measured']):>10} {err_text:>8}")
    rk = doc["ranking"]
    lines.append(f"top two by {rk['by']}: predicted {rk['predicted_top_two']}, measured {rk['measured_top_two']}"
                 f" ({'same' if rk['same_top_two'] else 'DIFFERENT'})")
    lines += [f"skipped {s}" for s in doc["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="predicted (from a plan or profile) vs measured (a trial)")
    parser.add_argument("plan", help="plan.json or profile.json")
    parser.add_argument("results", help="a trial's results.json")
    parser.add_argument("--target", type=float, default=0.9, help="attainment target for capacity")
    parser.add_argument("--json", default=None, help="also write the comparison here")
    args = parser.parse_args(argv)
    try:
        profile = profile_of(json.loads(pathlib.Path(args.plan).read_text()), args.plan)
        doc = compare_results(profile, json.loads(pathlib.Path(args.results).read_text()), args.target)
    except (OSError, json.JSONDecodeError, ProfileError, ValueError, KeyError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(render(doc))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
