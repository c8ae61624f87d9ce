"""The paragraph that answers the buyer's question, read from a results document alone.

Every sentence states a measured number; none explains a mechanism the trial did not measure.
The headline is capacity within the SLOs when the trial searched it; the fixed-rate run is
compared only at a rate every arrangement ran. With repeats a winner is named only when the
ranges (min-max over repeats) do not overlap; else "no clear difference".
"""
from __future__ import annotations

from splitserve.trial.capacity import clear_winner
from splitserve.trial.class_report import classes_sentence
from splitserve.trial.results import equal_rate, fmt_capacity, fmt_seconds, fmt_spread, main_summary, stats_at

SEPARATED, COLOCATED = "separated", "colocated"


def _rps(x: float) -> str:
    return f"{x:.2f} req/s"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def verdict(doc: dict) -> str:
    arrs = doc["arrangements"]
    failed = [a["name"] for a in arrs if a["error"]]
    note = f" Arrangements that failed: {', '.join(failed)} (see their logs)." if failed else ""
    q = doc.get("quote")
    if q:
        return (fitted_verdict(q) + _fitted_context(doc, q) + _network(doc) + _warnings(doc, fitted=True)
                + note)
    cal = doc.get("calibration") or {}
    if cal.get("no_capacity"):  # runner._no_capacity_to_scale: the load is a share of a capacity nobody has
        return f"No verdict: {cal['note']}." + note
    capacity = _capacity_part(doc)
    fixed, fixed_answer = _fixed_part(doc, headline=capacity is None)
    if capacity is None and fixed is None:
        return "No arrangement completed a run, so there is no verdict." + note
    if cal.get("note"):
        note = f" Calibration: {cal['note']}." + note
    if capacity is not None:
        text, answer = capacity
        return (text + answer + (" " + fixed + fixed_answer if fixed else "") + classes_sentence(doc) + _tuned(doc)
                + _network(doc) + _warnings(doc) + note)
    return fixed + fixed_answer + classes_sentence(doc) + _tuned(doc) + _network(doc) + _warnings(doc) + note


def _best(arrs: list[dict], kind: str, key) -> dict | None:
    cands = [a for a in arrs if a["kind"] == kind and key(a) is not None]
    return max(cands, key=key) if cands else None


def _capacity_part(doc: dict) -> tuple[str, str] | None:
    searched = [a for a in doc["arrangements"] if a.get("capacity_rps")]
    if not searched:
        return None
    reps = doc.get("repeat", 1)
    target = doc["slo"].get("attainment", 0.9)
    listing = "; ".join(f"{a['name']} {fmt_capacity(a, reps)}" for a in
                        sorted(searched, key=lambda a: -(a["capacity_rps"]["median"] or 0)))
    spread_note = "; median, min-max over repeats" if reps > 1 else ""
    text = (f"Capacity within the SLOs (the highest rate at which at least {_pct(target)} of requests met "
            f"every SLO{spread_note}): {listing}.")
    open_ended = [a["name"] for a in searched if any(c["failed_rps"] is None for c in a.get("capacity", []))]
    if open_ended:
        text += (f" For {', '.join(open_ended)} the search ran out of probes or time before a rate failed: "
                 f"a lower bound.")
    if all(not a["capacity_rps"]["max"] for a in searched):
        return text, (" No arrangement held any rate tried within the SLOs, so there is no verdict on "
                      "separating prefill: on this machine these SLOs are out of reach for this workload (or the "
                      "machine was busy); loosen the SLOs, shorten the requests, or rerun on a quiet machine.")
    key = lambda a: a["capacity_rps"]["median"]  # noqa: E731
    sep, col = _best(searched, SEPARATED, key), _best(searched, COLOCATED, key)
    if sep is None or col is None:
        return text, ""
    s, c = sep["capacity_rps"], col["capacity_rps"]
    ratio = f"{s['median'] / c['median']:.2f}x" if c["median"] else "more than any colocated setting held"
    resolution = doc.get("capacity_precision", 0.1) if reps <= 1 else 0.0
    winner = clear_winner(s, c, resolution)
    bracket_note = ""
    if winner and reps <= 1:
        # a search stopped by its budget brackets a capacity within a factor of 2, not `precision`:
        # one run shows a winner only when it held a rate at which the other failed
        won, lost = (sep, col) if winner > 0 else (col, sep)
        failed = [x["failed_rps"] for x in lost.get("capacity", []) if x.get("failed_rps")]
        held = won["capacity_rps"]["median"]
        if failed and held < min(failed) * (1 - 1e-9):
            winner, bracket_note = 0, (f"{lost['name']} failed only at {min(failed):.3f} req/s, above the "
                                       f"{held:.3f} req/s {won['name']} held, so their searches' brackets overlap")
    loser = {1: col, -1: sep}.get(winner)
    if loser is not None and loser["name"] in open_ended:
        # a lower bound that lost may be higher still: no verdict until its search finds a failing rate
        return text, (f" Separate prefill: no clear difference yet. {loser['name']} held every rate its search "
                      f"tried, so its capacity may exceed the other's; raise capacity.max_probes or budget_s.")
    if winner > 0:
        answer = (f" Separate prefill: yes. {sep['name']} holds {fmt_spread(s, _rps, reps)} within the SLOs, the "
                  f"best colocated ({col['name']}) {fmt_spread(c, _rps, reps)}: {ratio}.")
    elif winner < 0:
        back = f"{c['median'] / s['median']:.2f}x" if s["median"] else "while the separated one held none"
        answer = (f" Separate prefill: no. The best colocated ({col['name']}) holds {fmt_spread(c, _rps, reps)} "
                  f"within the SLOs, {sep['name']} {fmt_spread(s, _rps, reps)}: {back}.")
    else:
        why = ("their ranges over repeats overlap" if reps > 1 else bracket_note or
               f"they differ by less than the search's precision ({resolution:.0%})")
        answer = (f" Separate prefill: no clear difference. {sep['name']} {fmt_spread(s, _rps, reps)} against "
                  f"{col['name']} {fmt_spread(c, _rps, reps)}: {why}; the simpler colocated setup is the default.")
    return text, answer


