"""Issue 31's table for one trial with --repeat: per arrangement, over its fixed-rate runs, overall
attainment (median, min-max), attainment per phase (median), longest pause p99 (median, min-max),
role changes per run and per minute of run, and the knob moves; then adaptive against the best
fixed arrangement (by median attainment) on the issue's three rules.

    python bench/mix_summary.py RESULTS.json [--json OUT] [--misses]

--misses adds, for every request an adaptive run did not answer within all its deadlines, which
deadline it missed and what the server had set when it was sent: the roles, the chunk budget and
the stream caps in force, and the controller's last word before it (session 32: demand_rotation's
last-phase chats were held by a stream cap of 2 per instance read while the summaries filled the
window).

Reads what the trial wrote (results.json); computes nothing the report does not, only lays it out
the way docs/benchmarks.md ("Adaptive stage mix") tables it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def _fixed_runs(arr: dict) -> list[dict]:
    return [r for r in arr.get("runs") or [] if r.get("purpose") == "fixed"]


def _span(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _host(summaries: list[dict]) -> dict | None:
    """The watched host over the runs (trials since session 24 watch every fixed-rate run): the
    machine's speed before each (a fixed CPU benchmark, units/s), the most of the cores others and
    steal took, the runs flagged disturbed, the engine's median decode-only step. None for older
    results."""
    watched = [s for s in summaries if s.get("host")]
    if not watched:
        return None
    steps = [s["decode_step_median_s"] for s in watched if s.get("decode_step_median_s")]
    return {"speed_units_per_s": _span([s["speed_units_per_s"] for s in watched if s.get("speed_units_per_s")]),
            "others_share_max": max(s["host"]["others_share"] for s in watched),
            "steal_share_max": max(s["host"]["steal_share"] for s in watched),
            "disturbed": sum(bool(s.get("disturbed")) for s in watched), "watched": len(watched),
            "decode_step_median_s": _span(steps)}


def summarize(results: dict) -> dict:
    out = {"trial": results.get("trial"), "arrangements": []}
    for arr in results["arrangements"]:
        runs = _fixed_runs(arr)
        if not runs:
            continue
        summaries = [r["summary"] for r in runs]
        phases = [[p["attainment"] for p in s.get("by_phase") or []] for s in summaries]
        num_phases = max((len(p) for p in phases), default=0)
        by_phase = [statistics.median([p[i] for p in phases if i < len(p)]) for i in range(num_phases)]
        phase_requests = [p["num_requests"] for p in (summaries[0].get("by_phase") or [])]
        timelines = [s.get("role_timeline") or {} for s in summaries]
        changes = [len(t.get("changes") or []) for t in timelines] if any(timelines) else None
        minutes = [s["makespan_s"] / 60 for s in summaries]
        out["arrangements"].append({
            "name": arr["name"],
            "num_runs": len(runs),
            "rate_multiplier": runs[0].get("rate_multiplier"),
            "num_requests": summaries[0]["num_requests"],
            "attainment": _span([s["attainment"] for s in summaries]),
            "attainment_per_run": [s["attainment"] for s in summaries],
            "by_phase_median": by_phase,
            "phase_requests": phase_requests,
            "longest_pause_p99_s": _span([s["longest_pause_s"]["p99"] for s in summaries]),
            "role_changes": changes,
            "role_changes_per_minute": ([c / m for c, m in zip(changes, minutes)] if changes is not None else None),
            "failures": [s.get("failures") for s in summaries],
            "host": _host(summaries),
        })
    fixed = [a for a in out["arrangements"] if a["role_changes"] is None]
    adaptive = [a for a in out["arrangements"] if a["role_changes"] is not None]
    if fixed and adaptive:
        best = max(fixed, key=lambda a: a["attainment"]["median"])
        for a in adaptive:
            per_phase = [max(f["by_phase_median"][i] for f in fixed if i < len(f["by_phase_median"]))
                         for i in range(len(a["by_phase_median"]))]
            a["against_best_fixed"] = {
                "best_fixed": best["name"],
                "overall_points": 100 * (a["attainment"]["median"] - best["attainment"]["median"]),
                "phase_points_vs_best_in_phase": [100 * (x - b) for x, b in zip(a["by_phase_median"], per_phase)],
                "pause_p99_vs_best_fixed_s": a["longest_pause_p99_s"]["median"] - best["longest_pause_p99_s"]["median"],
                "overall_at_least_best": a["attainment"]["median"] >= best["attainment"]["median"],
                "no_phase_5_points_below": all(100 * (x - b) >= -5 for x, b in zip(a["by_phase_median"], per_phase)),
                "pause_no_worse": a["longest_pause_p99_s"]["median"] <= best["longest_pause_p99_s"]["median"],
            }
    return out


def _missed(slo: dict, rec: dict) -> list[str]:
    """Which of a request's deadlines it missed (the trial's own grading decides `good`; this only
    names the deadlines that read past their targets)."""
    out = [f"failed ({rec['failure']})"] if rec.get("failure") else []
    if rec.get("ttft_s") is None or rec["ttft_s"] > slo["ttft_s"]:
        out.append(f"first token {rec['ttft_s'] if rec.get('ttft_s') is None else round(rec['ttft_s'], 2)} s > {slo['ttft_s']}")
    if rec.get("longest_pause_s") is not None and rec["longest_pause_s"] > slo.get("gap_s", float("inf")):
        out.append(f"longest pause {rec['longest_pause_s']:.2f} s > {slo['gap_s']}")
    if slo.get("e2e_s") and rec.get("e2e_s") is not None and rec["e2e_s"] > slo["e2e_s"]:
        out.append(f"end to end {rec['e2e_s']:.1f} s > {slo['e2e_s']}")
    return out or ["the gap percentile or pace (see the report)"]


def misses(results: dict) -> list[dict]:
    """Every request an adaptive run (a run with a role timeline) missed, with the server's settings
    when it was sent. Decisions are on the run's clock (trial/mix_timeline.py), as are send times
    (the plan's, over the run's rate multiplier)."""
    plan = {p["index"]: p for p in results.get("plan") or []}
    classes = results.get("classes") or {}
    out = []
    for arr in results["arrangements"]:
        for run in _fixed_runs(arr):
            s = run["summary"]
            timeline = s.get("role_timeline")
            if not timeline:
                continue
            m = run.get("rate_multiplier") or 1.0
            decisions = timeline.get("decisions") or []
            for rec in s.get("per_request") or []:
                if rec.get("good"):
                    continue
                p = plan.get(rec["index"], {})
                sent = p.get("send_at_s", 0.0) / m
                roles, chunk, caps, last = dict(timeline.get("roles_at_start") or {}), None, {}, None
                for d in decisions:
                    if d["at_s"] > sent:
                        break
                    if d.get("instance_id") and d.get("to_role"):
                        roles[d["instance_id"]] = d["to_role"]
                    chunk = d.get("chunk_tokens") or chunk
                    caps.update(d.get("stream_caps") or {})
                    last = d
                slo = (classes.get(p.get("class")) or {}).get("slo") or results["slo"]
                out.append({"arrangement": arr["name"], "repeat": run.get("repeat"), "index": rec["index"],
                            "class": p.get("class"), "prompt_tokens": p.get("num_prompt_tokens"),
                            "sent_s": sent, "missed": _missed(slo, rec), "roles": roles,
                            "chunk_tokens": chunk, "stream_caps": caps,
                            "last_decision": None if last is None else
                            {"at_s": last["at_s"], "held": last.get("held"), "reason": last["reason"][:160]}})
    return out


def render_misses(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        roles = ", ".join(f"{k} {v}" for k, v in sorted(r["roles"].items()))
        caps = ", ".join(f"{k} {v}" for k, v in sorted(r["stream_caps"].items())) or "none"
        last = r["last_decision"]
        lines.append(f"  {r['arrangement']} repeat {r['repeat']}: #{r['index']} {r['class']} ({r['prompt_tokens']} "
                     f"tokens) sent {r['sent_s']:.1f} s: {'; '.join(r['missed'])}. Then: {roles}; chunk budget "
                     f"{r['chunk_tokens'] or 'as served'}; stream caps {caps}"
                     + ("" if last is None else f"; last decision at {last['at_s']:.1f} s: {last['held'] or 'a move'}"))
    return "\n".join(lines) if lines else "  (no adaptive run missed a request)"


def render(doc: dict) -> str:
    lines = [f"trial {doc['trial']}"]
    for a in doc["arrangements"]:
        att, pause = a["attainment"], a["longest_pause_p99_s"]
        phases = " / ".join(f"{100 * x:.0f}" for x in a["by_phase_median"])
        changes = ("-" if a["role_changes"] is None else
                   ", ".join(str(c) for c in a["role_changes"]) + " (" +
                   ", ".join(f"{x:.1f}" for x in a["role_changes_per_minute"]) + " a minute)")
        lines.append(f"  {a['name']:24} x{a['rate_multiplier']:.3g}  {100 * att['median']:.1f}% "
                     f"({100 * att['min']:.1f}-{100 * att['max']:.1f}%)  phases {phases} "
                     f"(requests {a['phase_requests']})  pause p99 {pause['median']:.2f} s "
                     f"({pause['min']:.2f}-{pause['max']:.2f})  role changes {changes}")
        lines.append(f"  {'':24} per run: " + ", ".join(f"{100 * x:.1f}%" for x in a["attainment_per_run"]))
        host = a.get("host")
        if host:
            speed, step = host["speed_units_per_s"], host["decode_step_median_s"]
            lines.append(f"  {'':24} host: speed {speed['min']:.0f}-{speed['max']:.0f} units/s, others up to "
                         f"{100 * host['others_share_max']:.0f}%, steal up to {100 * host['steal_share_max']:.0f}%, "
                         f"{host['disturbed']} of {host['watched']} runs disturbed"
                         + (f", decode step median {1000 * step['min']:.0f}-{1000 * step['max']:.0f} ms" if step else ""))
        vs = a.get("against_best_fixed")
        if vs:
            lines.append(f"  {'':24} against {vs['best_fixed']}: overall {vs['overall_points']:+.1f} points "
                         f"({'met' if vs['overall_at_least_best'] else 'NOT met'}); phases vs the best in each "
                         + ", ".join(f"{x:+.0f}" for x in vs["phase_points_vs_best_in_phase"])
                         + f" ({'met' if vs['no_phase_5_points_below'] else 'NOT met'}); pause p99 "
                         f"{vs['pause_p99_vs_best_fixed_s']:+.2f} s ({'met' if vs['pause_no_worse'] else 'NOT met'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--json", default=None)
    parser.add_argument("--misses", action="store_true",
                        help="also list every request an adaptive run missed, with the server's settings when sent")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    doc = summarize(results)
    print(render(doc))
    if args.misses:
        doc["misses"] = misses(results)
        print("missed by the adaptive runs:")
        print(render_misses(doc["misses"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
