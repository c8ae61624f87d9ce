"""`splitserve plan SPEC.yaml --profile profile.json [--cores N] [--rate R]`: predict, rank, recommend.

Reads the trial spec (workload, arrivals, SLOs, sweep target) and a profile, enumerates the
arrangements that fit N cores (control/planner.py), simulates each (control/simulator.py),
prints a ranked table and the recommendation with its reason, and writes plan.json. No model
is loaded and no server started: a plan takes seconds.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="trial spec (YAML): its workload, arrivals and SLOs are planned for")
    parser.add_argument("--profile", required=True, help="profile.json from `splitserve profile` (or hand-written)")
    parser.add_argument("--cores", type=int, default=None,
                        help="cores to plan for (default: the spec's arrangements' cores, else 2)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=None, help="plan at this many requests/s (the spec's "
                      "arrivals compressed in time, as a sweep does)")
    rate.add_argument("--rate-multiplier", type=float, default=None, help="plan at the spec's rate times this")
    parser.add_argument("--target", type=float, default=None,
                        help="attainment target for capacity (default: the spec's sweep target, else 0.9)")
    parser.add_argument("--threads", default=None,
                        help="per-instance thread counts to consider, e.g. 1 or 1,2 (default: divisors of --cores "
                             "and powers of two); with a profile of one accelerator per instance, use 1")
    parser.add_argument("--budgets", default="64,128,256,512,1024", help="chunk budgets to try for colocated engines")
    parser.add_argument("--transport", default="shm", help="KV transport of separated arrangements (default shm)")
    parser.add_argument("--disagg-policies", default="always,threshold,auto",
                        help="where separated arrangements prefill each prompt, each tried (serve --disagg-policy; "
                             "auto with the spec's TTFT and gap targets). Default: always,threshold,auto")
    parser.add_argument("--max-instances", type=int, default=64, help="most engine instances in one arrangement")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV pool per instance (default: the spec's kv_cache_memory split between an "
                             "arrangement's instances when the spec sets one, else serve's 1GiB each)")
    parser.add_argument("--min-requests", type=int, default=400,
                        help="repeat the spec's workload back to back until it has this many requests (default 400)")
    parser.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    parser.add_argument("--no-capacity", action="store_true", help="skip the capacity search (faster)")
    parser.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")


def _positive(value, flag: str) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{flag}: must be positive, got {value}")


def format_table(doc: dict, top: int) -> str:
    from splitserve.trial.metrics import local_share
    head = (f"{'#':>3} {'arrangement':28} {'cores':>5} {'attain':>7} {'capacity':>9} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'gap p99':>8} {'pause p99':>9} {'worst SLO':>16} {'local':>6}")
    repeated = (f": the spec's {doc['spec_num_requests']} repeated" if doc["num_requests"] > doc["spec_num_requests"]
                else "")
    lines = [f"plan for {doc['spec']}: {doc['cores']} cores, {doc['rate_rps']:.2f} req/s "
             f"({doc['num_requests']} requests{repeated}), target {doc['target_attainment']:.0%}", head]

    def s(x):
        return "n/a" if x is None else (f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s")

    for i, a in enumerate(doc["arrangements"][:top], 1):
        p = a["predicted"]
        cap = (">=" if a["capacity_is_floor"] else "") + f"{a['capacity_rps']:.2f}/s" if a["capacity_rps"] else "-"
        share = local_share(p.get("prefill"))  # prompts the decode instances prefilled (threshold, auto)
        lines.append(f"{i:3d} {a['name']:28} {a['cores']:5d} {p['attainment']:7.0%} {cap:>9} "
                     f"{s(p['ttft_s']['p50']):>9} {s(p['ttft_s']['p99']):>9} {s(p['gap_s']['p99']):>8} "
                     f"{s(p['longest_pause_s']['p99']):>9} {p['worst_slo'] or '-':>16} "
                     f"{'-' if share is None else f'{share:.0%}':>6}")
    if len(doc["arrangements"]) > top:
        lines.append(f"    ... {len(doc['arrangements']) - top} more in the plan file")
    lines.append(doc["recommendation"]["reason"])
    lines.append(f"Step times: {doc['step_times_beside_neighbours']}.")
    lines.append(f"Host work: {doc['host_work']}.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from splitserve.config import parse_size
    from splitserve.control.planner import enumerate_arrangements, evaluate, plan_document, speed_band_capacities
    from splitserve.control.predict import DisaggSpec, offered_rate, requests_from_spec, tile
    from splitserve.control.profile_file import ProfileError, load_profile
    from splitserve.trial.spec import SpecError, load_spec

    try:
        for value, flag in ((args.rate, "--rate"), (args.rate_multiplier, "--rate-multiplier"),
                            (args.cores, "--cores"), (args.max_instances, "--max-instances"),
                            (args.min_requests, "--min-requests")):
            _positive(value, flag)
        if args.target is not None and not 0 < args.target <= 1:
            raise ValueError(f"--target: an attainment fraction in (0, 1], got {args.target}")
        try:
            budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        except ValueError:
            raise ValueError(f"--budgets: comma-separated token counts like 128,256; got {args.budgets!r}") from None
        try:
            threads = [int(t) for t in args.threads.split(",") if t.strip()] if args.threads else None
        except ValueError:
            raise ValueError(f"--threads: comma-separated whole numbers like 1,2; got {args.threads!r}") from None
        policies = [p.strip() for p in args.disagg_policies.split(",") if p.strip()]
        if not policies or len(set(policies)) < len(policies):
            raise ValueError(f"--disagg-policies: distinct names from always, threshold, auto; got "
                             f"{args.disagg_policies!r}")
        profile = load_profile(args.profile)
        profile.transfer_s(args.transport, 1)  # fails now, naming the field, if the profile lacks it
        spec = load_spec(args.spec)
        spec_requests = requests_from_spec(spec)
        requests = tile(spec_requests, args.min_requests)
        cores = args.cores or next((a.cores for a in spec.arrangements if a.cores), 2)
        target = (args.target or getattr(spec.slo, "attainment", None)
                  or (spec.sweep.target_attainment if spec.sweep else 0.9))
        kv_total = getattr(spec, "kv_cache_memory", None) if args.kv_cache_memory is None else None
        spec_cores = spec.cores or cores
        # The spec's KV pool is sized for its own cores: a plan for more cores gets proportionally
        # more (a 2-core spec's 1 GiB split 64 ways would not hold one long prompt per instance).
        kv_total_bytes = parse_size(kv_total) * max(1, cores // spec_cores) if kv_total else None
        multiplier = args.rate_multiplier or (args.rate / offered_rate(requests) if args.rate else 1.0)
        # auto weighs serve's targets: the spec's TTFT and gap deadlines
        disagg = tuple(DisaggSpec(p, slo_ttft_s=spec.slo.ttft_s, slo_gap_s=spec.slo.gap_s) if p == "auto" else
                       DisaggSpec(p) for p in policies)
        arrangements = enumerate_arrangements(cores, budgets, args.transport, args.max_instances,
                                              parse_size(args.kv_cache_memory or "1GiB"), threads=threads,
                                              kv_total_bytes=kv_total_bytes, disagg=disagg)
        start = time.perf_counter()
        ranked = evaluate(arrangements, profile, requests, spec.slo, target, multiplier,
                          with_capacity=not args.no_capacity, class_slos=spec.class_slos)
        band_caps = speed_band_capacities(ranked, profile, requests, spec.slo, target, multiplier, spec.class_slos)
        doc = plan_document(ranked, profile, requests, spec.slo, target, multiplier, cores, spec.name,
                            str(spec.source) if spec.source else None, band_caps)
        doc["seconds_to_plan"] = time.perf_counter() - start
        doc["spec_num_requests"] = len(spec_requests)
    except (SpecError, ProfileError, ValueError, OSError) as exc:
        print(f"splitserve plan: {exc}", file=sys.stderr)
        return 2
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=1))
    print(format_table(doc, args.top))
    print(f"{len(ranked)} arrangements simulated in {doc['seconds_to_plan']:.1f} s; wrote {args.out}")
    return 0
