"""The verdict compares like with like (equal rates, ranges over repeats) and says only what it measured."""
from splitserve.trial.capacity import spread
from splitserve.trial.runner import ArrangementResult, RunResult, rotation
from splitserve.trial.results import results_document
from splitserve.trial.verdict import verdict

from test_trial_report import SPEC, run_of, stream


def smooth():
    return [stream(i, float(i), [0.1, 0.1, 0.1]) for i in range(4)]


def stalled(n_bad):
    return [stream(i, float(i), [0.1, 2.0 if i < n_bad else 0.1, 0.1]) for i in range(4)]


def at(multiplier, records, purpose="sweep", repeat=0):
    run = run_of(records)
    return RunResult(multiplier, run.summary, records, {}, repeat, purpose)


def test_a_sweep_that_stopped_early_is_compared_only_at_a_rate_both_ran():
    # colocated failed at x0.5 and stopped; 1P1D went on to x1.0, where it also did worse
    results = [ArrangementResult("colocated-whole", [at(0.5, stalled(3))]),
               ArrangementResult("1P1D", [at(0.5, smooth()), at(1.0, stalled(4))])]
    doc = results_document(SPEC, None, results, sweep=True)
    assert "x0.5 of the spec's rate" in doc["verdict"]
    assert "1P1D 100% good" in doc["verdict"] and "colocated-whole 25% good" in doc["verdict"]
    assert "Separate prefill: yes at this rate" in doc["verdict"]


def test_a_yes_states_numbers_not_a_mechanism_it_did_not_measure():
    # separated met more deadlines, yet its streams paused more: the verdict must say so, not the opposite
    sep = smooth()
    sep[3] = stream(3, 3.0, [0.1, 0.9, 0.1])                       # one pause of 0.9 s, still good
    col = [stream(i, float(i), [0.1, 0.1, 0.1]) for i in range(4)]
    for r in col[:2]:
        r.token_times_s = [t + 1.5 for t in r.token_times_s]        # late first tokens: not good
    doc = results_document(SPEC, None, [ArrangementResult("colocated-whole", [run_of(col)]),
                                        ArrangementResult("1P1D", [run_of(sep)])], sweep=False)
    v = doc["verdict"]
    assert "Separate prefill: yes" in v
    assert "never wait" not in v and "long prompt" not in v
    assert "longest pause p99 876 ms vs 100 ms" in v               # 1P1D worse here, and said so
    assert "streams interrupted by a pause 25% vs 0%" in v


def capacity_doc(sep_caps, col_caps, col_bracketed=True):
    doc = {"slo": {"attainment": 0.9}, "repeat": len(sep_caps), "capacity_precision": 0.1, "tuning": None,
           "arrangements": []}
    for name, kind, caps in (("1P1D", "separated", sep_caps), ("colocated-best", "colocated", col_caps)):
        bracketed = col_bracketed or kind == "separated"
        searches = [{"capacity_rps": c, "failed_rps": (c or 0.1) * 1.1 if bracketed else None} for c in caps]
        doc["arrangements"].append({"name": name, "kind": kind, "error": None, "runs": [],
                                    "capacity": searches, "capacity_rps": spread(caps)})
    return doc


def test_capacity_verdict_names_a_winner_only_when_the_ranges_do_not_overlap():
    clear = verdict(capacity_doc([0.9, 1.0, 0.95], [0.6, 0.62, 0.66]))
    assert "Separate prefill: yes. 1P1D holds 0.95 req/s (0.90 req/s-1.00 req/s)" in clear
    assert "1.53x" in clear                                         # 0.95 / 0.62
    overlap = verdict(capacity_doc([0.9, 1.0, 0.7], [0.6, 0.62, 0.75]))
    assert "Separate prefill: no clear difference" in overlap and "ranges over repeats overlap" in overlap
    colocated = verdict(capacity_doc([0.3, 0.35, 0.32], [0.6, 0.62, 0.66]))
    assert "Separate prefill: no. The best colocated (colocated-best) holds" in colocated


def test_one_run_capacities_within_the_search_precision_are_no_clear_difference():
    assert "no clear difference" in verdict(capacity_doc([1.05], [1.0]))
    assert "Separate prefill: yes" in verdict(capacity_doc([1.3], [1.0]))


def test_a_separated_arrangement_that_held_nothing_loses_without_dividing_by_zero():
    v = verdict(capacity_doc([None], [0.5]))
    assert "Separate prefill: no." in v


def test_repeats_rotate_the_order():
    names = ["A", "B", "C", "D"]
    assert [rotation(names, r) for r in range(5)] == [list("ABCD"), list("BCDA"), list("CDAB"), list("DABC"),
                                                      list("ABCD")]


def test_when_nothing_held_any_rate_there_is_no_verdict_on_separation():
    v = verdict(capacity_doc([None], [None]))
    assert "No arrangement held any rate tried within the SLOs" in v and "Separate prefill" not in v


def test_a_loser_whose_search_never_failed_is_no_verdict_yet():
    # colocated held every rate it tried (a lower bound): 1P1D's higher number proves nothing
    v = verdict(capacity_doc([1.5], [0.5], col_bracketed=False))
    assert "no clear difference yet" in v and "colocated-best held every rate its search tried" in v
    assert "a lower bound" in v


def test_one_run_shows_a_winner_only_when_it_held_a_rate_the_other_failed():
    # budget-stopped searches bracket within 2x: 1P1D held 1.3, colocated failed only at 2.0
    doc = capacity_doc([1.3], [1.0])
    doc["arrangements"][1]["capacity"][0]["failed_rps"] = 2.0
    v = verdict(doc)
    assert "no clear difference" in v and "failed only at 2.000 req/s, above the 1.300 req/s 1P1D held" in v
    doc["arrangements"][1]["capacity"][0]["failed_rps"] = 1.3      # failed where 1P1D held: clear
    assert "Separate prefill: yes" in verdict(doc)


def test_a_bound_says_why_it_is_a_bound():
    """"No rate probed held" only when that is so: a curve levelling off under the target (some
    probes held, the mix did not hold reliably) and a crossing fitted above every probed rate
    (some probes failed) each say their own reason."""
    from splitserve.trial.verdict import _iv

    held_then_plateau = {"kind": "at_most", "estimate_rps": 0.9, "ceiling": 0.86, "target": 0.9,
                         "points": [{"n": 20, "good": 20}, {"n": 20, "good": 17}]}
    assert "levels off at 86% good" in _iv(held_then_plateau) and "no rate probed held" not in _iv(held_then_plateau)
    none_held = {"kind": "at_most", "estimate_rps": 0.9, "ceiling": 1.0, "points": [{"n": 20, "good": 3}]}
    assert "no rate probed held" in _iv(none_held)
    crossing_above = {"kind": "at_least", "estimate_rps": 1.2, "target": 0.9,
                      "points": [{"n": 20, "good": 20}, {"n": 20, "good": 17}]}
    assert "crosses above every rate probed" in _iv(crossing_above)
    all_held = {"kind": "at_least", "estimate_rps": 1.2, "points": [{"n": 20, "good": 20}]}
    assert "every rate probed held" in _iv(all_held)