def _fixed_part(doc: dict, headline: bool = True) -> tuple[str | None, str]:
    """The fixed-rate comparison; with a capacity headline it only says who met more deadlines."""
    m = equal_rate(doc)
    if m is None:
        return None, ""
    reps = doc.get("repeat", 1)
    ran = [(a, stats_at(a, m), main_summary(a, m)) for a in doc["arrangements"]]
    ran = [(a, st, s) for a, st, s in ran if st is not None]
    rate = ran[0][2].get("offered_rate_rps")
    at = f"At {_rps(rate)} offered (x{m:.3g} of the spec's rate)" if rate else f"At x{m:.3g} of the spec's rate"
    listing = "; ".join(f"{a['name']} {fmt_spread(st['attainment'], _pct, reps)} good, goodput "
                        f"{fmt_spread(st['goodput_rps'], _rps, reps)}" for a, st, _ in ran)
    text = f"{at}: {listing}."
    key = lambda a: stats_at(a, m)["attainment"]["median"] if stats_at(a, m) else None  # noqa: E731
    arrs = [a for a, _, _ in ran]
    sep, col = _best(arrs, SEPARATED, key), _best(arrs, COLOCATED, key)
    if all(st["attainment"]["max"] < 0.5 for _, st, _ in ran):
        return text, " Separate prefill: no verdict from an overloaded run." if headline else ""
    if sep is None or col is None:
        return text, ""
    s_st, c_st = stats_at(sep, m), stats_at(col, m)
    if reps > 1:
        winner = clear_winner(s_st["attainment"], c_st["attainment"]) or clear_winner(s_st["goodput_rps"],
                                                                                      c_st["goodput_rps"])
    else:  # one run: a difference of one request in twenty is noise
        diff = s_st["attainment"]["median"] - c_st["attainment"]["median"]
        winner = (1 if diff > 0 else -1) if abs(diff) >= 0.05 else 0
    facts = (f" p99 inter-token gap {sep['name']} {fmt_seconds(s_st['gap_p99_s']['median'])} vs {col['name']} "
             f"{fmt_seconds(c_st['gap_p99_s']['median'])}; longest pause p99 "
             f"{fmt_seconds(s_st['longest_pause_p99_s']['median'])} vs "
             f"{fmt_seconds(c_st['longest_pause_p99_s']['median'])}; streams interrupted by a pause "
             f"{_pct(s_st['interrupted_share']['median'])} vs {_pct(c_st['interrupted_share']['median'])}; "
             f"p99 TTFT {fmt_seconds(s_st['ttft_p99_s']['median'])} vs {fmt_seconds(c_st['ttft_p99_s']['median'])}.")
    if not headline:
        who = {1: f"{sep['name']} met more deadlines than {col['name']}",
               -1: f"{col['name']} met more deadlines than {sep['name']}"}.get(winner, "no clear difference")
        return text + facts, f" At this rate: {who}."
    if winner > 0:
        answer = f" Separate prefill: yes at this rate: {sep['name']} met more deadlines than {col['name']}."
    elif winner < 0:
        answer = (f" Separate prefill: no at this rate: {col['name']} met more deadlines than {sep['name']}"
                  f"{_split_cost(main_summary(sep, m), main_summary(col, m))}.")
    else:
        answer = (f" Separate prefill: not at this load: {sep['name']} and {col['name']} met about as many "
                  f"deadlines, so the simpler colocated setup is the default; search the capacity "
                  f"(capacity: in the spec) to see which holds more load.")
    return text + facts, answer


