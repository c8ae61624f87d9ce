"""Predicted beside measured: re-simulate what a trial ran, and put the two side by side.

Given a trial's results.json and a profile (or a plan.json, which embeds its profile), each
arrangement the trial launched with `serve` arguments is rebuilt (predict.arrangement_from_serve_args)
and each of its runs is simulated on exactly what that run replayed (its requests' send times and
lengths; older results without them: the plan at the run's rate), each request judged by its
class's SLO. Errors: attainment in points (predicted - measured), times relative ((predicted -
measured) / measured), capacity relative when the trial measured one (a sweep, or a capacity
search with repeats: the median), the predicted capacity searched over the same probe workloads
(the plan's first requests, more at higher rates) and given as their offered rate, as the trial
does. Runs at one rate are pooled by their median; a probe that stopped early measured a
failure, not an attainment, so only whether it held is compared. The ranking check compares
the top two by capacity when measured, else by attainment at the trial's own rate.

Where the trial kept its engines' measured steps (trial/engine_steps.py), each arrangement also
gets those steps against the profile's step model (control/trial_steps.py), and its capacity is
predicted a second time with the step model refitted on the trial's own steps (the profile as its
prior): the first error minus the second is what step time explains. Each run is also simulated
at its own step speed (trial_steps.run_speed: that run's steps against the models the simulation
uses, time-weighted), and the capacity row counts the runs whose simulation lands within 10
points of them (a stopped probe: on the same side of the target) both ways: where the count at
their own speed is the higher, the misses are the step time of the minutes they ran in (a VM's
speed moves; one pooled refit cannot follow a probe on a cliff), where it is not, scheduling.

    python -m splitserve.control.compare plan.json trial-results/x/results.json [--spec S.yaml] [--json out.json]
        [--calibrate-out calibrated-profile.json [--calibrate-with other-results.json ...]]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys

from types import SimpleNamespace

from splitserve.control.predict import (Arrangement, arrangement_from_serve_args, capacity, class_priorities,
                                        offered_rate, predict, requests_from_results, tile)
from splitserve.control.profile_file import SPEED_BAND_ENDS, Profile, ProfileError, parse_profile
from splitserve.control.simulator import SimRequest
from splitserve.control.trial_steps import calibration, refit, run_speed, step_ratios, trial_samples, with_models
from splitserve.trial.method import CapacitySpec
from splitserve.trial.spec import SLO, SpecError, load_spec
from splitserve.trial.workload import probe_length

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


def _measured_range(arr_doc: dict) -> tuple[float, float] | None:
    """(min, max) of the measured capacity over repeats, when the trial repeated."""
    value = arr_doc.get("sweep_capacity_rps") or arr_doc.get("capacity_rps")
    if isinstance(value, dict) and value.get("min") is not None and value.get("max") is not None:
        return float(value["min"]), float(value["max"])
    return None


def _fitted_interval(results: dict, name: str) -> dict | None:
    """The trial's fitted capacity for `name` (results.json `quote`, trial/quote.py: the crossing
    of a curve fitted to every probe, with its interval), or None when the trial fitted none."""
    c = ((results.get("quote") or {}).get("arrangements") or {}).get(name)
    return c if c and c.get("kind") in ("point", "at_least", "at_most") else None


def _inside(p: float | None, c: dict) -> bool:
    """Whether a predicted capacity falls in a fitted interval (a bound: on its side of it)."""
    if p is None:
        return False
    if c["kind"] == "point":
        return c["lo_rps"] <= p <= c["hi_rps"]
    return p >= c["estimate_rps"] if c["kind"] == "at_least" else p <= c["estimate_rps"]


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _main_multiplier(results: dict) -> float:
    """The rate the trial calls its own: the calibrated fixed rate when there is one, else x1."""
    return float((results.get("calibration") or {}).get("rate_multiplier") or 1.0)


def _slos(results: dict) -> tuple[SLO, dict[str, SLO]]:
    def slo_of(doc: dict) -> SLO:
        return SLO(doc["ttft_s"], doc["gap_s"], doc["e2e_s"], doc["max_pause_s"], doc.get("gap_percentile", 99.0))
    classes = {name: slo_of(c["slo"]) for name, c in (results.get("classes") or {}).items() if c.get("slo")}
    return slo_of(results["slo"]), classes


def run_requests(run: dict, priority: dict[str, int] | None = None) -> list[SimRequest] | None:
    """What one run replayed (its `requests`, times already at its rate; `priority` per class);
    None for older results."""
    if not run.get("requests"):
        return None
    priority = priority or {}
    return [SimRequest(q["index"], q["scheduled_s"], q["num_prompt_tokens"], q["max_tokens"], q["class_name"],
                       priority.get(q["class_name"], 0)) for q in run["requests"]]


def probe_workload(plan: list[SimRequest], multiplier: float, min_requests: int,
                   min_seconds: float | None) -> list[SimRequest]:
    """The requests a trial's capacity probe replays at `multiplier` (trial/runner.py `_probe`): the
    plan's first `probe_length` requests, the plan repeated one period later when that is more than
    it holds, sent at `multiplier` times the plan's rate."""
    count = probe_length([SimpleNamespace(send_at_s=r.arrival_s) for r in plan], multiplier, min_requests,
                         min_seconds)
    return [SimRequest(r.index, r.arrival_s / multiplier, r.prompt_tokens, r.answer_tokens, r.class_name,
                       r.priority) for r in tile(plan, count)[:count]]


