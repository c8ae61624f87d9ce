"""Issue 28: where a trial's prompt steps part from the profile. Every engine step a trial kept,
against the profile's step model for the same shape (the model the simulator uses for that
arrangement: the steps timed beside busy engines where it has several instances), split by

    kind     decode-only, or with prompt tokens (under / at least 128 of them)
    start    where the step's prompt chunk starts: 0 (a request's first step), under 64 tokens
             in (a cached prefix), or further (a later chunk of a long prompt); read back from
             prefill_attn_ktok2 = chunk * (start + chunk / 2) / 1000, exact for one chunk a step
    beside   no decodes in the step, or some
    turn     'busy': the engine loop ran straight on from the turn before (loop_seconds > 0);
             'after-wait': it had waited for work (a first step after idling)
    batch    how many decodes ran in the step: d0, d1-4, d5-8, d9-16, d17-32, d33+ (whether a
             miss grows with the batch, a shape the profile samples sparsely, or stays flat)

with the median and time-weighted ratio of measured to modelled seconds, and, where the engines
sent it (cpu_seconds; 1-thread instances only), the ratio of the engine thread's CPU time to the
model and the share of the steps' wall time that thread was on a core.

    python bench/step_split.py PROFILE.json RESULTS.json [RESULTS.json ...] [--by kind,start,beside,turn,batch]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from splitserve.control.compare import arrangement_from_serve_args
from splitserve.control.profile_file import load_profile
from splitserve.control.trial_steps import instance_steps

def labels(p: int, attn: float, d: int, loop: float) -> dict[str, str]:
    start = attn * 1000 / p - p / 2 if p else 0.0
    return {"kind": ("decode" if not p else "prompt<128" if p < 128 else "prompt>=128"),
            "start": "-" if not p else "start0" if start < 1 else "start<64" if start < 64 else "start>=64",
            "beside": "alone" if not d else "+decodes",
            "turn": "busy" if loop > 0 else "after-wait",
            "batch": batch_label(d)}


def batch_label(d: int) -> str:
    for hi, name in ((0, "d0"), (4, "d1-4"), (8, "d5-8"), (16, "d9-16"), (32, "d17-32")):
        if d <= hi:
            return name
    return "d33+"


def split(profile, results: dict, by: list[str]) -> list[dict]:
    rows = []
    for arr in results["arrangements"]:
        launch = (arr.get("launch") or {}).get("serve")
        if not launch:
            continue
        shape = arrangement_from_serve_args(arr["name"], launch, 2)
        threads_by_role = {i.role: i.threads for i in shape.instances}
        models, _ = profile.instance_models([i.threads for i in shape.instances])
        model_of = {i.threads: m for i, m in zip(shape.instances, models)}
        groups: dict[tuple, list[tuple[float, float, float]]] = {}
        for _role, threads, shape_, seconds, loop, cpu in instance_steps(threads_by_role, arr.get("runs") or []):
            predicted = model_of[threads].predict(shape_)
            tags = labels(shape_.prefill_tokens, shape_.prefill_attn_ktok2, shape_.decode_seqs, float(loop))
            groups.setdefault(tuple(tags[k] for k in by), []).append((seconds, predicted, cpu))
        for key, values in sorted(groups.items()):
            rows.append({"arrangement": arr["name"], "group": dict(zip(by, key)), **ratio_row(values)})
    return rows


def ratio_row(values: list[tuple[float, float, float]]) -> dict:
    """(measured s, modelled s, engine-thread CPU s; 0 where unknown) per step: their count, the
    median and time-weighted ratio of measured to modelled, and, over the steps with a CPU time,
    the CPU time over the model and over the wall time."""
    ratios = [s / p for s, p, _ in values if p > 0]
    timed = [(s, p, c) for s, p, c in values if c > 0]
    return {"num_steps": len(values), "median": statistics.median(ratios),
            "time_weighted": sum(s for s, _, _ in values) / sum(p for _, p, _ in values),
            "cpu_time_weighted": sum(c for _, _, c in timed) / sum(p for _, p, _ in timed) if timed else None,
            "on_cpu_share": sum(c for _, _, c in timed) / sum(s for s, _, _ in timed) if timed else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("results", nargs="+")
    parser.add_argument("--by", default="kind,start,beside")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    by = [x.strip() for x in args.by.split(",") if x.strip()]
    unknown = set(by) - {"kind", "start", "beside", "turn", "batch"}
    if unknown:
        parser.error(f"--by: unknown {sorted(unknown)}; choose from kind, start, beside, turn, batch")
    profile = load_profile(args.profile)
    out = []
    for path in args.results:
        with open(path) as f:
            rows = split(profile, json.load(f), by)
        print(path)
        for r in rows:
            cpu = (f"  cpu/model tw {r['cpu_time_weighted']:.2f}, on CPU {r['on_cpu_share']:.0%}"
                   if r["cpu_time_weighted"] is not None else "")
            print(f"  {r['arrangement']:22} {' '.join(r['group'].values()):34} n={r['num_steps']:5d}  "
                  f"median {r['median']:.2f}  tw {r['time_weighted']:.2f}{cpu}")
        out.append({"results": path, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