def _split_cost(sep_s: dict, col_s: dict) -> str:
    """Where the separated arrangement measured worse, from the numbers."""
    costs = []
    if (sep_s["ttft_s"]["p99"] or 0) > (col_s["ttft_s"]["p99"] or 0):
        costs.append(f"its p99 TTFT was {fmt_seconds(sep_s['ttft_s']['p99'])} against "
                     f"{fmt_seconds(col_s['ttft_s']['p99'])}")
    if (sep_s["tpot_s"]["p50"] or 0) > (col_s["tpot_s"]["p50"] or 0):
        costs.append(f"its median TPOT {fmt_seconds(sep_s['tpot_s']['p50'])} against "
                     f"{fmt_seconds(col_s['tpot_s']['p50'])}")
    if sep_s["kv_transfer"].get("failed"):
        costs.append(f"{sep_s['kv_transfer']['failed']} KV transfers failed")
    return ": " + "; ".join(costs) if costs else ""


def _tuned(doc: dict) -> str:
    tuning = doc.get("tuning")
    if not tuning or not tuning.get("best"):
        return ""
    tried = ", ".join(f"{p['name']} {_pct(p['attainment'])}" for p in tuning["points"] if p["attainment"] is not None)
    joined = (f"it joined the trial as {tuning['joins_as']}" if tuning.get("joins_as") else
              f"that is {tuning['base']} itself")
    return (f" Colocated settings tried at x{tuning['rate_multiplier']:.3g} of the nominal rate (the lowest rate "
            f"the reference failed, or its capacity), share of requests good: {tried}; the best is "
            f"{tuning['best']}, and {joined}.")


def _network(doc: dict) -> str:
    """Which arrangements crossed a link between hosts, and which one: part of what they paid."""
    across = [f"{a['name']} ({a['network']})" for a in doc["arrangements"] if a.get("network")]
    return f" Across hosts: {'; '.join(across)}; the others ran on one host." if across else ""


def _iv(c: dict) -> str:
    """'0.70 req/s [0.62-0.78]', 'at least 0.70 req/s', 'at most 0.05 req/s', each bound with why."""
    if c["kind"] == "point":
        return f"{c['estimate_rps']:.2f} req/s [{c['lo_rps']:.2f}-{c['hi_rps']:.2f}]"
    points = c.get("points") or []
    if c["kind"] == "at_least":
        if any(p["n"] and p["good"] / p["n"] < _target(c) for p in points):
            return f"at least {c['estimate_rps']:.2f} req/s (its fitted curve crosses above every rate probed)"
        return f"at least {c['estimate_rps']:.2f} req/s (every rate probed held)"
    if c["kind"] == "at_most":
        ceiling = c.get("ceiling") or 1.0
        if ceiling < 1.0 and any(p["n"] and p["good"] / p["n"] >= _target(c) for p in points):
            return (f"at most {c['estimate_rps']:.2f} req/s (its curve levels off at {ceiling:.0%} good, under "
                    f"the target, so no rate holds it reliably)")
        if ceiling < 1.0 and not points:
            return f"at most {c['estimate_rps']:.2f} req/s (its curve levels off at {ceiling:.0%} good, under the target)"
        return f"at most {c['estimate_rps']:.2f} req/s (no rate probed held)"
    return "not measured"


def _target(c: dict) -> float:
    """The attainment target a capacity was read against (quote() stores it per arrangement)."""
    return c.get("target", 0.9)