def _probe_settings(results: dict, spec_path: str | None) -> tuple[int, float | None] | None:
    """probe_requests and probe_seconds of the trial's capacity search, from its spec (results.json
    names it; `--spec` overrides), checked against the probes the trial ran."""
    path = spec_path or results.get("spec_path")
    if not path or not pathlib.Path(path).is_file():
        return None
    cap = load_spec(path).capacity or CapacitySpec()
    settings = (cap.probe_requests, cap.probe_seconds)
    plan = requests_from_results(results)
    for arr_doc in results["arrangements"]:
        for run in arr_doc.get("runs") or []:
            if run.get("purpose") == "probe" and run.get("requests"):
                expected = len(probe_workload(plan, run["rate_multiplier"], *settings))
                if expected != len(run["requests"]):
                    raise ValueError(f"{path}: its capacity settings give {expected} requests for the probe at "
                                     f"x{run['rate_multiplier']:g}, the trial replayed {len(run['requests'])}; "
                                     "the spec changed since the trial: pass the trial's own spec with --spec")
    return settings


def unmodelled(serve: list[str], profiled_weight_format: str | None = None) -> list[str]:
    """serve settings the simulator does not reproduce: such an arrangement is simulated as the
    plain one (a fixed mix, the profiled engine) and left out of the ranking check. The scheduling
    policy is modelled: the simulator runs the engine's own scheduler."""
    out = []
    if "--kernels" in serve[:-1] and serve[serve.index("--kernels") + 1] == "off":
        out.append("--kernels off")  # the profile timed the engine with its kernels
    if "--weight-format" in serve[:-1]:
        fmt = serve[serve.index("--weight-format") + 1]
        if fmt != "auto" and fmt != profiled_weight_format:
            out.append(f"--weight-format {fmt}")
    if "--adaptive" in serve:
        out.append("--adaptive")
    return out


AGREE_POINTS = 0.10  # a run's predicted attainment agrees with the measured one within this


def _agrees(predicted: dict, summary: dict, target: float) -> bool:
    """Whether a run's simulation lands where the run did: within AGREE_POINTS of its attainment,
    or, for a probe that stopped early (its attainment counts only what it saw before it could no
    longer pass), on the same side of the target."""
    if summary.get("stopped_early"):
        return (predicted["attainment"] >= target) == (summary["attainment"] >= target)
    return abs(predicted["attainment"] - summary["attainment"]) <= AGREE_POINTS + 1e-9


def _group(values: list[float | None]) -> float | None:
    return _median([v for v in values if v is not None and math.isfinite(v)]) if values else None


def trial_speed(results: dict) -> float | None:
    """The median of the host-speed benchmark a trial ran before each probe (summary
    speed_units_per_s; trial/hostwatch.speed_benchmark), or None where it recorded none."""
    speeds = [r["summary"].get("speed_units_per_s") for a in results.get("arrangements", ())
              for r in a.get("runs", ()) if isinstance(r.get("summary"), dict)]
    speeds = [x for x in speeds if isinstance(x, (int, float)) and x > 0]
    return statistics.median(speeds) if speeds else None


