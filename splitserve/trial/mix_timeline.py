"""The role timeline of an adaptive arrangement (`serve --adaptive`): what the server's mix
controller changed during one replay, and why, read from its `GET /admin/mix` at the end.

Times are seconds after the replay's start (the server's wall clock against the trial's, both
on this host), so a change lines up with the phases and the requests of the same run.
"""
from __future__ import annotations

import html

import httpx


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
    changes = [{"at_s": round(d["wall_time"] - started_wall, 3), "instance": d["instance_id"],
                "from_role": d["from_role"], "to_role": d["to_role"], "applied": bool(d.get("applied")),
                "reason": d["reason"], "error": d.get("error")}
               for d in entries if d.get("instance_id") is not None]
    end = dict(doc.get("roles", {}))
    start = dict(end)
    for change in reversed([c for c in changes if c["applied"]]):
        start[change["instance"]] = change["from_role"]
    return {"roles_at_start": start, "roles_at_end": end, "changes": changes, "num_decisions": len(entries),
            "interval_s": doc.get("interval_s"), "targets": doc.get("targets")}


def timeline_cell(summary: dict) -> str:
    """One table cell: the applied changes in order, e.g. `12.0 s engine-1 colocated->prefill`."""
    timeline = summary.get("role_timeline")
    if not timeline:
        return "-"
    applied = [c for c in timeline["changes"] if c["applied"]]
    refused = len(timeline["changes"]) - len(applied)
    cell = "; ".join(f"{c['at_s']:.1f} s {c['instance']} {c['from_role']}->{c['to_role']}" for c in applied)
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
                       f"<td style='text-align:left'>{html.escape(c['reason'])}</td></tr>" for c in timeline["changes"])
        parts.append(f"<h3>{html.escape(a['name'])} ({runs[0].get('purpose', 'fixed')} run, repeat "
                     f"{runs[0].get('repeat', 0) + 1})</h3><p>Roles at the start: {html.escape(starts)}; "
                     f"{timeline['num_decisions']} decisions.</p>"
                     + (f"<table><tr><th>at</th><th>instance</th><th>change</th><th>outcome</th><th>reason</th></tr>"
                        f"{rows}</table>" if rows else "<p>No role change.</p>"))
    return "<h2>Role timeline (adaptive stage mix)</h2>" + "".join(parts) if parts else ""
