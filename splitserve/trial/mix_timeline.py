"""The role timeline of an adaptive arrangement (`serve --adaptive`): what the server's mix
controller changed during one replay, and why, read from its `GET /admin/mix` at the end.

Times are seconds after the replay's start (the server's wall clock against the trial's, both
on this host), so a change lines up with the phases and the requests of the same run.

Switch time (issue 31), per applied change: from the demand shift the controller read to the
change committed (the decision is logged once the change is done). The shift is the decision's
own `shift_wall_time` when the controller records one, else the first decision since the
previous change (or the replay's start) whose estimate for the mix as it was missed a target,
or that proposed this same move. Beside it, the attainment of the requests sent in the 30 s
after the change.
"""
from __future__ import annotations

import html

import httpx

from splitserve.trial.metrics import is_good, request_metrics, slo_of

AFTER_CHANGE_S = 30.0
# a decision's fields kept in the timeline's brief log (GET /admin/mix has them all)
DECISION_FIELDS = ("held", "instance_id", "to_role", "ttft_estimate_s", "gap_estimate_s", "predicted_ttft_s",
                   "predicted_gap_s", "predicted_gain", "predicted_cost", "deadlines_met", "overload",
                   "chunk_tokens", "local_prefill_max_tokens", "stream_caps", "reason")


def _misses(entry: dict, targets: dict | None) -> bool:
    targets = targets or {}
    return any(entry.get(key) is not None and targets.get(target) is not None and entry[key] > targets[target]
               for key, target in (("ttft_estimate_s", "ttft_s"), ("gap_estimate_s", "gap_s")))


def _shift_wall(entries: list[dict], n: int, start: int, targets: dict | None) -> float:
    """When the controller first read the shift that decision `n` answers (see the module docstring)."""
    change = entries[n]
    if change.get("shift_wall_time") is not None:
        return change["shift_wall_time"]
    for e in entries[start:n + 1]:
        same_move = (e.get("instance_id"), e.get("to_role")) == (change["instance_id"], change["to_role"])
        if same_move or _misses(e, targets):
            return e["wall_time"]
    return change["wall_time"]


def _switch_times(entries: list[dict], targets: dict | None, started_wall: float) -> dict[int, float]:
    """Decision index -> switch time (s), for the applied changes."""
    out, start = {}, 0
    for n, e in enumerate(entries):
        if e.get("instance_id") is not None and e.get("applied"):
            out[n] = round(e["wall_time"] - max(_shift_wall(entries, n, start, targets), started_wall), 3)
            start = n + 1
    return out


