"""Show a results document: a side-by-side terminal table, results.json, and a self-contained HTML report.

The HTML page embeds its plots as base64 PNGs (matplotlib, Agg backend), so it can be mailed
or archived as one file: CDFs of TTFT and inter-token gaps, each stream's pauses against
document arrivals, attainment as the SLOs are scaled, and the sweep when there is one.
"""
from __future__ import annotations

import base64
import html
import io
import json
import pathlib

from rich.console import Console
from rich.table import Table

from splitserve.trial.class_report import classes_html
from splitserve.trial.faults import fault_start
from splitserve.trial.metrics import local_share
from splitserve.trial.mix_timeline import timeline_cell, timeline_html
from splitserve.trial.results import equal_rate, fmt_capacity, fmt_seconds, fmt_spread, main_summary, stats_at

# Rows measured per repeat: median (min-max) when the trial repeated.
SPREAD_ROWS = [
    ("attainment", "attainment", lambda x: f"{x:.0%}"),
    ("goodput (req/s)", "goodput_rps", lambda x: f"{x:.3f}"),
    ("TTFT p99", "ttft_p99_s", fmt_seconds),
    ("TPOT p50", "tpot_p50_s", fmt_seconds),
    ("gap p99", "gap_p99_s", fmt_seconds),
    ("longest pause p99", "longest_pause_p99_s", fmt_seconds),
]

# Rows from the first repeat's run at the compared rate.
ROWS = [
    ("offered rate (req/s)", lambda s: f"{s['offered_rate_rps']:.3f}" if s.get("offered_rate_rps") else "n/a"),
    ("good / requests", lambda s: f"{s['num_good']} / {s['num_requests']}"),
    ("attainment by class", lambda s: ", ".join(f"{name} {c['attainment']:.0%}" for name, c in s["by_class"].items())),
    ("attainment by phase", lambda s: ", ".join(f"#{p['phase'] + 1} {p['attainment']:.0%}" if p.get("num_requests")
                                                else f"#{p['phase'] + 1} -" for p in s["by_phase"])
                                      if s.get("by_phase") else "-"),
    ("TTFT p50 / p99", lambda s: f"{fmt_seconds(s['ttft_s']['p50'])} / {fmt_seconds(s['ttft_s']['p99'])}"),
    ("TPOT p50 / p99", lambda s: f"{fmt_seconds(s['tpot_s']['p50'])} / {fmt_seconds(s['tpot_s']['p99'])}"),
    ("gap p50 / p99", lambda s: f"{fmt_seconds(s['gap_s']['p50'])} / {fmt_seconds(s['gap_s']['p99'])}"),
    ("longest pause p99 / max", lambda s: f"{fmt_seconds(s['longest_pause_s']['p99'])} / "
                                          f"{fmt_seconds(s['longest_pause_s']['max'])}"),
    ("streams interrupted", lambda s: f"{s['interrupted_share']:.0%}"),
    ("time stalled (total)", lambda s: f"{s['stalled_s_total']:.1f} s"),
    ("failures (terminal)", lambda s: ", ".join(f"{k} {v}" for k, v in s["failures"].items() if v) or "none"),
    ("recovered: retried / KV recomputed",
     lambda s: f"{s['recovered']['retried']} / {s['recovered']['kv_recomputed']}"),
    ("timing", lambda s: "per token" if s.get("token_timing") == "token" else
                         "per chunk (the server sent no token ids)"),
    ("faults: lost / failed after / recovery", lambda s: fault_cell(s.get("faults"))),
    ("role changes (adaptive)", timeline_cell),
    ("KV moved", lambda s: f"{s['kv_transfer']['bytes'] / 1e6:.1f} MB in {s['kv_transfer']['seconds']:.2f} s, "
                           f"{s['kv_transfer']['failed']} failed" if s["kv_transfer"]["num_reports"] else "-"),
    ("prefilled locally by class", lambda s: local_cell({n: c.get("prefill") for n, c in s["by_class"].items()})),
    ("client lag p99 / max", lambda s: f"{fmt_seconds(s['client_lag_s']['p99'])} / "
                                       f"{fmt_seconds(s['client_lag_s']['max'])}"),
]