def _speed_factor(profile: Profile, results: dict) -> float | None:
    """How many times slower the trial's box ran the speed benchmark than the profile's (None when
    either lacks it): the same box kind varies by 20% between machines (session 31: 1,660-1,740
    against 2,110-2,170 units/s), and a step model moves with it. This reads the box, not the
    trial's outcome: the benchmark is a fixed loop timed before each probe."""
    trial, prof = trial_speed(results), profile.speed_units_per_s
    return prof / trial if trial and prof else None


def launched_arrangement(arr_doc: dict) -> Arrangement:
    """The arrangement a trial launched, rebuilt from its `serve` arguments, with the share of the
    trial's KV budget each of its instances had."""
    launch = arr_doc["launch"]
    arr = arrangement_from_serve_args(arr_doc["name"], launch["serve"], launch.get("cores"))
    kv_per_instance = (arr_doc.get("resources") or {}).get("kv_per_instance")
    if kv_per_instance:  # the trial splits one KV budget between an arrangement's instances
        arr = dataclasses.replace(arr, kv_cache_bytes=int(kv_per_instance))
    return arr


def simulate_run(arr: Arrangement, profile: Profile, run: dict, plan: list[SimRequest], slo: SLO,
                 class_slos: dict[str, SLO], priorities: dict[str, int] | None = None
                 ) -> tuple[dict, float | None, dict | None]:
    """One run simulated on exactly what it replayed (older runs: the plan at its rate): the
    prediction as profiled, the speed its engines stepped at (trial_steps.run_speed; None without
    enough steps), and the prediction again at that speed (None likewise)."""
    own = run_requests(run, priorities)
    replay, multiplier = (own, 1.0) if own is not None else (plan, run["rate_multiplier"])
    predicted = predict(arr, profile, replay, slo, multiplier, class_slos)
    speed = run_speed(profile, [i.threads for i in arr.instances], {i.role: i.threads for i in arr.instances}, run)
    again = predict(arr, profile.slowed(speed), replay, slo, multiplier, class_slos) if speed else None
    return predicted, speed, again


