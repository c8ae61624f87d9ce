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

from splitserve.trial.verdict import fmt_seconds, main_summary

ROWS = [
    ("attainment", lambda s: f"{s['attainment']:.0%}"),
    ("goodput (req/s)", lambda s: f"{s['goodput_rps']:.3f}"),
    ("good / requests", lambda s: f"{s['num_good']} / {s['num_requests']}"),
    ("attainment by class", lambda s: ", ".join(f"{name} {c['attainment']:.0%}" for name, c in s["by_class"].items())),
    ("TTFT p50 / p99", lambda s: f"{fmt_seconds(s['ttft_s']['p50'])} / {fmt_seconds(s['ttft_s']['p99'])}"),
    ("TPOT p50 / p99", lambda s: f"{fmt_seconds(s['tpot_s']['p50'])} / {fmt_seconds(s['tpot_s']['p99'])}"),
    ("gap p50 / p99", lambda s: f"{fmt_seconds(s['gap_s']['p50'])} / {fmt_seconds(s['gap_s']['p99'])}"),
    ("longest pause p99 / max", lambda s: f"{fmt_seconds(s['longest_pause_s']['p99'])} / "
                                          f"{fmt_seconds(s['longest_pause_s']['max'])}"),
    ("streams interrupted", lambda s: f"{s['interrupted_share']:.0%}"),
    ("time stalled (total)", lambda s: f"{s['stalled_s_total']:.1f} s"),
    ("failures", lambda s: ", ".join(f"{k} {v}" for k, v in s["failures"].items() if v) or "none"),
    ("retries", lambda s: str(s["retries"])),
    ("faults: lost / failed after / recovery", lambda s: fault_cell(s.get("faults"))),
    ("KV moved", lambda s: f"{s['kv_transfer']['bytes'] / 1e6:.1f} MB in {s['kv_transfer']['seconds']:.2f} s"
                           if s["kv_transfer"]["num_reports"] else "-"),
    ("client lag p99 / max", lambda s: f"{fmt_seconds(s['client_lag_s']['p99'])} / "
                                       f"{fmt_seconds(s['client_lag_s']['max'])}"),
]

def fault_cell(faults: list[dict] | None) -> str:
    """One line per scheduled fault: requests lost in flight, failed after the kill, time to recover."""
    if not faults:
        return "-"
    parts = []
    for f in faults:
        if f.get("killed_s") is None:
            parts.append(f"not injected ({f.get('error')})")
            continue
        recovery = "not recovered" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s"
        parts.append(f"{f['kill']} {f['instance']}: {f['lost_in_flight']} / {f['failed_after']} / {recovery}")
    return "; ".join(parts)


PLOT_TITLES = {
    "ttft_cdf": "Time to first token (CDF)",
    "gap_cdf": "Inter-token gaps (CDF)",
    "pauses": "Each stream's pauses against long-prompt arrivals",
    "attainment_vs_slo": "Attainment as every SLO is scaled",
    "sweep": "Attainment against offered request rate (--sweep)",
}


def table(doc: dict) -> Table:
    t = Table(title=f"trial {doc['trial']} (seed {doc['seed']})")
    t.add_column("metric")
    arrangements = [a for a in doc["arrangements"]]
    for a in arrangements:
        t.add_column(a["name"], justify="right")
    for label, cell in ROWS:
        t.add_row(label, *[cell(main_summary(a)) if main_summary(a) else "failed" for a in arrangements])
    if doc["sweep"]:
        t.add_row("sweep: max rate >= target", *[
            f"{a['sweep_capacity_rps']:.2f} req/s" if a["sweep_capacity_rps"] else "none" for a in arrangements])
    return t


def print_summary(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(doc))
    console.print(doc["verdict"])


def write_json(doc: dict, path: pathlib.Path) -> None:
    path.write_text(json.dumps(doc, indent=1))


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _main_requests(a: dict) -> list[dict]:
    for run in a["runs"]:
        if run["rate_multiplier"] == 1.0:
            return run["requests"]
    return a["runs"][0]["requests"] if a["runs"] else []


def plots(doc: dict) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ran = [a for a in doc["arrangements"] if a["runs"]]
    out = {}
    for key, title, values_of in (
            ("ttft_cdf", "TTFT (s), CDF", lambda reqs: [r["token_times_s"][0] - r["sent_s"] for r in reqs
                                                       if r["token_times_s"]]),
            ("gap_cdf", "inter-token gap (s), CDF", lambda reqs: [g for r in reqs
                                                                   for g in np.diff(r["token_times_s"])])):
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for a in ran:
            values = np.sort(values_of(_main_requests(a)))
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
        for r in _main_requests(a):
            times = r["token_times_s"]
            if times:
                ax.plot([times[0], times[-1]], [r["index"]] * 2, color="0.8", lw=1)
            for t0, t1 in zip(times, times[1:]):
                if t1 - t0 > doc["pause_threshold_s"]:
                    ax.plot([t0, t1], [r["index"]] * 2, color="red", lw=2.5)
        for p in doc["plan"]:
            if p["class"] in long_classes:
                ax.axvline(p["send_at_s"] / _rate(a), color="tab:blue", alpha=0.35, lw=1)
        ax.set_ylabel(a["name"], fontsize=8)
    axes[-1, 0].set_xlabel(f"seconds (grey: streaming, red: pause > {doc['pause_threshold_s']} s, "
                           f"blue: long-prompt arrival)")
    out["pauses"] = _png(fig)
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for a in ran:
        curve = main_summary(a)["attainment_vs_slo_scale"]
        ax.plot([c["scale"] for c in curve], [c["attainment"] for c in curve], marker="o", label=a["name"])
    ax.set_xlabel("SLO scale (x every deadline)")
    ax.set_ylabel("attainment")
    ax.grid(alpha=0.3)
    ax.legend()
    out["attainment_vs_slo"] = _png(fig)
    if doc["sweep"]:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for a in ran:
            pts = [(r["summary"]["offered_rate_rps"], r["summary"]["attainment"]) for r in a["runs"]
                   if r["summary"]["offered_rate_rps"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=a["name"])
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("attainment")
        ax.grid(alpha=0.3)
        ax.legend()
        out["sweep"] = _png(fig)
    return out


def _rate(a: dict) -> float:
    runs = [r for r in a["runs"] if r["rate_multiplier"] == 1.0]
    return 1.0 if runs or not a["runs"] else a["runs"][0]["rate_multiplier"]


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


def write_html(doc: dict, path: pathlib.Path) -> None:
    images = plots(doc)
    rows = "".join(
        f"<tr><th>{html.escape(label)}</th>" + "".join(
            f"<td>{html.escape(cell(main_summary(a)) if main_summary(a) else 'failed')}</td>"
            for a in doc["arrangements"]) + "</tr>" for label, cell in ROWS)
    head = "".join(f"<th>{html.escape(a['name'])}</th>" for a in doc["arrangements"])
    errors = "".join(f"<div class=err><b>{html.escape(a['name'])} failed:</b>"
                     f"<pre>{html.escape(a['error'])}</pre></div>" for a in doc["arrangements"] if a["error"])
    figures = "".join(f'<h3>{PLOT_TITLES[name]}</h3><img alt="{name}" src="data:image/png;base64,{data}">'
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
<h2>Side by side</h2><table><tr><th>metric</th>{head}</tr>{rows}</table>
<h2>Plots</h2>{figures}
<p>Every request's timeline is in results.json next to this file.</p></body></html>"""
    path.write_text(page)