def fault_cell(faults: list[dict] | None) -> str:
    """One line per scheduled fault: requests lost in flight, failed after the kill (or the start of a
    rolling restart), time to recover; for a restart also its length and SLO misses during it."""
    if not faults:
        return "-"
    parts = []
    for f in faults:
        if fault_start(f) is None:
            parts.append(f"not injected ({f.get('error')})")
            continue
        recovery = "not recovered" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s"
        if f.get("restart") == "coordinator":
            kept = sum(1 for i in f["instances"] if i.get("kept"))
            problem = f" ({f['error']})" if f.get("error") else ""
            parts.append(f"restart coordinator ({kept} of {len(f['instances'])} engines kept, serving again after "
                         f"{f['seconds']:.1f} s{problem}; the server ended {f.get('failed_requests')} in flight): "
                         f"{f['lost_in_flight']} / {f['failed_after']} / {recovery}; SLO missed by "
                         f"{f['slo_missed_during']} of {f['requests_during']} during it, "
                         f"{f['slo_missed_outside']} of {f['requests_outside']} outside")
            continue
        if f.get("restart"):
            stopped = f" (stopped: {f['error']})" if f.get("error") else ""
            n = f["num_restarted"]
            parts.append(f"restart {f['restart']} ({n} instance{'' if n == 1 else 's'} in {f['seconds']:.1f} s"
                         f"{stopped}): {f['lost_in_flight']} / {f['failed_after']} / {recovery}; SLO missed by "
                         f"{f['slo_missed_during']} of {f['requests_during']} during it, "
                         f"{f['slo_missed_outside']} of {f['requests_outside']} outside")
            continue
        parts.append(f"{f['kill']} {f['instance']}: {f['lost_in_flight']} / {f['failed_after']} / {recovery}")
    return "; ".join(parts)


def local_cell(counts_by_class: dict[str, dict | None]) -> str:
    """'chat 90% (45/50), document 0% (0/10)': the share the server prefilled on the decode instance,
    of the prompts whose placement it reported; '-' when it reported none (colocated, or `always`)."""
    parts = [f"{name} {share:.0%} ({counts['local']}/{counts['local'] + counts['remote']})"
             for name, counts in counts_by_class.items() if (share := local_share(counts)) is not None]
    return ", ".join(parts) or "-"


PLOT_TITLES = {
    "capacity": "Attainment against offered rate: every probe (90% binomial intervals), the fitted curves, "
                "the target and each capacity's 90% interval; per class below",
    "ttft_cdf": "Time to first token (CDF)",
    "gap_cdf": "Inter-token gaps (CDF)",
    "pauses": "Each stream's pauses against long-prompt arrivals",
    "attainment_vs_slo": "Attainment as every SLO is scaled",
    "sweep": "Attainment against offered request rate (capacity probes and --sweep)",
}


def rows(doc: dict) -> list[tuple[str, list[str]]]:
    """(label, one cell per arrangement): the table, in the terminal and in the HTML report."""
    arrs, reps, m = doc["arrangements"], doc.get("repeat", 1), equal_rate(doc)
    out = []
    q = doc.get("quote")
    if q:
        from splitserve.trial.verdict import _iv

        out.append((f"capacity (>= {q['target']:.0%} good, {q['level']:.0%} interval)",
                    [_iv(q["arrangements"][a["name"]]) if a["name"] in q["arrangements"] else "-" for a in arrs]))
    elif any(a.get("capacity_rps") for a in arrs):
        out.append((f"capacity (req/s, >= {doc['slo'].get('attainment', 0.9):.0%} good)",
                    [fmt_capacity(a, reps) for a in arrs]))
    stats = [stats_at(a, m) if m is not None else None for a in arrs]
    suffix = f", median (min-max) of {reps}" if reps > 1 else ""
    missing = ["failed" if a["error"] else "not run at this rate" for a in arrs]
    for label, key, fmt in SPREAD_ROWS:
        out.append((label + suffix, [fmt_spread(st[key], fmt, reps) if st else gone
                                     for st, gone in zip(stats, missing)]))
    for label, cell in ROWS:
        out.append((label, [cell(main_summary(a, m)) if main_summary(a, m) else gone
                            for a, gone in zip(arrs, missing)]))
    out.append(("prefilled locally by class (all capacity probes)",
                [local_cell(a.get("probe_prefill_by_class") or {}) for a in arrs]))
    out.append(("engines", [a["resources"]["describe"] if a.get("resources") else "-" for a in arrs]))
    out.append(("affinity read back", [_affinity(a) for a in arrs]))
    return out


