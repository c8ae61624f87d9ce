"""The trial's results as one JSON document, and the readings every view of it shares.

`results_document` gathers the spec's essentials, the plan, how resources were enforced, and
for each arrangement every launch, capacity search and run (with every request's timeline).
The verdict and the reports read only this document, so a saved results.json can be re-judged
without rerunning anything.
"""
from __future__ import annotations

import dataclasses
import math
import re

from splitserve.trial.capacity import spread
from splitserve.trial.spec import Arrangement, TrialSpec

COMPARED = ("fixed", "sweep")  # runs of the whole plan; probes and tuning runs are not compared

PLACEMENT = ("the server (frontend) and its engines are pinned to the same cores in every arrangement "
             "(sched_setaffinity before exec; engines inherit it); the load generator is the trial's own "
             "process, left on every core it may use, the same for every arrangement")


def arrangement_kind(arr: Arrangement) -> str:
    """'separated' when prefill and decode run on different instances; 'adaptive' for a server
    that moves instances between roles itself (`serve --adaptive`); else 'colocated' or 'external'."""
    args = arr.serve_args or arr.command or []
    if "--adaptive" in args:
        return "adaptive"
    if "--prefill" in args or re.search(r"\d+P\d+D", arr.name):
        return "separated"
    return "external" if arr.url else "colocated"


TUNING_RUN_FIELDS = ("offered_rate_rps", "num_requests", "num_good", "wall_s", "round", "host", "disturbed",
                     "attempt", "speed_units_per_s", "idle_cpu_share")


def tuning_runs(trial, named) -> list[dict]:
    """The tuning grid's probes that did not join the trial (their capacities are in `tuning`):
    what the host watch saw of each, so a disturbed grid probe and its redo are counted with the
    rest (quote.host_summary), not lost with the points that stopped."""
    if trial is None:
        return []
    out = []
    for name, res in trial.results.items():
        if name in named:
            continue
        for run in res.runs:
            out.append({"name": name, "purpose": run.purpose, "rate_multiplier": run.rate_multiplier,
                        "repeat": run.repeat,
                        "summary": {k: run.summary.get(k) for k in TUNING_RUN_FIELDS if k in run.summary}})
    return out


def results_document(spec: TrialSpec, plan, results, sweep: bool, trial=None) -> dict:
    """`trial` (a runner.Trial) adds the order, calibration, tuning and resources it enforced."""
    by_name = {a.name: a for a in (trial.arrangements if trial else spec.arrangements)}
    doc = {
        "trial": spec.name,
        "seed": spec.seed,
        "spec_path": str(spec.source) if spec.source else None,
        "model": spec.model,
        "slo": dataclasses.asdict(spec.slo),
        "classes": {name: {"slo": dataclasses.asdict(cls.slo or spec.slo),
                           "patience": dataclasses.asdict(cls.patience) if cls.patience else None,
                           "priority": cls.priority} for name, cls in spec.classes.items()},
        "pause_threshold_s": spec.pause_threshold_s,
        "sweep": sweep,
        "repeat": len(trial.order) if trial else 1,
        "order": trial.order if trial else [[r.name for r in results]],
        "calibration": trial.calibration if trial else None,
        "tuning": trial.tuning if trial else None,
        "side_by_side": trial.side_by_side if trial else [],
        "rounds": trial.rounds if trial else [],
        "capacity_precision": spec.capacity.precision if spec.capacity else 0.1,
        "placement": PLACEMENT,
        "cpus": trial.cpus if trial else None,
        "kv_cache_memory_total": spec.kv_cache_memory,
        "plan": [{"index": r.index, "class": r.class_name, "send_at_s": r.send_at_s,
                  "num_prompt_tokens": r.num_prompt_tokens, "max_tokens": r.max_tokens} for r in plan or []],
        "arrangements": [],
        "tuning_runs": tuning_runs(trial, by_name),
    }
    for res in results:
        arr = by_name[res.name]
        resources = trial.resources.get(res.name) if trial else None
        caps = getattr(res, "capacity", [])
        doc["arrangements"].append({
            "name": res.name,
            "kind": arrangement_kind(arr),
            "launch": {"serve": arr.serve_args, "command": arr.command, "url": arr.url, "cores": arr.cores},
            "network": arr.network.describe() if arr.network else None,
            "resources": ({**dataclasses.asdict(resources), "describe": resources.describe()}
                          if resources else None),
            "launches": getattr(res, "launches", []),
            "error": res.error,
            "capacity": caps,
            "capacity_rps": spread([c["capacity_rps"] for c in caps]) if caps else None,
            "class_capacity_rps": class_capacity(res.runs, spec.slo.attainment),
            "probe_prefill_by_class": probe_prefill(res.runs),
            "cost_per_hour": spec.cost_per_hour(arr),
            "runs": [{"rate_multiplier": run.rate_multiplier, "repeat": getattr(run, "repeat", 0),
                      "purpose": getattr(run, "purpose", "fixed"), "summary": run.summary,
                      "server_counters": run.server_counters,
                      "requests": [dataclasses.asdict(r) for r in run.records]} for run in res.runs],
        })
    from splitserve.trial.quote import quote
    from splitserve.trial.verdict import verdict

    doc["quote"] = quote(doc)
    doc["verdict"] = verdict(doc)
    return doc


