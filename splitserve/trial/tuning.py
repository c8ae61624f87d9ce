"""The strongest colocated baseline: try a small grid of colocated settings, keep the best.

Each grid point (method.grid_arrangements: chunk token budget x instances x threads) gets
its own launch and one probe (the capacity search's short replay, stopped once it cannot
pass) at the lowest rate the reference failed in its calibration (else its capacity, or the
fixed rate without a capacity search): a rate where settings differ. The point identical to
the base arrangement is not launched again: the base's own probe at that rate is reused. The best (most requests good, then the lowest
p99 TTFT) joins the trial as `colocated-best`, unless it is the base itself; its capacity search,
which starts at that same rate, takes the grid point's probe as its first.
"""
from __future__ import annotations

import dataclasses
import math

from splitserve.trial.arrangements import LaunchError, launched
from splitserve.trial.method import grid_arrangements
from splitserve.trial.resources import arrangement_resources, with_kv_split


def _flags(args: list[str]) -> dict[str, str]:
    return {a: (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
            for i, a in enumerate(args) if a.startswith("--")}


def tune_colocated(trial) -> dict:
    spec = trial.spec
    base = next(a for a in spec.arrangements if a.name == spec.tune.base)
    points = grid_arrangements(spec.tune, base, spec.cores)
    rel = spec.arrivals.relative_rate
    rate = trial.main_multiplier / rel.fraction_of_capacity if rel else trial.main_multiplier
    # Probe where settings differ: the lowest rate the reference failed (its failing probe is
    # reused), not its capacity, where every setting may keep all requests good and the tie
    # would go to noise (a run once kept the weaker 1x2 over 2x1 on p99 TTFT that way).
    failed = [p["multiplier"] for p in (trial.calibration or {}).get("probes", [])
              if p["attainment"] < spec.slo.attainment and p["multiplier"] > rate]
    if failed:
        rate = min(failed)
    base_runs = [r for r in trial.results[base.name].runs if r.purpose in ("probe", "fixed")
                 and math.isclose(r.rate_multiplier, rate)]
    probe_size = spec.capacity.probe_requests if spec.capacity else 24
    rows, runs = [], {}
    for point in points:
        row = {"name": point.name, "serve": point.serve_args, "error": None, "attainment": None,
               "ttft_p99_s": None, "reused": None}
        if _flags(point.serve_args) == _flags(base.serve_args) and base_runs:
            summary, row["reused"] = base_runs[0].summary, base.name
        else:
            summary = None
            try:
                with launched(with_kv_split(point, spec.kv_cache_memory), spec.model, trial.out_dir / "logs",
                              cpus=trial.cpus) as endpoint:
                    trial._warm_up(endpoint)
                    run = trial._probe(endpoint, point.name, rate, 0, probe_size, 1)
                    summary, runs[point.name] = run.summary, run
            except LaunchError as exc:
                row["error"] = str(exc)
            trial.budget.spent(0.5)
        if summary is not None:
            row["attainment"], row["ttft_p99_s"] = summary["attainment"], summary["ttft_s"]["p99"]
        rows.append(row)
    tuning = {"base": base.name, "rate_multiplier": rate, "points": rows, "best": None}
    ran = [(row, p) for row, p in zip(rows, points) if row["attainment"] is not None]
    if ran:
        row, best = max(ran, key=lambda rp: (rp[0]["attainment"], -(rp[0]["ttft_p99_s"] or math.inf)))
        tuning["best"] = row["name"]
        if row["reused"] is None:
            tuned = dataclasses.replace(best, name="colocated-best", grid_point=False)
            trial.arrangements.insert(1, tuned)
            trial.resources[tuned.name] = arrangement_resources(with_kv_split(tuned, spec.kv_cache_memory))
            tuning["joins_as"] = tuned.name
            # its search starts at this same rate: the grid's probe is that first probe
            trial.tuning_probes[tuned.name] = runs[row["name"]]
        else:
            tuning["joins_as"] = None  # the base already is the best setting found
    return tuning
