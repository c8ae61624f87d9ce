"""Issue 28: is a probe's miss the box's speed that minute, or the simulator's scheduling?

compare's "its steps refit" column refits the step model on every step an arrangement ran in a
trial, pooled over its runs; on a VM whose speed moves 30% probe to probe (the host-speed loop
between probes ranged 68-116% of its median in session 34's chat_only), one slow probe at a
cliff can miss while the pooled steps read near the model. This simulates each run of each
arrangement on exactly the requests it replayed, three ways:

    profile   the profile as it is (compare's per-run prediction)
    own       the profile's step models times that run's own time-weighted ratio of measured to
              modelled step time (its engines' steps, GET /admin/steps as the trial kept them,
              against the models the simulation uses: trial_steps.run_speed)

and prints measured attainment beside both (compare pools the same by rate and counts it per
arrangement; this lists every run). Where `own` lands on the measured attainment and
`profile` does not, that run's miss is its step time (the box that minute); where neither does,
it is the simulation's scheduling. A diagnosis of finished trials, not a calibration: nothing is
written back to the profile.

    python bench/run_steps.py PROFILE.json RESULTS.json [--arrangement NAME] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys

from splitserve.control.compare import _slos, class_priorities, launched_arrangement, simulate_run
from splitserve.control.predict import requests_from_results
from splitserve.control.profile_file import load_profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("results")
    ap.add_argument("--arrangement", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    with open(args.results) as f:
        results = json.load(f)
    slo, class_slos = _slos(results)
    out = []
    print(f"{'arrangement':22} {'purpose':6} {'rate':>7} {'n':>4}  measured  profile  own (step ratio)  speed loop")
    plan, priorities = requests_from_results(results), class_priorities(results)
    for arr_doc in results["arrangements"]:
        launch = arr_doc.get("launch") or {}
        if not launch.get("serve") or (args.arrangement and arr_doc["name"] != args.arrangement):
            continue
        arr = launched_arrangement(arr_doc)
        for run in arr_doc.get("runs") or []:
            predicted, ratio, at_own = simulate_run(arr, profile, run, plan, slo, class_slos, priorities)
            measured = run["summary"]["attainment"]
            stopped = " (stopped early)" if run["summary"].get("stopped_early") else ""
            speed = run["summary"].get("speed_units_per_s")
            print(f"{arr_doc['name']:22} {run['purpose']:6} x{run['rate_multiplier']:<6.3g} "
                  f"{len(run.get('requests') or ()):4d}  {measured:7.0%}  {predicted['attainment']:7.0%}  "
                  + (f"{at_own['attainment']:4.0%} (x{ratio:.2f})" if ratio else "   -          ")
                  + (f"  {speed:6.0f}" if speed else "") + stopped)
            out.append({"arrangement": arr_doc["name"], "purpose": run["purpose"],
                        "rate_multiplier": run["rate_multiplier"], "num_requests": len(run.get("requests") or ()),
                        "stopped_early": bool(run["summary"].get("stopped_early")),
                        "measured": measured, "predicted": predicted["attainment"], "step_ratio": ratio,
                        "predicted_at_own_steps": at_own["attainment"] if at_own else None,
                        "speed_units_per_s": speed})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": args.profile, "results": args.results, "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
