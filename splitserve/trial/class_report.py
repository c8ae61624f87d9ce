"""Per service class: which arrangement serves which class best, what abandoned requests cost,
and good requests per unit of cost; the verdict's sentence and the report's table, from a
results document alone.

Each arrangement is read at the rate every arrangement ran (results.equal_rate), median over
repeats. A class is "best served" by the arrangement with the highest attainment for it; a tie
(within 5 points on one run, overlapping ranges over repeats) names no winner.
"""
from __future__ import annotations

import html

from splitserve.trial.capacity import clear_winner
from splitserve.trial.results import equal_rate, good_per_cost, spread, summaries_at


def class_table(doc: dict) -> list[dict]:
    """One row per (class, arrangement) at the compared rate."""
    m = equal_rate(doc)
    if m is None:
        return []
    rows = []
    for arr in doc["arrangements"]:
        summaries = summaries_at(arr, m)
        if not summaries:
            continue
        for name in sorted(summaries[0]["by_class"]):
            groups = [s["by_class"][name] for s in summaries if name in s["by_class"]]
            per_cost = [good_per_cost(s, arr.get("cost_per_hour")) for s in summaries]
            rows.append({
                "class": name, "arrangement": arr["name"], "kind": arr["kind"],
                "attainment": spread([g["attainment"] for g in groups]),
                "goodput_rps": spread([g.get("goodput_rps", 0.0) for g in groups]),
                "abandoned": spread([g["failures"].get("abandoned", 0) for g in groups]),
                "good_per_cost": spread([p[name] for p in per_cost if p and name in p]) if any(per_cost) else None,
                "capacity_rps": (arr.get("class_capacity_rps") or {}).get(name),
            })
    return rows


def _best(rows: list[dict], one_run: bool) -> tuple[dict, bool] | None:
    """The row with the highest median attainment, and whether it is clearly ahead of the next."""
    if not rows:
        return None
    ranked = sorted(rows, key=lambda r: -(r["attainment"]["median"] or 0.0))
    if len(ranked) == 1:
        return ranked[0], True
    a, b = ranked[0]["attainment"], ranked[1]["attainment"]
    clear = (a["median"] - b["median"] >= 0.05) if one_run else clear_winner(a, b) > 0
    return ranked[0], clear


def classes_sentence(doc: dict) -> str:
    """' Per class (at the compared rate): chat best served by X (95% good vs 60%); ...' or ''."""
    classes = doc.get("classes") or {}
    rows = class_table(doc)
    if len(classes) < 2 or not rows:
        return ""
    one_run = doc.get("repeat", 1) <= 1
    parts = []
    for name in sorted({r["class"] for r in rows}):
        mine = [r for r in rows if r["class"] == name]
        best = _best(mine, one_run)
        if best is None:
            continue
        row, clear = best
        listing = ", ".join(f"{r['arrangement']} {r['attainment']['median']:.0%}" for r in mine)
        who = f"best served by {row['arrangement']}" if clear else "no clear best"
        parts.append(f"{name}: {who} ({listing} good)")
    text = " Per class at the compared rate: " + "; ".join(parts) + "."
    per_cost = [r for r in rows if r["good_per_cost"] is not None]
    if per_cost:
        text += " Good requests per unit of cost (per hour): " + "; ".join(
            f"{r['class']} on {r['arrangement']} {r['good_per_cost']['median']:.0f}" for r in per_cost) + "."
    return text + _abandoned_sentence(doc)


def _abandoned_sentence(doc: dict) -> str:
    m = equal_rate(doc)
    parts = []
    for arr in doc["arrangements"]:
        summaries = summaries_at(arr, m) if m is not None else []
        work = summaries[0].get("abandoned_work") if summaries else None
        if work and work["num_requests"]:
            server = work.get("server")
            said = (f"; the server counted {server['prompt_tokens_prefilled']:.0f} prompt and "
                    f"{server['tokens_decoded']:.0f} generated tokens for aborted requests" if server else "")
            parts.append(f"{arr['name']} {work['num_requests']} requests, {work['prompt_tokens_prefilled']} prompt "
                         f"tokens prefilled (+ up to {work['prompt_tokens_maybe_prefilled']} more) and "
                         f"{work['tokens_decoded']} tokens decoded{said}")
    if not parts:
        return ""
    return (" Work spent on requests whose users gave up (first repeat, as the client counted it): "
            + "; ".join(parts) + ".")


def classes_html(doc: dict) -> str:
    """The report's per-class table (empty when the trial has one class)."""
    rows = class_table(doc)
    if len(doc.get("classes") or {}) < 2 or not rows:
        return ""

    def pct(sp):
        return "n/a" if sp is None or sp["median"] is None else f"{sp['median']:.0%}"

    def num(sp, fmt="{:.3f}"):
        return "-" if sp is None or sp["median"] is None else fmt.format(sp["median"])

    body = "".join(
        f"<tr><td>{html.escape(r['class'])}</td><td>{html.escape(r['arrangement'])}</td><td>{pct(r['attainment'])}"
        f"</td><td>{num(r['goodput_rps'])}</td><td>{num(r['abandoned'], '{:.0f}')}</td>"
        f"<td>{'-' if r['capacity_rps'] is None else format(r['capacity_rps'], '.3f')}</td>"
        f"<td>{num(r['good_per_cost'], '{:.0f}')}</td></tr>" for r in rows)
    slos = "".join(
        f"<li>{html.escape(name)}: {slo_text(c['slo'])}{patience_text(c)}</li>" for name, c in doc["classes"].items())
    return (f"<h2>Service classes</h2><ul>{slos}</ul><table><tr><th>class</th><th>arrangement</th><th>good</th>"
            "<th>goodput req/s</th><th>abandoned</th><th>class capacity req/s (mix rate)</th>"
            f"<th>good per cost-hour</th></tr>{body}</table>")


def slo_text(slo: dict) -> str:
    parts = [f"{label} &le; {slo[key]} s" for key, label in
             (("ttft_s", "TTFT"), ("gap_s", f"p{slo['gap_percentile']:g} gap"), ("max_pause_s", "longest pause"),
              ("e2e_s", "end-to-end")) if slo.get(key) is not None]
    return ", ".join(parts)


def patience_text(cls: dict) -> str:
    out = ""
    if cls.get("patience"):
        p = cls["patience"]
        out += "; gives up after " + " or ".join(
            f"{label} {p[key]} s" for key, label in (("ttft_s", "no first token in"), ("total_s", "no answer in"))
            if p.get(key) is not None)
    if cls.get("priority") is not None:
        out += f"; priority {cls['priority']}"
    return out