def fetch_role_timeline(base_url: str, started_wall: float, timeout_s: float = 5.0) -> dict | None:
    """The changes decided since `started_wall` (time.time() at the replay's start), the roles at
    the start and the end; None when the server does not adapt or cannot be asked."""
    try:
        resp = httpx.get(f"{base_url}/admin/mix", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    doc = resp.json()
    entries = [d for d in doc.get("decisions", []) if d.get("wall_time", 0.0) >= started_wall]
    switch = _switch_times(entries, doc.get("targets"), started_wall)
    changes = [{"at_s": round(d["wall_time"] - started_wall, 3), "instance": d["instance_id"],
                "from_role": d["from_role"], "to_role": d["to_role"], "applied": bool(d.get("applied")),
                "reason": d["reason"], "error": d.get("error"), "switch_s": switch.get(n)}
               for n, d in enumerate(entries) if d.get("instance_id") is not None]
    end = dict(doc.get("roles", {}))
    start = dict(end)
    for change in reversed([c for c in changes if c["applied"]]):
        start[change["instance"]] = change["from_role"]
    # every decision in brief, the held ones too: why the mix did not move when it did not
    brief = [{"at_s": round(d["wall_time"] - started_wall, 3),
              **{k: d.get(k) for k in DECISION_FIELDS if d.get(k) is not None}} for d in entries]
    return {"roles_at_start": start, "roles_at_end": end, "changes": changes, "num_decisions": len(entries),
            "interval_s": doc.get("interval_s"), "targets": doc.get("targets"), "decisions": brief}


def add_attainment_after(timeline: dict | None, records: list, slo, pause_threshold_s: float,
                         class_slos: dict | None = None) -> None:
    """Each applied change gets the attainment of the requests sent in the AFTER_CHANGE_S after
    it (None when none was), judged as the run's summary judges them."""
    if not timeline:
        return
    judged = []  # (sent_s, good)
    for r in records:
        if r.sent_s is not None:
            s = slo_of(r, slo, class_slos)
            judged.append((r.sent_s, is_good(request_metrics(r, s, pause_threshold_s), s)))
    for change in timeline["changes"]:
        if not change["applied"]:
            continue
        window = [g for t, g in judged if change["at_s"] <= t < change["at_s"] + AFTER_CHANGE_S]
        change["attainment_after"] = round(sum(window) / len(window), 4) if window else None
        change["num_after"] = len(window)


def _switch_text(c: dict) -> str:
    parts = []
    if c.get("switch_s") is not None:
        parts.append(f"switch {c['switch_s']:.1f} s")
    if c.get("attainment_after") is not None:
        parts.append(f"{c['attainment_after']:.0%} in the next {AFTER_CHANGE_S:.0f} s")
    return ", ".join(parts)


def timeline_cell(summary: dict) -> str:
    """One table cell: the applied changes in order, e.g. `12.0 s engine-1 colocated->prefill`."""
    timeline = summary.get("role_timeline")
    if not timeline:
        return "-"
    applied = [c for c in timeline["changes"] if c["applied"]]
    refused = len(timeline["changes"]) - len(applied)
    cell = "; ".join(f"{c['at_s']:.1f} s {c['instance']} {c['from_role']}->{c['to_role']}"
                     + (f" ({_switch_text(c)})" if _switch_text(c) else "") for c in applied)
    cell = cell or "no change"
    return cell + (f" ({refused} refused)" if refused else "")


def timeline_html(doc: dict) -> str:
    """One table per adaptive arrangement's first run: when, which instance, from, to, and why."""
    parts = []
    for a in doc["arrangements"]:
        runs = [r for r in a["runs"] if r["summary"].get("role_timeline")]
        if not runs:
            continue
        timeline = runs[0]["summary"]["role_timeline"]
        starts = ", ".join(f"{i} {r}" for i, r in sorted(timeline["roles_at_start"].items()))
        rows = "".join(f"<tr><td>{c['at_s']:.1f} s</td><td>{html.escape(c['instance'])}</td>"
                       f"<td>{html.escape(c['from_role'])} &rarr; {html.escape(c['to_role'])}</td>"
                       f"<td>{'applied' if c['applied'] else 'refused: ' + html.escape(c['error'] or '')}</td>"
                       f"<td>{_fmt_s(c.get('switch_s'))}</td><td>{_fmt_share(c.get('attainment_after'))}</td>"
                       f"<td style='text-align:left'>{html.escape(c['reason'])}</td></tr>" for c in timeline["changes"])
        parts.append(f"<h3>{html.escape(a['name'])} ({runs[0].get('purpose', 'fixed')} run, repeat "
                     f"{runs[0].get('repeat', 0) + 1})</h3><p>Roles at the start: {html.escape(starts)}; "
                     f"{timeline['num_decisions']} decisions.</p>"
                     + (f"<table><tr><th>at</th><th>instance</th><th>change</th><th>outcome</th>"
                        f"<th>switch time (shift read &rarr; committed)</th>"
                        f"<th>attainment, next {AFTER_CHANGE_S:.0f} s</th><th>reason</th></tr>"
                        f"{rows}</table>" if rows else "<p>No role change.</p>"))
    return "<h2>Role timeline (adaptive stage mix)</h2>" + "".join(parts) if parts else ""


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