def compare_results(profile: Profile, results: dict, target: float = 0.9, with_capacity: bool = True,
                    spec_path: str | None = None) -> dict:
    """Every run the trial made beside the prediction for exactly what it replayed (its own requests
    and send times; a probe replays a prefix of the plan, a fixed-rate run its own length), pooled
    by rate (medians); capacity beside capacity, the prediction searched over the same probe
    workloads the trial's search replays when the spec says what they are.

    A probe that stopped early (it could no longer pass) measured a failure, not an attainment:
    its attainment and times get no error; `held` says whether prediction and run agree."""
    slo, class_slos = _slos(results)
    target = results["slo"].get("attainment", target)
    plan = requests_from_results(results)
    if not plan:
        raise ValueError("results.json has an empty plan: nothing to simulate")
    base, main = offered_rate(plan), _main_multiplier(results)
    settings = _probe_settings(results, spec_path)
    speed_factor = _speed_factor(profile, results)
    priorities = class_priorities(results)
    rows, skipped, at_main, capacities, step_rows = [], [], [], [], []
    for arr_doc in results["arrangements"]:
        launch = arr_doc.get("launch") or {}
        if not launch.get("serve") or not arr_doc["runs"]:
            skipped.append(f"{arr_doc['name']}: {'failed to start' if arr_doc.get('error') else 'not launched by serve'}")
            continue
        arr = launched_arrangement(arr_doc)
        missing = unmodelled(launch["serve"], (profile.raw.get("model") or {}).get("weight_format"))
        if missing:
            skipped.append(f"{arr.name}: simulated without {', '.join(missing)} (not modelled), not ranked")
        threads_by_role = {i.role: i.threads for i in arr.instances}
        by_rate: dict[float, list[tuple[dict, dict]]] = {}
        at_own: dict[float, list[tuple[dict, dict, float]]] = {}  # each run again at its own step speed
        agreeing = {"runs": 0, "profile": 0, "with_steps": 0, "own_steps": 0}
        for run in arr_doc["runs"]:
            predicted, speed, again = simulate_run(arr, profile, run, plan, slo, class_slos, priorities)
            by_rate.setdefault(run["rate_multiplier"], []).append((predicted, run["summary"]))
            agreeing["runs"] += 1
            agreeing["profile"] += _agrees(predicted, run["summary"], target)
            if again is not None:
                at_own.setdefault(run["rate_multiplier"], []).append((again, run["summary"], speed))
                agreeing["with_steps"] += 1
                agreeing["own_steps"] += _agrees(again, run["summary"], target)
        for multiplier in sorted(by_rate):
            pairs = by_rate[multiplier]
            done = [(p, m) for p, m in pairs if not m.get("stopped_early")]
            held = [(p["attainment"] >= target, m["attainment"] >= target) for p, m in pairs]
            for name, get in METRICS:
                p = _group([get(x) for x, _ in pairs])
                m = _median([get(x) for _, x in (done or pairs)])
                error = _error(name, _group([get(x) for x, _ in done]), m) if done else None
                rows.append({"arrangement": arr.name, "rate_multiplier": multiplier, "num_runs": len(pairs),
                             "num_stopped": len(pairs) - len(done), "metric": name, "predicted": p, "measured": m,
                             "error": error, **({"held": held} if name == "attainment" else {})})
                if name == "attainment" and multiplier == main and not missing:
                    at_main.append((arr.name, p, m))
            if multiplier in at_own:  # the same runs simulated at the speed their engines stepped
                runs = at_own[multiplier]
                done = [(p, m) for p, m, _ in runs if not m.get("stopped_early")]
                m = _median([x["attainment"] for _, x, _ in runs if not x.get("stopped_early")]
                            or [x["attainment"] for _, x, _ in runs])
                rows.append({"arrangement": arr.name, "rate_multiplier": multiplier, "num_runs": len(runs),
                             "num_stopped": len(runs) - len(done), "metric": "attainment, own steps",
                             "predicted": _group([p["attainment"] for p, _, _ in runs]), "measured": m,
                             "error": _error("attainment", _group([p["attainment"] for p, _ in done]), m) if done else None,
                             "held": [(p["attainment"] >= target, x["attainment"] >= target) for p, x, _ in runs],
                             "step_speed": [round(v, 4) for _, _, v in runs]})
        ratios = step_ratios(profile, threads_by_role, arr_doc["runs"])
        if ratios:
            step_rows.append({"arrangement": arr.name, **ratios})
        measured_cap = _measured_capacity(arr_doc)
        fitted = _fitted_interval(results, arr_doc["name"])
        if measured_cap is None and fitted is not None:
            measured_cap = fitted["estimate_rps"]

        # the search reaches past every rate the trial ran: a prediction stopped below the trial's own
        # probes (16x, predict.capacity's default) could not be told from a measured lower bound above it
        ceiling = max(16.0, 2.0 * max((r["rate_multiplier"] for r in arr_doc["runs"]), default=1.0))

        def predicted_capacity(prof: Profile) -> float | None:
            if settings is not None:
                workload = lambda m: probe_workload(plan, m, *settings)  # noqa: E731
                cap = capacity(arr, prof, plan, slo, target, class_slos=class_slos, workload=workload,
                               max_multiplier=ceiling)
                return offered_rate(workload(cap)) if cap else None
            cap = capacity(arr, prof, plan, slo, target, class_slos=class_slos,
                           max_multiplier=ceiling)  # the whole plan compressed
            return cap * base if cap else None

        if measured_cap is not None and with_capacity:
            p = predicted_capacity(profile)
            spread = _measured_range(arr_doc)
            rows.append({"arrangement": arr.name, "rate_multiplier": None, "num_runs": None,
                         "metric": f"capacity at {target:.0%}", "predicted": p, "measured": measured_cap,
                         "error": _error("capacity", p, measured_cap),
                         # with repeats, whether the prediction falls where the trial itself landed
                         **({"measured_range": list(spread),
                             "in_measured_range": p is not None and spread[0] <= p <= spread[1]} if spread else {}),
                         # with a fitted curve, whether the prediction falls inside its interval
                         **({"measured_interval": {k: fitted[k] for k in ("kind", "estimate_rps", "lo_rps", "hi_rps")},
                             "in_measured_interval": _inside(p, fitted)} if fitted else {}),
                         "workload": "the trial's probes" if settings is not None else "the whole plan",
                         "runs_agreeing": agreeing})
            if not missing:
                capacities.append((arr.name, p or 0.0, measured_cap))
            if speed_factor is not None:  # the same search on the box as fast as the trial's measured it
                p3 = predicted_capacity(profile.slowed(speed_factor))
                rows.append({"arrangement": arr.name, "rate_multiplier": None, "num_runs": None,
                             "metric": "capacity at the trial's speed", "predicted": p3, "measured": measured_cap,
                             "error": _error("capacity", p3, measured_cap), "speed_factor": round(speed_factor, 4),
                             **({"in_measured_interval": _inside(p3, fitted)} if fitted else {})})
            band = profile.speed_band
            for end, q in SPEED_BAND_ENDS if band else ():
                # the same search at the slow and the fast ends of the speeds the profile itself saw,
                # and at their median (the model is fitted on each step's fastest repeat)
                pb = predicted_capacity(profile.slowed(band[q]))
                rows.append({"arrangement": arr.name, "rate_multiplier": None, "num_runs": None,
                             "metric": f"capacity at the profile's {end} {'speed' if end == 'median' else 'end'}",
                             "band_end": end, "predicted": pb, "measured": measured_cap,
                             "error": _error("capacity", pb, measured_cap), "speed_factor": round(band[q], 4)})
            refitted = refit(profile, trial_samples(threads_by_role, arr_doc["runs"]))
            if refitted:  # the same search with the steps as this trial's engines ran them
                p2 = predicted_capacity(with_models(profile, {t: o.model for t, o in refitted.items()}))
                rows.append({"arrangement": arr.name, "rate_multiplier": None, "num_runs": None,
                             "metric": "capacity, its steps refit", "predicted": p2, "measured": measured_cap,
                             "error": _error("capacity", p2, measured_cap),
                             "refit": {str(t): {"num_steps": o.num_samples, "median_abs_rel_error": o.median_error}
                                       for t, o in refitted.items()}})
    ranking, by = (capacities, "capacity") if capacities else (at_main, f"attainment at x{main:g}")
    top_pred = [n for n, _, _ in sorted(ranking, key=lambda x: -(x[1] or 0))[:2]]
    top_meas = [n for n, _, _ in sorted(ranking, key=lambda x: -(x[2] or 0))[:2]]
    return {"trial": results.get("trial"), "rows": rows, "skipped": skipped, "steps": step_rows,
            "ranking": {"by": by, "predicted_top_two": top_pred, "measured_top_two": top_meas,
                        "same_top_two": top_pred == top_meas}}


