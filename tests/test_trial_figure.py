"""The headline figure and the per-run table draw from a results document of the first real run's
shape: probes with every request good and with none good, per class, fixed-rate runs under the
host's watch (one disturbed and redone), and an engine that ran slow in one run."""
from splitserve.trial import quote as quote_mod
from splitserve.trial.curve import wilson
from splitserve.trial.figure import capacity_figure, probes_html
from splitserve.trial.verdict import _fitted_context


def probe(rate, goods, classes, round_, step_s=0.03, purpose="probe", disturbed=False, attempt=0):
    n = len(goods)
    return {"purpose": purpose, "repeat": 0, "rate_multiplier": rate,
            "summary": {"offered_rate_rps": rate, "round": round_, "num_requests": n, "num_good": sum(goods),
                        "num_decided": n, "attempt": attempt, "disturbed": disturbed,
                        "outcomes": {"index": list(range(n)), "good": goods, "class": classes},
                        "host": {"others_share": 0.3 if disturbed else 0.0, "steal_share": 0.0},
                        "speed_units_per_s": 4e6, "idle_cpu_share": {"other": 0.002},
                        "decode_step_median_s": step_s,
                        "idle_before": {"checked": True, "idle": True, "wait_s": 0.4, "busy_requests": 0}}}


def fixed(rate, good, step_s, purpose="fixed", disturbed=False, attempt=0):
    run = probe(rate, [True] * good + [False] * (19 - good), ["chat"] * 13 + ["document"] * 6, 0, step_s,
                purpose, disturbed, attempt)
    del run["summary"]["round"]
    run["summary"]["by_class"] = {"chat": {"num_requests": 13}, "document": {"num_requests": 6}}
    run["summary"]["idle_before"] = {"checked": True, "idle": False, "wait_s": 30.1, "busy_requests": 2}
    return run


def classes(n, docs):
    return ["document"] * docs + ["chat"] * (n - docs)


def results_doc():
    # run1's shape: 26/26, 40/40 good (and 6 of 6 documents: the count whose Wilson bound rounded
    # past 1), then 29/80; an arrangement with a probe none good (0 of 47 documents)
    best = [probe(0.95, [True] * 26, classes(26, 6), 0), probe(1.42, [True] * 40, classes(40, 14), 1),
            probe(2.74, [False] * 47 + [True] * 29 + [False] * 4, classes(80, 47), 2),
            fixed(1.06, 4, 0.188, "fixed-disturbed", disturbed=True), fixed(1.06, 4, 0.188, attempt=1)]
    sep = [probe(0.95, [True] * 26, classes(26, 6), 0, 0.02), probe(1.42, [True] * 35 + [False] * 5,
                                                                      classes(40, 14), 1, 0.03),
           probe(2.42, [True] * 63 + [False] * 10, classes(73, 20), 2, 0.04), fixed(1.06, 19, 0.03)]
    arr = {"capacity": [{"method": "fitted"}], "error": None}
    return {"seed": 0, "slo": {"attainment": 0.9}, "side_by_side": [{"together": True}], "tuning": None,
            "arrangements": [{"name": "colocated-best", "kind": "colocated", "runs": best, **arr},
                             {"name": "1P1D", "kind": "separated", "runs": sep, **arr}]}


def test_a_wilson_interval_holds_its_own_share_at_every_count():
    for n in range(1, 201):
        for k in (0, n // 3, n):
            lo, hi = wilson(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n, lo, hi)


def test_the_figure_draws_probes_all_good_and_none_good_per_class():
    doc = results_doc()
    doc["quote"] = quote_mod.quote(doc)
    points = doc["quote"]["arrangements"]["colocated-best"]["points"]
    assert [(p["n"], p["good"]) for p in points] == [(26, 26), (40, 40), (80, 29)]
    assert points[0]["by_class"]["document"] == {"n": 6, "good": 6}
    assert points[2]["by_class"]["document"] == {"n": 47, "good": 0}
    png = capacity_figure(doc)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_fixed_runs_are_counted_with_the_probes_and_a_slow_engine_is_flagged():
    doc = results_doc()
    q = doc["quote"] = quote_mod.quote(doc)
    host = q["host"]
    assert (host["probes"], host["fixed"], host["disturbed"], host["redone"]) == (6, 3, 1, 1)
    steps = q["steps"]["colocated-best"]
    assert steps["probe_median_s"] == 0.03
    assert [(r["purpose"], r["slow"]) for r in steps["runs"]] == [
        ("probe", False), ("probe", False), ("probe", False), ("fixed-disturbed", True), ("fixed", True)]
    assert not any(r["slow"] for r in q["steps"]["1P1D"]["runs"])
    table = probes_html(doc)
    assert table.count("<tr>") == 1 + 9          # the header, six probes and three fixed-rate runs
    assert table.count("slow engine") == 2 + 1   # the two slow runs, and the caption
    assert "188 ms (30 ms): slow engine" in table
    assert "not idle after 30 s (2 requests): went ahead" in table
    context = _fitted_context(doc, q)
    assert "Host: 1 of 9 probes and fixed-rate runs were disturbed" in context and "1 redone" in context


def test_the_cdfs_and_pauses_draw_the_fullest_probe_at_or_below_the_capacity():
    from splitserve.trial.report import _drawn, drawn_probe

    doc = results_doc()
    q = doc["quote"] = quote_mod.quote(doc)
    best = doc["arrangements"][0]
    cap = q["arrangements"]["colocated-best"]
    assert cap["kind"] == "point" and 1.42 < cap["estimate_rps"] < 2.74
    # 0.95 (26 decided) and 1.42 (40) are at or below it; 2.74 (80 decided) is above: not drawn
    assert drawn_probe(best, cap)["summary"]["offered_rate_rps"] == 1.42
    assert drawn_probe(best, {**cap, "kind": "at_most"}) is None
    assert drawn_probe(best, {**cap, "kind": "at_least", "estimate_rps": 0.95})["summary"]["num_decided"] == 26
    for run in (r for a in doc["arrangements"] for r in a["runs"]):
        run["requests"] = [{"index": 0, "class_name": "chat", "sent_s": 0.0, "token_times_s": [0.2, 0.3]}]
    drawn, caption = _drawn(doc, None)
    assert drawn["colocated-best"][1] and caption.startswith(
        "Drawn from colocated-best: the probe at 1.420 req/s (repeat 1, round 1), 40 requests decided;")