def _affinity(a: dict) -> str:
    launches = a.get("launches") or []
    if not launches or not launches[0]["processes"]:
        return "-"
    sets = {tuple(p["cpus"]) for launch in launches for p in launch["processes"]}
    count = sum(len(launch["processes"]) for launch in launches)
    return f"{count} processes on cores {' / '.join(','.join(map(str, s)) for s in sorted(sets))}"


def table(doc: dict) -> Table:
    m = equal_rate(doc)
    title = f"trial {doc['trial']} (seed {doc['seed']}, {doc.get('repeat', 1)} repeat(s))"
    if m is not None:
        title += f"; fixed-rate rows at x{m:.3g} of the spec's rate"
    t = Table(title=title)
    t.add_column("metric")
    for a in doc["arrangements"]:
        t.add_column(a["name"], justify="right")
    for label, cells in rows(doc):
        t.add_row(label, *cells)
    return t


def print_summary(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(doc))
    if doc.get("cpus") is not None:
        console.print(f"Cores {doc['cpus']}: {doc['placement']}. KV cache {doc['kv_cache_memory_total']} per "
                      f"arrangement, split between its instances. Order per repeat: {doc['order']}.",
                      markup=False, highlight=False)
    console.print(doc["verdict"])


def write_json(doc: dict, path: pathlib.Path) -> None:
    path.write_text(json.dumps(doc, indent=1))


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _main_requests(a: dict, m: float | None) -> list[dict]:
    for run in a["runs"]:
        if run.get("purpose", "fixed") in ("fixed", "sweep") and run["rate_multiplier"] == m:
            return run["requests"]
    return []


def drawn_probe(arr_doc: dict, cap: dict | None) -> dict | None:
    """The fitted method's run for the CDFs and pause timelines: of the probes at or below the
    arrangement's capacity estimate (or its lower bound), the one with the most decided requests,
    a fuller sample than the fixed-rate run's few. None where the capacity is an upper bound."""
    if not cap or cap["kind"] not in ("point", "at_least") or not cap.get("estimate_rps"):
        return None
    below = [r for r in arr_doc["runs"] if r.get("purpose") == "probe" and "outcomes" in r["summary"]
             and (r["summary"].get("offered_rate_rps") or 0.0) <= cap["estimate_rps"] * (1 + 1e-9)]
    return max(below, key=lambda r: r["summary"]["num_decided"], default=None)


def _drawn(doc: dict, m: float | None) -> tuple[dict, str]:
    """Per arrangement, the requests the CDFs and pause timelines draw (and whether from a probe),
    and a caption naming them."""
    q = doc.get("quote") or {}
    out, said = {}, []
    for a in doc["arrangements"]:
        run = drawn_probe(a, (q.get("arrangements") or {}).get(a["name"])) if q else None
        if run is not None:
            s = run["summary"]
            out[a["name"]] = (run["requests"], True)
            said.append(f"{a['name']}: the probe at {s['offered_rate_rps']:.3f} req/s (repeat {run.get('repeat', 0) + 1}, "
                        f"round {s.get('round', 0)}), {s['num_decided']} requests decided")
        elif _main_requests(a, m):
            out[a["name"]] = (_main_requests(a, m), False)
            said.append(f"{a['name']}: the fixed-rate run" + (" (no probe at or below its capacity)" if q else ""))
    return out, "Drawn from " + "; ".join(said) + "." if said else ""