def _ratio(r: dict) -> str:
    if r.get("estimate") is not None:
        return f"{r['estimate']:.2f}x [{r['lo']:.2f}-{r['hi']:.2f}]"
    if r.get("lo") is not None:
        return f"at least {r['lo']:.2f}x"
    return f"at most {r['hi']:.2f}x"


def fitted_verdict(q: dict) -> str:
    """The first sentence, the one decision: from the ratio's interval alone (quote.decide)."""
    from splitserve.trial.quote import decided_by_meeting

    per, sep, col, r = q["arrangements"], q["separated"], q["colocated"], q["ratio"]
    what = (f"(capacity: the offered rate where a curve fitted to every probed request crosses "
            f"{_pct(q['target'])} good; {_pct(q['level'])} intervals)")
    if q["held_nothing"]:
        return (f"Separate prefill: no verdict. No arrangement held {_pct(q['target'])} good at any rate probed "
                f"{what}: on this machine these SLOs are out of reach for this workload (or the machine was "
                f"busy); loosen the SLOs, shorten the requests, or rerun on a quiet machine.")
    if sep is None or col is None:
        best = max(per.values(), key=lambda c: c["estimate_rps"] or 0)
        return f"Capacity within the SLOs {what}: the best is {best['name']}, {_iv(best)}."
    s, c, decision = per[sep], per[col], q["decision"]
    meets = ""
    if r and decided_by_meeting(r) == decision:   # the ratio's end is 1: say why it still decides
        up, down = (sep, col) if decision == "yes" else (col, sep)
        meets = (f"; the two meet only at {r['meets_at_rps']:.2f} req/s, a rate both ran: {up} held it or "
                 f"crosses above it, {down} failed it or crosses below")
    if decision == "yes":
        return (f"Separate prefill: yes. {sep} holds {_iv(s)} within the SLOs, the best colocated setting "
                f"({col}) {_iv(c)}: {_ratio(r)} {what}{meets}.")
    if decision == "no":
        back = ({"estimate": 1 / r["estimate"] if r.get("estimate") else None,
                 "lo": 1 / r["hi"] if r.get("hi") else None, "hi": 1 / r["lo"] if r.get("lo") else None})
        return (f"Separate prefill: no. The best colocated setting ({col}) holds {_iv(c)} within the SLOs, "
                f"{sep} {_iv(s)}: colocated holds {_ratio(back)} as much {what}{meets}.")
    why = (f"the ratio {_ratio(r)} reaches 1" if r else
           "their capacities are bounds on the same side, so they cannot be ordered")
    return (f"Separate prefill: no clear difference. {sep} holds {_iv(s)} within the SLOs, the best colocated "
            f"setting ({col}) {_iv(c)}: {why} {what}; the simpler colocated setup is the default.")


def _fitted_context(doc: dict, q: dict) -> str:
    """Everything after the verdict: each arrangement, per class, the tuning, the host, the
    fixed-rate runs (numbers only: the decision is the capacities')."""
    from splitserve.trial.quote import fixed_rule

    per = q["arrangements"]
    out = " Every arrangement: " + "; ".join(f"{n} {_iv(c)}" for n, c in per.items()) + "."
    classes = sorted({k for c in per.values() for k in c["by_class"]})
    if len(classes) > 1:
        out += " Per class (the offered rate of the whole mix at which that class's curve crosses the target): " + \
            "; ".join(f"{k}: " + ", ".join(f"{n} {_iv(c['by_class'][k])}" for n, c in per.items()
                                          if k in c["by_class"]) for k in classes) + "."
    out += _other_targets(q)
    tuning = doc.get("tuning") or {}
    if tuning.get("method") == "fitted":
        tried = ", ".join(f"{p['name']} {_iv(p)}" for p in tuning["points"] if p.get("kind"))
        joined = (f"it continued as {tuning['joins_as']}, its probes kept" if tuning.get("joins_as")
                  else f"that is {tuning['base']} itself")
        out += (f" Colocated settings searched side by side for {tuning['rounds']} rounds: {tried}; the best is "
                f"{tuning['best']}, and {joined}.")
    sbs = doc.get("side_by_side") or []
    host = q["host"]
    if sbs and all(x["together"] for x in sbs):
        idle = host.get("idle_cpu_share_max")
        out += (f" All servers ran side by side, probes interleaved in rotating order on identical requests"
                + (f"; an idle server took at most {idle:.1%} of a core while another was probed" if idle is not None
                   else "") + ".")
    elif sbs:
        out += (" Memory did not allow every server at once: the arrangements ran one after another in rotating "
                "order, so drift between their launches is not shared (the ratio is not paired by time).")
    if host["probes"]:
        if host["watched"]:
            runs = (f"{host['probes'] + host['fixed']} probes and fixed-rate runs" if host.get("fixed")
                    else f"{host['probes']} probes run")
            out += (f" Host: {host['disturbed']} of {runs} were disturbed (other processes "
                    f"took more than 10% of the cores), {host['redone']} redone")
            if host.get("speed_spread"):
                lo, hi = host["speed_spread"]
                out += f"; the machine's speed between probes ranged {lo:.0%}-{hi:.0%} of its median"
            out += "."
        else:
            out += " Host: not watched (no /proc)."
        out += _engine_speed(q.get("engine_speed"))
    m = equal_rate(doc)
    if m is not None:
        comparison, why = fixed_rule(doc, m)
        ran = [(a, main_summary(a, m)) for a in doc["arrangements"] if main_summary(a, m)]
        rate = ran[0][1].get("offered_rate_rps") if ran else None
        listing = "; ".join(f"{a['name']} {s['num_good']}/{s['num_requests']} good" for a, s in ran)
        label = ("a comparison" if comparison else
                 f"an illustration only, not a comparison: {why}")
        at = f"{_rps(rate)}" if rate else f"x{m:.3g} of the spec's rate"
        out += f" The fixed-rate run at {at} ({label}): {listing}."
    return out


