"""The headline figure: attainment against offered rate, per arrangement and per class.

Each probe is a point (share of its decided requests good) with its 90% binomial (Wilson)
interval; each arrangement's fitted curve (a logistic, or a mixture of per-class logistics) is drawn over the probed range; the target
is a horizontal line and each capacity's 90% interval a shaded band (a bound: an arrow-like
marker at the bound). One panel for all requests, then one per class. Also the per-probe table:
rate, requests, good, the host's disturbance and the machine's speed.
"""
from __future__ import annotations

import html
import io
import math

from splitserve.trial import curve
from splitserve.trial.quote import OFF_SPEED, SLOW_ENGINE


def _logistic(fit, ceiling: float, x: float, floor: float = 0.0) -> float:
    a, b, c = fit
    return floor + (ceiling - floor) / (1.0 + math.exp(-max(-30.0, min(30.0, a + b * (math.log(x) - c)))))


def _curve_points(cap: dict, lo: float, hi: float):
    """The fitted curve over [lo, hi]: one logistic, or a mixture's per-class curves at their shares."""
    xs = [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / 80) for i in range(81)]
    if cap.get("components"):
        return xs, [sum(q["weight"] * _logistic(q["fit"], q["ceiling"], x, q.get("floor") or 0.0)
                        for q in cap["components"]) for x in xs]
    return xs, [_logistic(cap["fit"], cap.get("ceiling") or 1.0, x, cap.get("floor") or 0.0) for x in xs]


def _panel(ax, per: dict, target: float, klass: str | None, colors) -> None:
    for (name, c), color in zip(per.items(), colors):
        cap = c if klass is None else c["by_class"].get(klass)
        pts = []
        for p in c["points"]:
            n, k = (p["n"], p["good"]) if klass is None else (p["by_class"].get(klass, {}).get("n", 0),
                                                               p["by_class"].get(klass, {}).get("good", 0))
            if n:
                lo, hi = curve.wilson(k, n)
                pts.append((p["rate_rps"], k / n, lo, hi))
        if not pts:
            continue
        xs = [x for x, *_ in pts]
        # the bars come from the same k and n as the point; clipped at 0 all the same (matplotlib
        # refuses a negative length, and a rounding error must not cost the whole report)
        below = [max(0.0, y - lo) for _, y, lo, _ in pts]
        above = [max(0.0, hi - y) for _, y, _, hi in pts]
        ax.errorbar(xs, [y for _, y, _, _ in pts], yerr=[below, above], fmt="o", color=color, alpha=0.8,
                    capsize=2, label=name)
        if cap and (cap.get("fit") or cap.get("components")):
            cx, cy = _curve_points(cap, min(xs) / 1.3, max(xs) * 1.3)
            ax.plot(cx, cy, color=color, lw=1.5)
        if cap and cap["kind"] == "point":
            ax.axvspan(cap["lo_rps"], cap["hi_rps"], color=color, alpha=0.15)
            ax.axvline(cap["estimate_rps"], color=color, ls=":", lw=1)
        elif cap and cap.get("estimate_rps"):
            ax.annotate("", xy=(cap["estimate_rps"] * (1.4 if cap["kind"] == "at_least" else 0.7), target),
                        xytext=(cap["estimate_rps"], target), arrowprops={"arrowstyle": "->", "color": color})
    ax.axhline(target, color="k", ls="--", lw=1)
    ax.set_xscale("log")
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%.2g"))
    ax.xaxis.set_minor_formatter(NullFormatter())   # log-scale minor labels overlap on a narrow range
    ax.set_ylim(-0.03, 1.03)
    ax.set_title("all requests" if klass is None else f"class {klass}", fontsize=9)
    ax.grid(alpha=0.3)