def calibrated_profile(profile_doc: dict, results: dict | list[dict], source: str) -> dict:
    """profile_doc (a profile.json's content) with `trial_calibration` from this trial's engine steps:
    per thread count, the step model refitted on every modelled arrangement's steps together, the
    profile without any calibration it had as the prior. ValueError when the trial kept no steps (older results, another server)."""
    base = {k: v for k, v in profile_doc.items() if k != "trial_calibration"}
    profile = parse_profile(base)
    trials = results if isinstance(results, list) else [results]
    arrangements = []
    for arr_doc in (a for r in trials for a in r["arrangements"]):
        launch = arr_doc.get("launch") or {}
        if not launch.get("serve") or unmodelled(launch["serve"], (base.get("model") or {}).get("weight_format")):
            continue
        arr = arrangement_from_serve_args(arr_doc["name"], launch["serve"], launch.get("cores"))
        arrangements.append(({i.role: i.threads for i in arr.instances}, arr_doc.get("runs") or []))
    threads = calibration(profile, arrangements)
    if not threads:
        raise ValueError(f"{source}: no engine steps to calibrate from (the trial must run splitserve serve "
                         "arrangements with a splitserve that answers GET /admin/steps)")
    return {**base, "trial_calibration": {"source": source, "trials": [r.get("trial") for r in trials],
                                          "threads": threads}}


