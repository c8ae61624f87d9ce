"""The trial's results as one JSON document, and the paragraph that answers the buyer's question.

`results_document` gathers the spec's essentials, the plan, and for each arrangement every
run's summary and every request's timeline. `verdict` reads only that document, so a saved
results.json can be re-judged without rerunning anything.
"""
from __future__ import annotations

import dataclasses
import re

from splitserve.trial.runner import ArrangementResult, sweep_capacity
from splitserve.trial.spec import Arrangement, TrialSpec
from splitserve.trial.workload import PlannedRequest


def arrangement_kind(arr: Arrangement) -> str:
    """'separated' when prefill and decode run on different instances, else 'colocated' or 'external'."""
    args = arr.serve_args or arr.command or []
    if "--prefill" in args or re.search(r"\d+P\d+D", arr.name):
        return "separated"
    return "external" if arr.url else "colocated"


def results_document(spec: TrialSpec, plan: list[PlannedRequest] | None,
                     results: list[ArrangementResult], sweep: bool) -> dict:
    by_name = {a.name: a for a in spec.arrangements}
    target = spec.sweep.target_attainment if spec.sweep else 0.9
    doc = {
        "trial": spec.name,
        "seed": spec.seed,
        "spec_path": str(spec.source) if spec.source else None,
        "model": spec.model,
        "slo": dataclasses.asdict(spec.slo),
        "pause_threshold_s": spec.pause_threshold_s,
        "sweep": sweep,
        "plan": [{"index": r.index, "class": r.class_name, "send_at_s": r.send_at_s,
                  "num_prompt_tokens": r.num_prompt_tokens, "max_tokens": r.max_tokens} for r in plan or []],
        "arrangements": [],
    }
    for res in results:
        arr = by_name[res.name]
        doc["arrangements"].append({
            "name": res.name,
            "kind": arrangement_kind(arr),
            "launch": {"serve": arr.serve_args, "command": arr.command, "url": arr.url, "cores": arr.cores},
            "error": res.error,
            "sweep_capacity_rps": sweep_capacity(res, target) if sweep else None,
            "runs": [{"rate_multiplier": run.rate_multiplier, "summary": run.summary,
                      "server_counters": run.server_counters,
                      "requests": [dataclasses.asdict(r) for r in run.records]} for run in res.runs],
        })
    doc["verdict"] = verdict(doc)
    return doc


def main_summary(arr_doc: dict) -> dict | None:
    runs = arr_doc["runs"]
    for run in runs:
        if run["rate_multiplier"] == 1.0:
            return run["summary"]
    return runs[0]["summary"] if runs else None