def capacity_figure(doc: dict) -> bytes:
    """The PNG (also embedded in the HTML report)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = doc["quote"]
    per = q["arrangements"]
    classes = sorted({k for c in per.values() for k in c["by_class"]})
    panels = [None, *classes] if len(classes) > 1 else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, klass in zip(axes[0], panels):
        _panel(ax, per, q["target"], klass, colors)
        ax.set_xlabel("offered rate (req/s)")
    axes[0, 0].set_ylabel("share of requests good")
    axes[0, 0].legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _step_cell(check: dict | None, index: int) -> str:
    """This run's engine speed against its arrangement's median run, and its median decode-only
    step beside its arrangement's median over its probes."""
    row = next((r for r in (check or {}).get("runs", []) if r["run"] == index), None)
    if row is None:
        return "-"
    median = check.get("probe_median_s")
    parts = []
    if row.get("speed") is not None:
        parts.append(f"x{row['speed']:.2f}")
    if row.get("decode_step_median_s") is not None:
        parts.append(f"{row['decode_step_median_s'] * 1e3:.0f} ms" + (f" ({median * 1e3:.0f} ms)" if median else ""))
    mark = ": slow engine" if row["slow"] else ": fast engine" if row.get("fast") else ""
    return ", ".join(parts) + mark


def _idle_cell(s: dict) -> str:
    idle = s.get("idle_before") or {}
    if not idle.get("checked"):
        return "-"
    if idle["idle"]:
        return f"{idle['wait_s']:.1f} s"
    return f"not idle after {idle['wait_s']:.0f} s ({idle['busy_requests']:g} requests): went ahead"


def probes_html(doc: dict) -> str:
    """Every probe of the fitted search and every fixed-rate run, in the order they ran: rate, good
    of decided, the host, the engine's decode step beside its arrangement's usual one."""
    rows = []
    steps = (doc.get("quote") or {}).get("steps") or {}
    for a in doc["arrangements"]:
        for i, run in enumerate(a["runs"]):
            purpose = run.get("purpose")
            fixed = purpose in ("fixed", "fixed-disturbed")
            if not fixed and (purpose not in ("probe", "probe-disturbed") or "round" not in run["summary"]):
                continue
            s = run["summary"]
            if fixed and "attempt" not in s:
                continue  # a fixed-rate run of the other methods: not watched, shown in the tables
            host = s.get("host") or {}
            good = sum(s["outcomes"]["good"]) if s.get("outcomes") else s["num_good"]
            idle = max((s.get("idle_cpu_share") or {}).values(), default=None)
            rows.append((run.get("repeat", 0), "fixed" if fixed else s["round"], a["name"],
                         s.get("offered_rate_rps") or 0.0,
                         f"{good} / {s.get('num_decided', s['num_requests'])} of {s['num_requests']}",
                         f"{host.get('others_share', 0):.0%} others, {host.get('steal_share', 0):.0%} steal"
                         if host else "not watched",
                         ("disturbed, redone" if purpose.endswith("-disturbed") else
                          "disturbed (redo also)" if s.get("disturbed") else "quiet"),
                         f"{s['speed_units_per_s'] / 1e6:.2f} M/s" if s.get("speed_units_per_s") else "-",
                         f"{idle:.1%}" if idle is not None else "-", _idle_cell(s), _step_cell(steps.get(a["name"]), i)))
    if not rows:
        return ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c) if not isinstance(c, float) else f'{c:.3f}')}</td>"
                                    for c in r) + "</tr>" for r in rows)
    return ("<h3>Every probe and fixed-rate run</h3><table><tr><th>repeat</th><th>round</th><th>arrangement</th>"
            "<th>req/s</th><th>good / decided of planned</th><th>host during the run</th><th>host</th>"
            "<th>speed before it</th><th>idle servers' CPU</th><th>wait for an idle server</th>"
            "<th>engine steps: time against the arrangement's median run; median decode step (its "
            "arrangement's over its probes)</th></tr>" + body + "</table>"
            f"<p>The engine speed: the run's steps against a step model fitted on every step of its "
            f"arrangement's runs (so bigger batches at a higher rate do not read as slower), 1.00 the median run. "
            f"Past x{OFF_SPEED:.2f} a run is marked \"slow engine\", under x{1 / OFF_SPEED:.2f} \"fast engine\": "
            f"its engines stepped slower (faster) than the same steps did elsewhere in the trial, a slow minute "
            f"of the host or another process that the host watch may miss (a measured symptom, not an input to "
            f"the verdict). A run without that reading is marked slow when its median decode-only step is more "
            f"than {SLOW_ENGINE:g} times its arrangement's median over its probes.</p>")