def class_capacity(runs, target: float) -> dict[str, float | None]:
    """Per class, the highest offered rate (of the whole mix) of a capacity probe at which that
    class kept `target` of its requests good. Read from the overall search's probes: a probe is
    stopped once the mix fails, so a class's figure is what those probes showed, a lower bound."""
    out: dict[str, float | None] = {}
    for run in runs:
        if getattr(run, "purpose", "fixed") != "probe":
            continue
        for name, group in run.summary.get("by_class", {}).items():
            held = group["attainment"] >= target and run.summary.get("offered_rate_rps")
            best = out.get(name)
            out[name] = max(best or 0.0, run.summary["offered_rate_rps"]) if held else best
    return out


def probe_prefill(runs) -> dict[str, dict]:
    """Per class, where the server prefilled the prompts of all capacity probes together."""
    out: dict[str, dict] = {}
    for run in runs:
        if getattr(run, "purpose", "fixed") != "probe":
            continue
        for name, group in run.summary.get("by_class", {}).items():
            counts = out.setdefault(name, {"local": 0, "remote": 0})
            for where in counts:
                counts[where] += (group.get("prefill") or {}).get(where, 0)
    return out


def good_per_cost(summary: dict, cost_per_hour: float | None) -> dict | None:
    """Good requests per unit of cost (per hour of the arrangement's price), per class and overall."""
    if not cost_per_hour:
        return None
    out = {name: g.get("goodput_rps", 0.0) * 3600 / cost_per_hour for name, g in summary["by_class"].items()}
    out["overall"] = summary["goodput_rps"] * 3600 / cost_per_hour
    return out


def compared_runs(arr_doc: dict) -> list[dict]:
    return [r for r in arr_doc["runs"] if r.get("purpose", "fixed") in COMPARED]


def equal_rate(doc: dict) -> float | None:
    """The rate multiplier every arrangement that ran was measured at: the fixed rate when all
    have it, else the highest one all share (a sweep that stopped early ran fewer)."""
    sets = [{r["rate_multiplier"] for r in compared_runs(a)} for a in doc["arrangements"] if compared_runs(a)]
    if not sets:
        return None
    common = set.intersection(*sets)
    fixed = [r["rate_multiplier"] for a in doc["arrangements"] for r in a["runs"] if r.get("purpose") == "fixed"]
    if fixed and fixed[0] in common:
        return fixed[0]
    return max(common) if common else None


def summaries_at(arr_doc: dict, multiplier: float) -> list[dict]:
    """One summary per repeat at this rate."""
    seen, out = set(), []
    for r in compared_runs(arr_doc):
        if math.isclose(r["rate_multiplier"], multiplier) and r.get("repeat", 0) not in seen:
            seen.add(r.get("repeat", 0))
            out.append(r["summary"])
    return out


STAT_KEYS = {
    "attainment": lambda s: s["attainment"],
    "goodput_rps": lambda s: s["goodput_rps"],
    "ttft_p99_s": lambda s: s["ttft_s"]["p99"],
    "tpot_p50_s": lambda s: s["tpot_s"]["p50"],
    "gap_p99_s": lambda s: s["gap_s"]["p99"],
    "longest_pause_p99_s": lambda s: s["longest_pause_s"]["p99"],
    "interrupted_share": lambda s: s["interrupted_share"],
}


def stats_at(arr_doc: dict, multiplier: float) -> dict | None:
    """Median and min-max over repeats of each compared metric at this rate."""
    summaries = summaries_at(arr_doc, multiplier)
    if not summaries:
        return None
    out = {key: spread([get(s) for s in summaries]) for key, get in STAT_KEYS.items()}
    out["num_repeats"] = len(summaries)
    return out


def main_summary(arr_doc: dict, multiplier: float | None = None) -> dict | None:
    """The first repeat's summary at the compared rate (or its first whole-plan run)."""
    runs = compared_runs(arr_doc)
    if multiplier is not None:
        at = summaries_at(arr_doc, multiplier)
        if at:
            return at[0]
    return runs[0]["summary"] if runs else None


def fmt_seconds(x: float | None) -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "never (failed)"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_capacity(arr_doc: dict, repeats: int) -> str:
    """'0.912 req/s' (median and range over repeats), or 'none held (< 0.092)' when no rate passed."""
    sp = arr_doc.get("capacity_rps")
    if not sp:
        return "-"
    if not sp["max"]:
        failed = [c["failed_rps"] for c in arr_doc.get("capacity", []) if c.get("failed_rps")]
        return f"none held (< {min(failed):.3f} req/s)" if failed else "none held"
    return fmt_spread(sp, lambda x: f"{x:.3f} req/s", repeats)


def fmt_spread(sp: dict | None, fmt, repeats: int) -> str:
    """'0.91 req/s' for one run; '0.91 (0.85-0.95)' (median, min-max) over repeats."""
    if sp is None or sp["median"] is None:
        return "n/a"
    if repeats <= 1 or sp["min"] == sp["max"]:
        return fmt(sp["median"])
    return f"{fmt(sp['median'])} ({fmt(sp['min'])}-{fmt(sp['max'])})"