def plots(doc: dict) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    m = equal_rate(doc)
    drawn, _ = _drawn(doc, m)
    ran = [a for a in doc["arrangements"] if a["name"] in drawn]
    out = {}
    if ran:  # a trial whose searches held nothing has no whole-plan run to draw
        for key, title, values_of in (
                ("ttft_cdf", "TTFT (s), CDF", lambda reqs: [r["token_times_s"][0] - r["sent_s"] for r in reqs
                                                           if r["token_times_s"]]),
                ("gap_cdf", "inter-token gap (s), CDF", lambda reqs: [g for r in reqs
                                                                       for g in np.diff(r["token_times_s"])])):
            fig, ax = plt.subplots(figsize=(6.5, 3.5))
            for a in ran:
                values = np.sort(values_of(drawn[a["name"]][0]))
                if values.size:
                    ax.plot(values, np.arange(1, values.size + 1) / values.size, label=a["name"])
            ax.set_xscale("log")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
            out[key] = _png(fig)
        fig, axes = plt.subplots(len(ran), 1, figsize=(8, 2.2 * max(len(ran), 1)), sharex=True, squeeze=False)
        long_classes = _long_classes(doc)
        for ax, a in zip(axes[:, 0], ran):
            requests, from_probe = drawn[a["name"]]
            for r in requests:
                times = r["token_times_s"]
                if times:
                    ax.plot([times[0], times[-1]], [r["index"]] * 2, color="0.8", lw=1)
                for t0, t1 in zip(times, times[1:]):
                    if t1 - t0 > doc["pause_threshold_s"]:
                        ax.plot([t0, t1], [r["index"]] * 2, color="red", lw=2.5)
            if from_probe:   # a probe's requests are the plan's recut and tiled: their own send times
                arrivals = [r["sent_s"] for r in requests if r["class_name"] in long_classes and r["sent_s"] is not None]
            else:            # the plan's own run: its arrivals as planned
                arrivals = [p["send_at_s"] / m for p in doc["plan"] if p["class"] in long_classes]
            for t in arrivals:
                ax.axvline(t, color="tab:blue", alpha=0.35, lw=1)
            ax.set_ylabel(a["name"], fontsize=8)
        axes[-1, 0].set_xlabel(f"seconds (grey: streaming, red: pause > {doc['pause_threshold_s']} s, "
                               f"blue: long-prompt arrival)")
        out["pauses"] = _png(fig)
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for a in ran:
            if not main_summary(a, m):
                continue   # drawn from a probe, with no fixed-rate run to scale the SLOs of
            curve = main_summary(a, m)["attainment_vs_slo_scale"]
            ax.plot([c["scale"] for c in curve], [c["attainment"] for c in curve], marker="o", label=a["name"])
        ax.set_xlabel("SLO scale (x every deadline)")
        ax.set_ylabel("attainment")
        ax.grid(alpha=0.3)
        ax.legend()
        out["attainment_vs_slo"] = _png(fig)
    if doc["sweep"] or any(a.get("capacity") for a in doc["arrangements"]):
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for a in doc["arrangements"]:
            pts = sorted((r["summary"]["offered_rate_rps"], r["summary"]["attainment"]) for r in a["runs"]
                         if r["summary"].get("offered_rate_rps") and r.get("purpose") != "tune")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=a["name"])
        ax.set_xscale("log")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("attainment")
        ax.grid(alpha=0.3)
        ax.legend()
        out["sweep"] = _png(fig)
    return out


def _long_classes(doc: dict) -> set[str]:
    """Classes whose mean prompt is at least twice the overall mean: the 'documents'."""
    plan = doc["plan"]
    if not plan:
        return set()
    mean = sum(p["num_prompt_tokens"] for p in plan) / len(plan)
    by_class: dict[str, list[int]] = {}
    for p in plan:
        by_class.setdefault(p["class"], []).append(p["num_prompt_tokens"])
    return {c for c, v in by_class.items() if sum(v) / len(v) >= 2 * mean or c in ("long", "document")}