def fmt_seconds(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "n/a"
    return f"{a / b:.1f}x"


def verdict(doc: dict) -> str:
    ran = [(a, main_summary(a)) for a in doc["arrangements"] if main_summary(a) is not None]
    failed = [a["name"] for a in doc["arrangements"] if a["error"]]
    note = f" Arrangements that failed to start: {', '.join(failed)} (see their logs)." if failed else ""
    if not ran:
        return "No arrangement completed a run, so there is no verdict." + note
    ranked = sorted(ran, key=lambda p: (p[1]["goodput_rps"], p[1]["attainment"]), reverse=True)
    best, best_s = ranked[0]
    separated = [p for p in ranked if p[0]["kind"] == "separated"]
    colocated = [p for p in ranked if p[0]["kind"] == "colocated"]
    head = (f"For this workload, {best['name']} met the most deadlines: {best_s['attainment']:.0%} of requests "
            f"good, goodput {best_s['goodput_rps']:.2f} req/s.")
    if not separated or not colocated:
        others = "; ".join(f"{a['name']} {s['attainment']:.0%}" for a, s in ranked[1:])
        return head + (f" Others: {others}." if others else "") + _warnings(ran) + note
    sep, sep_s = separated[0]
    col, col_s = colocated[0]
    gap_ratio = _ratio(col_s["gap_s"]["p99"], sep_s["gap_s"]["p99"])
    facts = (f" p99 inter-token gap: {sep['name']} {fmt_seconds(sep_s['gap_s']['p99'])} vs {col['name']} "
             f"{fmt_seconds(col_s['gap_s']['p99'])} ({gap_ratio}); streams interrupted by a pause: "
             f"{sep_s['interrupted_share']:.0%} vs {col_s['interrupted_share']:.0%}; p99 TTFT "
             f"{fmt_seconds(sep_s['ttft_s']['p99'])} vs {fmt_seconds(col_s['ttft_s']['p99'])}.")
    kv = sep_s["kv_transfer"]
    if kv["num_reports"]:
        facts += (f" {sep['name']} moved {kv['bytes'] / 1e6:.1f} MB of KV cache in {kv['seconds']:.2f} s "
                  f"({sep_s['failures']['kv_transfer_failed']} failed transfers).")
    winner = _clear_winner(sep_s, col_s)
    if all(s["attainment"] < 0.5 for _, s in ran):
        head = (f"No arrangement met half its deadlines at this load; the most was {best['name']} "
                f"({best_s['attainment']:.0%} good).")
        answer = " Separate prefill: no verdict from an overloaded run."
    elif winner == "separated":
        answer = (f" Separate prefill: yes. Decode steps on {sep['name']} never wait behind a long prompt's "
                  f"prefill, so answers keep streaming while documents arrive; that outweighs giving each "
                  f"phase only part of the cores (goodput {sep_s['goodput_rps']:.2f} vs {col_s['goodput_rps']:.2f} "
                  f"req/s for the best colocated arrangement, {col['name']}).")
    elif winner == "colocated":
        answer = (f" Separate prefill: no. {col['name']} met more deadlines "
                  f"(goodput {col_s['goodput_rps']:.2f} vs {sep_s['goodput_rps']:.2f} req/s): here prefill "
                  f"interference costs colocated decoding less than splitting the cores costs the separated "
                  f"arrangement{_split_cost(sep, sep_s, col_s)}.")
    else:
        head = (f"For this workload, {sep['name']} and {col['name']} met about as many deadlines "
                f"({sep_s['attainment']:.0%} vs {col_s['attainment']:.0%}, goodput {sep_s['goodput_rps']:.2f} vs "
                f"{col_s['goodput_rps']:.2f} req/s).")
        answer = (" Separate prefill: not at this load — no clear difference, so the simpler colocated setup "
                  "is the default; run --sweep to see which one holds more load. Tails:")
    return head + answer + facts + _warnings(ran) + note


def _clear_winner(sep_s: dict, col_s: dict) -> str | None:
    """'separated' or 'colocated' when one met clearly more deadlines (5 points of attainment or 10%
    more goodput), else None: one request more out of twenty is noise, not a verdict."""
    diff = sep_s["attainment"] - col_s["attainment"]
    if abs(diff) >= 0.05:
        return "separated" if diff > 0 else "colocated"
    low, high = sorted((sep_s["goodput_rps"], col_s["goodput_rps"]))
    if high > 0 and high >= 1.10 * low:
        return "separated" if sep_s["goodput_rps"] > col_s["goodput_rps"] else "colocated"
    return None


def _split_cost(sep: dict, sep_s: dict, col_s: dict) -> str:
    """Which half of the split arrangement paid for having fewer cores, from the numbers."""
    costs = []
    if (sep_s["ttft_s"]["p99"] or 0) > (col_s["ttft_s"]["p99"] or 0):
        costs.append(f"its prefill instance, with fewer threads, gave later first tokens (p99 TTFT "
                     f"{fmt_seconds(sep_s['ttft_s']['p99'])} vs {fmt_seconds(col_s['ttft_s']['p99'])})")
    if (sep_s["tpot_s"]["p50"] or 0) > (col_s["tpot_s"]["p50"] or 0):
        costs.append(f"its decode instance, with fewer threads, took longer per token (median TPOT "
                     f"{fmt_seconds(sep_s['tpot_s']['p50'])} vs {fmt_seconds(col_s['tpot_s']['p50'])})")
    if sep_s["failures"]["kv_transfer_failed"]:
        costs.append(f"{sep_s['failures']['kv_transfer_failed']} KV transfers failed")
    return ": " + "; ".join(costs) if costs else ""


def _warnings(ran: list[tuple[dict, dict]]) -> str:
    """Say when the comparison itself is weak: the load generator lagged, or every arrangement drowned."""
    out = ""
    lag = max((s["client_lag_s"]["max"] or 0.0) for _, s in ran)
    if lag > 0.5:
        out += (f" Warning: the load generator sent some requests up to {fmt_seconds(lag)} late, so offered "
                f"load was lower than planned.")
    if all(s["attainment"] < 0.5 for _, s in ran):
        worst = []
        for a, s in ran:
            kind, count = max(s["failures"].items(), key=lambda kv: kv[1])
            worst.append(f"{a['name']} {count}/{s['num_requests']} {kind}" if count else
                         f"{a['name']} misses SLOs")
        out += (f" Warning: every arrangement met fewer than half its deadlines ({'; '.join(worst)}): "
                f"the comparison says little; for timeouts and missed SLOs lower the rate, loosen the SLOs or "
                f"run --sweep; for errors read the servers' logs.")
    return out
