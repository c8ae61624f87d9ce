"""Pool several profiles of one box into one: every step sample and every drift reading of each.

A profile times its steps over a few minutes; on a shared VM the step time of the minute drifts
(session 37: two profiles 80 minutes apart differ by up to 20% on a prompt step, and a trial's own
steps by more). A trial between two profiles ran at some speed between theirs, so the check that a
plan predicts the trial can read a profile pooled from one taken before and one after: each step
shape keeps its samples from both (the model is fitted on all of them, each sample by the
profile's own statistic: the fastest of its repeats, or the median beside busy neighbours), the
drift readings of both feed the slow/fast band. Everything else (machine, KV link, start times,
host work) is the first profile's. This is the speed of the hour, measured twice; it is not a
calibration by the trial (nothing of the trial is read).

    python bench/pool_profiles.py A.json B.json [C.json ...] --out pooled.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path


def pool(docs: list[dict]) -> dict:
    if len(docs) < 2:
        raise ValueError("pool: give at least two profiles")
    models = {json.dumps(d.get("model"), sort_keys=True) for d in docs}
    if len(models) != 1:
        raise ValueError("pool: the profiles are of different models")
    out = copy.deepcopy(docs[0])
    out.pop("trial_calibration", None)
    for threads, entry in out["threads"].items():
        for other in docs[1:]:
            theirs = other["threads"].get(threads)
            if theirs is None:
                raise ValueError(f"pool: a profile has no {threads}-thread entry")
            entry["samples"] = entry["samples"] + theirs["samples"]
            entry.pop("step_model", None)   # refitted from the pooled samples when read
            if "contended" in entry and "contended" in theirs:
                entry["contended"]["samples"] += theirs["contended"]["samples"]
                entry["contended"].pop("step_model", None)
            elif "contended" in entry:
                entry.pop("contended")      # one side unmeasured: no pooled contention
            if "drift" in entry and "drift" in theirs:
                entry["drift"]["readings"] = entry["drift"]["readings"] + theirs["drift"]["readings"]
    out["pooled_from"] = [{"created_unix": d.get("created_unix"),
                           "speed_units_per_s": d.get("machine", {}).get("speed_units_per_s")} for d in docs]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        pooled = pool([json.loads(p.read_text()) for p in args.profiles])
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(pooled, indent=1))
    print(f"wrote {args.out}: {len(args.profiles)} profiles pooled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