def _engine_speed(e: dict | None) -> str:
    """The host through the engines' eyes (quote.engine_speed_summary): how far the runs' steps moved
    against the same steps in their arrangement's other runs, and how many were off."""
    from splitserve.trial.quote import OFF_SPEED

    if not e:
        return ""
    off = e["slow"] + e["fast"]
    return (f" Engines: the runs' steps took {e['lo']:.0%}-{e['hi']:.0%} of the time the same steps took in their "
            f"arrangement's median run ({e['runs']} runs read)"
            + (f"; {off} ran more than {OFF_SPEED - 1:.0%} off it ({e['slow']} slow, {e['fast']} fast), "
               f"marked in the table of runs" if off else "") + ".")


def _other_targets(q: dict) -> str:
    """How the decision reads at targets beside the spec's, from the same probes (quote.at_other_targets).
    Said only where it differs from the decision at the spec's target: the first sentence stays the
    one decision, this says how much it rests on where the target sits."""
    words = {"yes": "separating would be a yes", "no": "colocated would be better",
             "unclear": "there would be no clear difference"}
    differ = [o for o in q.get("other_targets") or [] if o["decision"] != q.get("decision")]
    if not differ:
        return ""
    sep, col = q["separated"], q["colocated"]
    parts = [f"at {_pct(o['target'])} good {words[o['decision']]} ({sep} {_iv(o['separated'])}, {col} "
             f"{_iv(o['colocated'])}" + (f": {_ratio(o['ratio'])}" if o["ratio"] else "") + ")" for o in differ]
    return (f" The decision turns on the target: from the same probes, {'; '.join(parts)}; the decision above is "
            f"the spec's target's ({_pct(q['target'])}).")


def _warnings(doc: dict, fitted: bool = False) -> str:
    """Say when the comparison itself is weak: the load generator lagged, or every arrangement drowned."""
    m = equal_rate(doc)
    ran = [(a, main_summary(a, m)) for a in doc["arrangements"] if main_summary(a, m)]
    out = ""
    lag = max(((s["client_lag_s"]["max"] or 0.0) for _, s in ran), default=0.0)
    if lag > 0.5:
        out += (f" Warning: the load generator sent some requests up to {fmt_seconds(lag)} late, so offered "
                f"load was lower than planned.")
    if ran and all(s["attainment"] < 0.5 for _, s in ran) and not fitted:
        worst = []
        for a, s in ran:
            kind, count = max(s["failures"].items(), key=lambda kv: kv[1])
            worst.append(f"{a['name']} {count}/{s['num_requests']} {kind}" if count else f"{a['name']} misses SLOs")
        out += (f" Warning: every arrangement met fewer than half its deadlines ({'; '.join(worst)}): the "
                f"comparison says little; search the capacity (capacity: in the spec), or state the rate as a "
                f"share of it (rate: {{fraction_of_capacity: 0.7, reference: ...}}).")
    return out