def _cell(metric: str, value) -> str:
    if value is None:
        return "n/a"
    if metric.startswith("attainment"):
        return f"{value:.0%}"
    if metric.startswith("capacity"):
        return f"{value:.2f}/s"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def render(doc: dict) -> str:
    lines = [f"predicted vs measured: {doc['trial']}",
             f"{'arrangement':26} {'rate':>5} {'metric':22} {'predicted':>10} {'measured':>10} {'error':>8}"]
    for r in doc["rows"]:
        err = r["error"]
        err_text = ("n/a" if err is None else
                    f"{err * 100:+.0f} pt" if r["metric"].startswith("attainment") else f"{err:+.0%}")
        rate = "" if r["rate_multiplier"] is None else f"x{r['rate_multiplier']:g}"
        if r.get("num_runs", 1) and r.get("num_runs", 1) > 1:
            rate += f"({r['num_runs']})"
        if r.get("num_stopped"):
            rate += f"S{r['num_stopped']}"
        line = (f"{r['arrangement']:26} {rate:>5} {r['metric']:22} {_cell(r['metric'], r['predicted']):>10} "
                f"{_cell(r['metric'], r['measured']):>10} {err_text:>8}")
        if "measured_range" in r:
            low, high = r["measured_range"]
            line += f"  repeats {low:.2f}-{high:.2f}/s: {'inside' if r['in_measured_range'] else 'outside'}"
        if "measured_interval" in r:
            c = r["measured_interval"]
            where = (f"{c['lo_rps']:.2f}-{c['hi_rps']:.2f}/s" if c["kind"] == "point" else
                     f"{'>=' if c['kind'] == 'at_least' else '<='}{c['estimate_rps']:.2f}/s")
            line += f"  fitted {where}: {'inside' if r['in_measured_interval'] else 'OUTSIDE'}"
        if r.get("step_speed"):
            lo, hi = min(r["step_speed"]), max(r["step_speed"])
            line += f"  (its steps x{lo:.2f}{f'-{hi:.2f}' if hi > lo else ''} the model)"
        if "runs_agreeing" in r:
            a = r["runs_agreeing"]
            line += (f"  runs within {AGREE_POINTS * 100:.0f} points: {a['profile']}/{a['runs']}, at their own step speed "
                     f"{a['own_steps']}/{a['with_steps']}")
        if "speed_factor" in r:
            line += (f"  (the trial's box ran the speed benchmark {1 / r['speed_factor']:.2f}x the profile's; "
                     f"{'inside' if r.get('in_measured_interval') else 'outside'} its interval)")
        lines.append(line)
    if doc.get("steps"):
        lines.append("engine steps in the trial / the profile's step model (median [p10-p90], time-weighted):")
        for r in doc["steps"]:
            for key in sorted(k for k in r if k != "arrangement"):
                entry = r[key]
                parts = [f"{name} {e['median']:.2f} [{e['p10']:.2f}-{e['p90']:.2f}] tw {e['time_weighted']:.2f}"
                         for name, e in (("model", entry["model"]), ("loop", entry.get("loop")),
                                         ("cpu", entry.get("cpu"))) if e]
                if entry.get("on_cpu_share") is not None:
                    parts.append(f"on CPU {entry['on_cpu_share']:.0%}")
                lines.append(f"  {r['arrangement']:26} {key:16} n={entry['model']['num_steps']:6d}  " + "; ".join(parts))
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
    parser.add_argument("--spec", default=None, help="the trial's spec, for its capacity probes (default: the "
                        "spec_path results.json names, when that file exists)")
    parser.add_argument("--calibrate-out", default=None, metavar="PROFILE.json",
                        help="also write the profile calibrated by this trial's engine steps (per thread count, the step "
                             "model refitted on them), for `splitserve plan --profile` and later compares")
    parser.add_argument("--calibrate-with", action="append", default=[], metavar="RESULTS.json",
                        help="more trials whose engine steps the calibration pools with this one's (repeatable)")
    args = parser.parse_args(argv)
    try:
        plan_doc = json.loads(pathlib.Path(args.plan).read_text())
        profile = profile_of(plan_doc, args.plan)
        results = json.loads(pathlib.Path(args.results).read_text())
        doc = compare_results(profile, results, args.target, spec_path=args.spec)
        more = [json.loads(pathlib.Path(path).read_text()) for path in args.calibrate_with]
        calibrated = (calibrated_profile(profile.raw, [results, *more], ", ".join([args.results, *args.calibrate_with]))
                      if args.calibrate_out else None)
    except (OSError, json.JSONDecodeError, ProfileError, SpecError, ValueError, KeyError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(render(doc))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1))
    if calibrated is not None:
        pathlib.Path(args.calibrate_out).write_text(json.dumps(calibrated, indent=1))
        factors = ", ".join(f"{t} thread(s): {e['num_steps']} steps, fit within {e['median_abs_rel_error']:.0%} (median)"
                            for t, e in calibrated["trial_calibration"]["threads"].items())
        print(f"calibrated profile: {args.calibrate_out} ({factors})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