def _method_html(doc: dict) -> str:
    """The calibration, the tuning grid and every capacity probe, as measured."""
    parts = []
    cal = doc.get("calibration")
    if cal:
        parts.append(f"<p>Calibration: {html.escape(cal['reference'])} held "
                     f"{cal['capacity_rps'] or 0:.3f} req/s; the fixed rate is {cal['fraction_of_capacity']:g} x its "
                     f"capacity (x{cal.get('rate_multiplier') or 0:.3g} of the nominal rate). "
                     f"{html.escape(cal.get('note', ''))}</p>")
    tuning = doc.get("tuning")
    if tuning and tuning.get("method") != "fitted":  # the fitted grid is in the verdict and the probe table
        cells = ", ".join(f"{html.escape(p['name'])}: {p['attainment']:.0%}" if p["attainment"] is not None
                          else f"{html.escape(p['name'])}: failed" for p in tuning["points"])
        parts.append(f"<p>Colocated grid at x{tuning['rate_multiplier']:.3g}: {cells}; best: "
                     f"{html.escape(str(tuning['best']))}.</p>")
    for a in doc["arrangements"]:
        for c in a.get("capacity", []):
            if c.get("method") == "fitted":
                continue  # shown in the headline figure and the per-probe table
            probes = ", ".join(f"{p['offered_rate_rps'] or 0:.3f} req/s {p['attainment']:.0%} ({p['seconds']:.0f} s)"
                               for p in c["probes"])
            parts.append(f"<p>{html.escape(a['name'])} capacity search (repeat {c['repeat'] + 1}, stopped by "
                         f"{c['stopped_by']}): {probes}</p>")
    return "".join(parts)


def write_html(doc: dict, path: pathlib.Path) -> None:
    images = plots(doc)
    headline = ""
    if doc.get("quote"):
        from splitserve.trial.figure import capacity_figure, probes_html

        png = capacity_figure(doc)
        (path.parent / "capacity.png").write_bytes(png)
        headline = (f'<h3>{PLOT_TITLES["capacity"]}</h3><img alt="capacity" '
                    f'src="data:image/png;base64,{base64.b64encode(png).decode()}">{probes_html(doc)}')
    body = "".join(f"<tr><th>{html.escape(label)}</th>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                   + "</tr>" for label, cells in rows(doc))
    head = "".join(f"<th>{html.escape(a['name'])}</th>" for a in doc["arrangements"])
    errors = "".join(f"<div class=err><b>{html.escape(a['name'])} failed:</b>"
                     f"<pre>{html.escape(a['error'])}</pre></div>" for a in doc["arrangements"] if a["error"])
    _, drawn_from = _drawn(doc, equal_rate(doc))
    figures = "".join(f'<h3>{PLOT_TITLES[name]}</h3><img alt="{name}" src="data:image/png;base64,{data}">'
                      + (f"<p>{html.escape(drawn_from)}</p>" if name in ("ttft_cdf", "gap_cdf", "pauses") else "")
                      for name, data in images.items())
    slo = doc["slo"]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>splitserve trial {html.escape(doc['trial'])}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .6em;text-align:right}}
th:first-child{{text-align:left}}table{{border-collapse:collapse}}tr:nth-child(even){{background:#f4f4f4}}
.verdict{{background:#eef6ee;padding:1em;border-left:4px solid #4a4}}.err{{color:#a00}}</style></head><body>
<h1>splitserve trial: {html.escape(doc['trial'])}</h1>
<p>seed {doc['seed']}, {len(doc['plan'])} requests. SLOs: TTFT &le; {slo['ttft_s']} s, p{slo['gap_percentile']:g}
inter-token gap &le; {slo['gap_s']} s, longest pause &le; {slo['max_pause_s']} s, end-to-end &le; {slo['e2e_s']} s;
pause threshold {doc['pause_threshold_s']} s.</p>
<h2>Verdict</h2><p class="verdict">{html.escape(doc['verdict'])}</p>{errors}
{headline}
<h2>Side by side</h2><table><tr><th>metric</th>{head}</tr>{body}</table>
{classes_html(doc)}
{_method_html(doc)}
{timeline_html(doc)}
<p>Resources: {html.escape(doc.get('placement', ''))}; cores {doc.get('cpus')}; KV cache
{html.escape(str(doc.get('kv_cache_memory_total')))} per arrangement, split between its instances.
Order of the runs per repeat: {html.escape(str(doc.get('order')))}.</p>
<h2>Plots</h2>{figures}
<p>Every request's timeline is in results.json next to this file.</p></body></html>"""
    path.write_text(page)
