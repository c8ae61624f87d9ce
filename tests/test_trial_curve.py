"""The fitted capacity on synthetic outcomes drawn from a known curve: its 90% interval covers the
true crossing, the probe placement converges to it, bounds where the data do not bracket it, the
paired ratio, and a verdict that never contradicts itself over a grid of its inputs."""
import itertools
import math

import numpy as np
import pytest

from splitserve.trial.curve import ProbeOutcomes, capacity, next_rate, paired_ratio, wilson
from splitserve.trial.quote import decide, fixed_rule
from splitserve.trial.verdict import fitted_verdict

TARGET = 0.9


def truth(x, crossing=0.5, slope=-6.0):
    """P(good | x): logistic in log rate, crossing TARGET at `crossing`."""
    eta = math.log(TARGET / (1 - TARGET)) + slope * (math.log(x) - math.log(crossing))
    return 1 / (1 + math.exp(-eta))


def draw(rng, x, n, round_index, crossing=0.5, probe_sd=0.0):
    """One probe's n outcomes. probe_sd > 0: the probe's own shift of the curve (logit scale), shared
    by all its requests, as a document burst that fails several chats at once."""
    shift = rng.normal(0.0, probe_sd) if probe_sd else 0.0
    p = 1 / (1 + math.exp(-(math.log(truth(x, crossing) / (1 - truth(x, crossing))) + shift)))
    return ProbeOutcomes(x, {i: bool(rng.random() < p) for i in range(n)}, round_index)


def search(seed, n=30, max_probes=8, precision=0.2, start=1.0, crossing=0.5, probe_sd=0.0):
    """The placement the trial uses, against the known curve."""
    rng = np.random.default_rng(seed)
    probes, x = [], start
    for k in range(max_probes):
        probes.append(draw(rng, x, n, k, crossing, probe_sd))
        found = capacity(probes, TARGET, rng)
        if found.kind == "point" and found.width() < precision:
            break
        x = next_rate(probes, found, 2.0, precision)
    return found, probes


def test_the_90_percent_interval_covers_the_true_crossing_in_at_least_85_percent_of_200_seeds():
    covered = 0
    for seed in range(200):
        found, _ = search(seed)
        assert found.kind == "point"
        covered += found.lo <= 0.5 <= found.hi
    assert covered >= 170, covered          # measured: 185 of 200 (the binomial-only bootstrap: 171)


def test_the_interval_still_covers_when_outcomes_within_a_probe_share_a_fate():
    """Each probe's curve shifted by its own N(0, 0.7) on the logit: requests of one probe are
    correlated. A bootstrap over requests alone covered 132 of these 200 seeds."""
    covered = 0
    for seed in range(200):
        found, _ = search(seed, probe_sd=0.7)
        assert found.kind == "point"
        covered += found.lo <= 0.5 <= found.hi
    assert covered >= 170, covered          # measured: 177 of 200


def test_the_probe_placement_converges_on_the_crossing():
    stopped, last_near = 0, 0
    for seed in range(50):
        found, probes = search(seed, max_probes=12, start=4.0)   # start 8x above the crossing
        stopped += found.width() < 0.2
        last_near += abs(math.log(probes[-1].rate / 0.5)) < math.log(1.3)
        assert abs(math.log(found.estimate / 0.5)) < math.log(1.5)
    assert stopped >= 45          # narrower than the precision within 12 probes
    assert last_near >= 40        # the last probes sit near the crossing


def test_data_that_do_not_bracket_the_crossing_give_a_bound_and_the_next_probe_goes_outside():
    rng = np.random.default_rng(0)
    held = [ProbeOutcomes(x, {i: True for i in range(20)}) for x in (0.2, 0.4)]
    found = capacity(held, TARGET, rng)
    assert found.kind == "at_least" and found.estimate == pytest.approx(0.4)
    assert next_rate(held, found, 2.0, 0.2) == pytest.approx(0.8)
    failed = [ProbeOutcomes(x, {i: i < 5 for i in range(20)}) for x in (1.0, 2.0)]
    found = capacity(failed, TARGET, rng)
    assert found.kind == "at_most" and found.estimate == pytest.approx(1.0)
    assert next_rate(failed, found, 2.0, 0.2) == pytest.approx(0.5)
    assert capacity([ProbeOutcomes(1.0, {})], TARGET, rng).kind == "none"


def plateau_probes(seed, ceiling, crossing=0.5, slope=-6.0):
    """Seven probes of 40 requests from P(good) = ceiling * sigmoid(...): never above `ceiling`.
    Above TARGET, it crosses TARGET at `crossing`."""
    rng = np.random.default_rng(seed)
    share = TARGET / ceiling if ceiling > TARGET else TARGET
    eta0 = math.log(share / (1 - share))
    probes = []
    for j, x in enumerate((0.15, 0.25, 0.35, 0.45, 0.55, 0.7, 0.9)):
        p = ceiling / (1 + math.exp(-(eta0 + slope * (math.log(x) - math.log(crossing)))))
        probes.append(ProbeOutcomes(x, {i: bool(rng.random() < p) for i in range(40)}, j))
    return rng, probes


def test_a_curve_with_a_ceiling_of_0_93_is_fitted_with_its_ceiling_not_bent_into_a_wrong_crossing():
    covered, points = 0, 0
    for seed in range(100):
        rng, probes = plateau_probes(seed, 0.93)
        found = capacity(probes, TARGET, rng)
        if found.kind == "point":
            points += 1
            covered += found.lo <= 0.5 <= found.hi
        else:   # the ceiling measured at or under the target: an honest "at most"
            assert found.kind == "at_most"
    assert covered >= 65, covered      # measured 73 of 100, and 19 "at most"; a fit reaching 1 covered 8
    assert covered >= 0.85 * points


def test_a_curve_that_plateaus_under_the_target_never_reaches_it():
    bounded = 0
    for seed in range(100):
        rng, probes = plateau_probes(seed, 0.85)
        found = capacity(probes, TARGET, rng)
        bounded += found.kind == "at_most"
    assert bounded >= 85, bounded      # measured 92 of 100; a fit reaching 1 said "at most" in 39


def test_the_paired_ratio_interval_covers_the_true_ratio_and_excludes_one():
    covered, above_one = 0, 0
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        a, b = [], []
        for k, x in enumerate((0.3, 0.45, 0.6, 0.8, 1.0, 1.3)):
            a.append(draw(rng, x, 40, k, crossing=0.8))
            b.append(draw(rng, x * 0.6, 40, k, crossing=0.5))
        r = paired_ratio(a, b, TARGET, rng)
        assert r is not None and r["lo"] <= r["estimate"] <= r["hi"]
        covered += r["lo"] <= 1.6 <= r["hi"]
        above_one += r["lo"] > 1.0
    assert covered >= 32 and above_one >= 36


def test_wilson_interval_contains_the_share():
    for k, n in ((0, 10), (10, 10), (7, 20)):
        lo, hi = wilson(k, n)
        assert 0 <= lo <= k / n <= hi <= 1


def quote_of(sep, col, ratio):
    return {"target": TARGET, "level": 0.9, "separated": "1P1D", "colocated": "colocated-best",
            "arrangements": {"1P1D": {"name": "1P1D", **sep}, "colocated-best": {"name": "colocated-best", **col}},
            "ratio": ratio, "decision": decide(ratio), "held_nothing": False, "host": {}}


def cap(kind, est, lo=None, hi=None):
    return {"kind": kind, "estimate_rps": est, "lo_rps": lo if kind != "at_least" else est,
            "hi_rps": hi if kind != "at_most" else est, "by_class": {}}


def test_the_verdict_never_contradicts_itself_over_a_grid_of_capacities_and_intervals():
    values = [0.2, 0.5, 1.0]
    widths = [0.05, 0.3]
    seen = set()
    for s, c, ws, wc, ks, kc in itertools.product(values, values, widths, widths,
                                                  ("point", "at_least", "at_most"), ("point", "at_least", "at_most")):
        sep = cap(ks, s, s * (1 - ws), s * (1 + ws))
        col = cap(kc, c, c * (1 - wc), c * (1 + wc))
        from splitserve.trial.quote import bound_ratio

        if ks == kc == "point":
            ratio = {"estimate": s / c, "lo": sep["lo_rps"] / col["hi_rps"], "hi": sep["hi_rps"] / col["lo_rps"]}
        else:
            ratio = bound_ratio(sep, col)
        text = fitted_verdict(quote_of(sep, col, ratio))
        decision = decide(ratio)
        seen.add(decision)
        assert text.count("Separate prefill:") == 1
        first = text.split(". ")[0]
        expected = {"yes": "Separate prefill: yes", "no": "Separate prefill: no",
                    "unclear": "Separate prefill: no clear difference"}[decision]
        assert first == expected, (text, ratio)
        lo, hi = (ratio or {}).get("lo"), (ratio or {}).get("hi")
        if decision == "yes":
            assert lo is not None and lo > 1
        elif decision == "no":
            assert hi is not None and hi < 1
        else:   # the interval (or the bounds known) reaches 1
            assert (lo is None or lo <= 1) and (hi is None or hi >= 1)
        assert "met more deadlines" not in text
    assert seen == {"yes", "no", "unclear"}


def test_a_fixed_rate_run_is_a_comparison_only_with_enough_requests_of_every_class():
    def doc(counts):
        return {"arrangements": [{"runs": [{"purpose": "fixed", "rate_multiplier": 1.0, "summary": {
            "by_class": {name: {"num_requests": n} for name, n in counts.items()}}}]}]}
    assert fixed_rule(doc({"chat": 40, "document": 20}), 1.0) == (True, "")
    ok, why = fixed_rule(doc({"chat": 40, "document": 8}), 1.0)
    assert not ok and "document 8" in why


def mixed_probe(rng, x, n, round_index, chat_cross, doc_cross, doc_share=0.15, probe_sd=0.0, slope=-6.0,
                always_bad=0):
    """A probe of chats and documents, each class with its own curve (documents fail first).
    always_bad: the first that many requests fail at every rate when they are chats (a chat that
    always lands on a document's prefill, as doc-heavy's index 9 did on every probe of session 35)."""
    shift = rng.normal(0.0, probe_sd) if probe_sd else 0.0
    good, classes = {}, {}
    for i in range(n):
        klass = "document" if rng.random() < doc_share else "chat"
        p = truth(x, chat_cross if klass == "chat" else doc_cross, slope)
        if shift:
            p = 1 / (1 + math.exp(-(math.log(p / (1 - p)) + shift)))
        good[i], classes[i] = bool(rng.random() < p) and not (i < always_bad and klass == "chat"), klass
    return ProbeOutcomes(x, good, round_index, classes)


def mixture_truth(chat_cross, doc_cross, doc_share=0.15, slope=-6.0, always_bad=0, n=40):
    """Where 0.85 * P(chat good) + 0.15 * P(document good) crosses the target (bisection in log x),
    less the chats among a probe's first always_bad requests of n, which fail at every rate."""
    lo, hi = math.log(0.01), math.log(100.0)
    for _ in range(100):
        mid = (lo + hi) / 2
        x = math.exp(mid)
        share = ((1 - doc_share) * (n - always_bad) / n * truth(x, chat_cross, slope)
                 + doc_share * truth(x, doc_cross, slope))
        lo, hi = (mid, hi) if share >= TARGET else (lo, mid)
    return math.exp(lo)


def mixed_search(seed, chat_cross, doc_cross, n=40, max_probes=8, precision=0.2, probe_sd=0.0, slope=-6.0,
                 always_bad=0):
    rng = np.random.default_rng(seed)
    probes, x = [], 1.0
    for k in range(max_probes):
        probes.append(mixed_probe(rng, x, n, k, chat_cross, doc_cross, probe_sd=probe_sd, slope=slope,
                                  always_bad=always_bad))
        found = capacity(probes, TARGET, rng)
        if found.kind == "point" and found.width() < precision:
            break
        x = next_rate(probes, found, 2.0, precision)
    return found, probes


@pytest.mark.parametrize("chat_cross, doc_cross, slope, always_bad",
                         [(8.0, 0.6, -6.0, 0), (1.2, 0.8, -6.0, 0), (0.5, 0.6, -20.0, 0), (0.5, 0.6, -20.0, 1)])
def test_a_mix_whose_classes_fail_at_different_rates_is_fitted_class_by_class_and_covers_the_truth(
        chat_cross, doc_cross, slope, always_bad):
    """Chats that hold far past the documents (the whole mix levels off near 85% good, the shape
    1P1D showed: one prefill instance, documents' TTFT first) and two close curves. One logistic
    through the whole mix bends the plateau into a slow slope and puts the crossing too high; per
    class curves at their shares cross where the mix does. And a cliff (slope -20 in log rate, as
    doc-heavy's colocated pair fell from 32 of 33 good at 1.22 req/s to 17 of 39 at 1.42), with and
    without a chat that fails at every rate: a class slope penalty of 0.05 without class ceilings
    covered 142 and 96 of 200 there, its intervals under the truth (curve.py, "Classes")."""
    true = mixture_truth(chat_cross, doc_cross, slope=slope, always_bad=always_bad)
    covered = points = below = 0
    for seed in range(200):
        found, _ = mixed_search(seed, chat_cross, doc_cross, slope=slope, always_bad=always_bad)
        if found.kind != "point":
            continue
        points += 1
        assert [q["class"] for q in found.components] == ["chat", "document"]
        covered += found.lo <= true <= found.hi
        below += found.hi < true
    assert points >= 180, points
    # 85% coverage, less two standard errors of a share over ~200 seeds: the plateau shape (8.0, 0.6)
    # covers about 85-87% (session 37: 682 of 800 seeds before the interval reached the probes beside
    # the estimate, 685 of 799 after, 173 and 164 of the first 200), so a bar of 85% on these 200
    # seeds was a coin toss on any change; the single curve's 158 of 199 still fails it
    assert covered >= 0.85 * points - 2 * math.sqrt(points * 0.85 * 0.15), (covered, below, points)


def class_probes(rows) -> list[ProbeOutcomes]:
    """Probes from counts: (rate, chats good, chats run, documents good, documents run)."""
    probes = []
    for j, (rate, chat_good, chats, doc_good, docs) in enumerate(rows):
        good = {i: i < chat_good for i in range(chats)} | {chats + i: i < doc_good for i in range(docs)}
        probes.append(ProbeOutcomes(rate, good, j, {i: "chat" if i < chats else "document" for i in good}))
    return probes


def test_a_real_cliff_is_not_quoted_under_the_probes_that_held():
    """Session 35's doc-heavy colocated pair, its 15 probes as counts: every probe up to 1.22 req/s
    held at 0.96-0.97 with the same one chat failing, the three above fell to 0.44-0.12. The
    crossing lies between 1.22 and 1.42; the quote said 1.10 [1.02-1.15] with a class penalty of
    0.05 and no class ceiling."""
    rows = [(0.30, 9, 9, 1, 1), (0.47, 12, 13, 2, 2), (0.71, 18, 19, 2, 2), (0.87, 22, 23, 3, 3),
            (0.87, 23, 24, 3, 3), (0.88, 22, 23, 3, 3), (0.95, 22, 23, 3, 3), (1.00, 26, 27, 3, 3),
            (1.05, 27, 28, 4, 4), (1.12, 28, 29, 4, 4), (1.14, 28, 29, 4, 4), (1.22, 28, 29, 4, 4),
            (1.42, 14, 34, 3, 5), (1.57, 6, 38, 2, 7), (1.62, 6, 41, 0, 8)]
    found = capacity(class_probes(rows), TARGET, np.random.default_rng(0))
    assert found.kind == "point"
    assert 1.14 < found.estimate < 1.42, found
    assert found.hi > 1.22 and found.lo < found.estimate < found.hi, found


def test_an_interval_reaches_the_probes_beside_its_estimate_and_the_next_probe_goes_between_them():
    """Session 36's doc-heavy colocated pair, three probes: 25 of 26 good at 0.95 req/s, 29 of 30 at
    0.99, 14 of 39 at 1.42. The logistic crossed at 1.07 [0.84-1.20]; a dense search of the same
    pair in session 37 held 0.97 at 1.20 and 0.93 at 1.33, and gave 0.75-0.88 at 1.42: the crossing
    lay near 1.35-1.4, outside that interval. Nothing was probed between 0.99 and 1.42, so any
    monotone curve through the probes may cross anywhere there: the interval reaches both (the
    bootstrap's own kept beside it) and the next probe goes between them."""
    probes = class_probes([(0.95, 22, 23, 3, 3), (1.418, 11, 34, 3, 5), (0.991, 26, 27, 3, 3)])
    found = capacity(probes, TARGET, np.random.default_rng(0))
    assert found.kind == "point"
    assert found.lo <= 0.991 and found.hi >= 1.418, found
    assert found.fit_hi < 1.418 and found.fit_lo >= found.lo, found
    assert found.to_dict()["fit_hi_rps"] == found.fit_hi
    assert 1.1 < next_rate(probes, found, 2.0, 0.2) < 1.3


def test_probes_close_beside_the_estimate_widen_the_interval_only_to_them():
    """Where probes sit close beside the estimate, reaching them widens the bootstrap's interval
    by no more than the few percent between them."""
    rows = [(0.5, 40, 40), (0.9, 39, 40), (1.0, 37, 40), (1.05, 35, 40), (1.1, 31, 40), (1.2, 20, 40), (2.0, 2, 40)]
    probes = [ProbeOutcomes(rate, {i: i < good for i in range(n)}, j) for j, (rate, good, n) in enumerate(rows)]
    found = capacity(probes, TARGET, np.random.default_rng(0))
    assert found.kind == "point" and 1.0 < found.estimate < 1.05, found
    assert (found.lo, found.hi) == (min(found.fit_lo, 1.0), max(found.fit_hi, 1.05)), found
    assert found.width() < 0.12, found


def test_a_ratio_whose_capacities_reach_their_probes_widens_by_the_same_factors():
    """The paired ratio's ends move by the factors each capacity's interval moved when it reached
    the probes beside its estimate: never narrower than the bootstrap's ratio on the same draws."""
    from dataclasses import replace
    widened = 0
    for seed in range(10):
        rng = np.random.default_rng(900 + seed)
        a = [ProbeOutcomes(x, {i: bool(rng.random() < truth(x, 0.9, -20.0)) for i in range(40)}, k)
             for k, x in enumerate((0.4, 0.8, 1.6))]
        b = [ProbeOutcomes(x, {i: bool(rng.random() < truth(x, 0.6, -20.0)) for i in range(40)}, k)
             for k, x in enumerate((0.4, 0.8, 1.6))]
        ca, cb = capacity(a, TARGET, rng), capacity(b, TARGET, rng)
        if ca.kind != "point" or cb.kind != "point":
            continue
        own = (replace(ca, lo=ca.fit_lo, hi=ca.fit_hi), replace(cb, lo=cb.fit_lo, hi=cb.fit_hi))
        wide = paired_ratio(a, b, TARGET, np.random.default_rng(seed), caps=(ca, cb))
        fit = paired_ratio(a, b, TARGET, np.random.default_rng(seed), caps=own)
        assert wide["lo"] <= fit["lo"] and wide["hi"] >= fit["hi"], (seed, wide, fit)
        widened += wide["hi"] / wide["lo"] > 1.05 * fit["hi"] / fit["lo"]
    assert widened >= 5, widened


def test_documents_that_keep_one_good_answer_in_overload_do_not_lift_the_crossing():
    """Session 35's doc-heavy 1P1D: chats all good to 3 req/s, documents all good to 1.44 and then
    one per probe good (1 of 8 to 1 of 15: the first of a probe, before any queue). The mix falls
    under 0.9 between 1.44 and 1.57 (0.854 there); without a floor the documents' curve flattened
    to reach those ones and the quote said 1.65 [1.44-1.89]."""
    rows = [(0.72, 20, 20, 2, 2), (0.93, 25, 25, 3, 3), (0.95, 23, 23, 3, 3), (1.12, 29, 29, 4, 4),
            (1.22, 29, 29, 4, 4), (1.40, 34, 34, 3, 5), (1.42, 34, 34, 0, 6), (1.44, 34, 34, 5, 5),
            (1.57, 40, 40, 1, 8), (1.62, 41, 41, 1, 8), (1.96, 49, 49, 1, 10), (2.10, 53, 53, 1, 10),
            (2.42, 62, 62, 1, 11), (2.99, 76, 76, 1, 14), (3.20, 65, 79, 1, 15)]
    found = capacity(class_probes(rows), TARGET, np.random.default_rng(0))
    assert found.kind == "point"
    assert 1.3 < found.estimate < 1.57, found
    assert {q["class"]: q["floor"] > 0 for q in found.components} == {"chat": False, "document": True}, found


def test_a_single_curve_whose_overload_keeps_some_good_requests_is_not_quoted_under_a_held_probe():
    """Session 34's chat-only 1P1D: 107 of 113 good at 3.78 req/s, 45 of 97 at 4.26 and still 17 of
    111 at 7.58. A logistic falling to 0 had to run shallow to reach that 15%, and crossed at 3.18
    [2.28-4.79], under the rate that held."""
    probes = [ProbeOutcomes(rate, {i: i < good for i in range(n)}, j)
              for j, (rate, good, n) in enumerate([(0.48, 16, 16), (0.92, 27, 27), (1.85, 56, 56), (3.78, 107, 113),
                                                   (4.26, 45, 97), (7.58, 17, 111)])]
    found = capacity(probes, TARGET, np.random.default_rng(0))
    assert found.kind == "point" and found.floor > 0, found
    assert 3.5 < found.estimate < 4.26 and found.hi > 3.78, found


def test_the_ratio_interval_is_drawn_from_the_same_replicates_as_each_capacity_and_never_contradicts_them():
    """The ratio's interval lies within what the two capacities' own intervals allow, mixtures of
    classes included: from fresh draws of the same bootstrap it once lay 1.29x past them (one of
    these seeds, class penalty 0.01), so it is held inside the intervals the quote shows."""
    for seed in range(30):
        rng = np.random.default_rng(500 + seed)
        a = [mixed_probe(rng, x, 40, k, 8.0, 0.9) for k, x in enumerate((0.4, 0.7, 1.0, 1.4, 2.0))]
        b = [mixed_probe(rng, x, 40, k, 0.7, 0.7) for k, x in enumerate((0.4, 0.7, 1.0, 1.4, 2.0))]
        ca, cb = capacity(a, TARGET, rng), capacity(b, TARGET, rng)
        r = paired_ratio(a, b, TARGET, rng, caps=(ca, cb))
        if r is None:
            continue
        assert ca.lo / cb.hi * (1 - 1e-9) <= r["lo"] <= r["estimate"] <= r["hi"] <= ca.hi / cb.lo * (1 + 1e-9), \
            (seed, r, ca, cb)


def test_outcomes_that_go_together_on_the_same_requests_couple_the_two_bootstraps():
    """Both arrangements fail the same hard requests: the measured correlation couples their
    draws, and the ratio's interval is narrower than with the same outcomes shuffled apart."""
    rng = np.random.default_rng(7)
    a, b, b_shuffled = [], [], []
    for k, x in enumerate((0.4, 0.6, 0.8, 1.0, 1.3, 1.7)):
        hard = rng.random(60)                              # each request's own difficulty
        pa, pb = truth(x, 1.0), truth(x, 0.7)
        ga = {i: bool(hard[i] < pa) for i in range(60)}
        gb = {i: bool(hard[i] < pb) for i in range(60)}    # fails the same requests first
        a.append(ProbeOutcomes(x, ga, k))
        b.append(ProbeOutcomes(x, gb, k))
        order = rng.permutation(60)
        b_shuffled.append(ProbeOutcomes(x, {i: gb[int(order[i])] for i in range(60)}, k))
    together = paired_ratio(a, b, TARGET, np.random.default_rng(1))
    apart = paired_ratio(a, b_shuffled, TARGET, np.random.default_rng(1))
    assert together["coupling"] > 0.3 > apart["coupling"]
    assert together["hi"] / together["lo"] < apart["hi"] / apart["lo"]


def _fitted_doc(probes_by_arrangement, target=TARGET):
    """A results document whose arrangements carry fitted probes: {name: (kind, [(rate, chats, docs)])},
    chats and docs as (good, total) counts."""
    arrangements = []
    for name, (kind, probes) in probes_by_arrangement.items():
        runs = []
        for r, (rate, (cg, cn), (dg, dn)) in enumerate(probes):
            good = [True] * cg + [False] * (cn - cg) + [True] * dg + [False] * (dn - dg)
            classes = ["chat"] * cn + ["document"] * dn
            runs.append({"purpose": "probe", "repeat": 0, "rate_multiplier": rate, "summary": {
                "offered_rate_rps": rate, "round": r,
                "outcomes": {"index": list(range(len(good))), "good": good, "class": classes}}})
        arrangements.append({"name": name, "kind": kind, "capacity": [{"method": "fitted"}], "runs": runs})
    return {"seed": 1, "slo": {"attainment": target}, "arrangements": arrangements}


def test_a_decision_that_turns_on_the_target_says_so_and_one_that_does_not_stays_silent():
    """1P1D's chats all good at every rate, its documents (12%) failing from 1.4 req/s on: its share
    good levels off at 88%, just under the 90% target, as in session 15's demo runs. At 90% the two
    arrangements cannot be told apart; at 85% 1P1D holds every rate probed, well past the colocated one's crossing."""
    from splitserve.trial.quote import quote
    from splitserve.trial.verdict import fitted_verdict, _fitted_context

    plateau = [(0.5, (44, 44), (6, 6)), (1.0, (44, 44), (6, 6)), (1.4, (44, 44), (0, 6)), (2.8, (88, 88), (0, 12))]
    colocated = [(0.5, (44, 44), (6, 6)), (1.0, (44, 44), (6, 6)), (1.4, (40, 44), (5, 6)), (2.0, (10, 44), (1, 6))]
    q = quote(_fitted_doc({"1P1D": ("separated", plateau), "x2": ("colocated", colocated)}))
    assert q["decision"] == "unclear", q["ratio"]
    at85 = next(o for o in q["other_targets"] if o["target"] == 0.85)
    assert at85["decision"] == "yes" and at85["separated"]["kind"] == "at_least"
    assert at85["ratio"]["lo"] > 1.2
    text = fitted_verdict(q) + _fitted_context({"arrangements": []}, q)
    assert text.startswith("Separate prefill: no clear difference") and text.count("Separate prefill:") == 1
    assert "The decision turns on the target" in text and "at 85% good separating would be a yes" in text

    # a colocated arrangement that drowns at a third of the rate: "yes" at 85%, 90% and 95% alike
    weak = [(0.2, (44, 44), (6, 6)), (0.35, (40, 44), (4, 6)), (0.5, (10, 44), (0, 6)), (1.0, (0, 44), (0, 6))]
    clear = [(0.5, (44, 44), (6, 6)), (1.0, (44, 44), (6, 6)), (1.4, (44, 44), (6, 6)), (2.8, (60, 88), (2, 12))]
    q = quote(_fitted_doc({"1P1D": ("separated", clear), "x2": ("colocated", weak)}))
    assert q["decision"] == "yes" and {o["decision"] for o in q["other_targets"]} == {"yes"}
    assert "turns on the target" not in _fitted_context({"arrangements": []}, q)


def test_a_separated_arrangement_that_held_the_rate_the_colocated_one_failed_is_a_yes():
    """The colocated curve crosses between 1.0 and 2.0 req/s by its fit, its interval reaching up to
    the failed probe at 2.0 (curve.py, "Between probes"); 1P1D held every rate, 2.0 the highest. The
    bound ratio's lower end is exactly 1 (2.0 / 2.0), yet the two are ordered at a rate both ran."""
    from splitserve.trial.quote import quote
    from splitserve.trial.verdict import fitted_verdict

    held = [(0.5, (44, 44), (6, 6)), (1.0, (44, 44), (6, 6)), (2.0, (44, 44), (6, 6))]
    cliff = [(0.5, (44, 44), (6, 6)), (1.0, (43, 44), (6, 6)), (2.0, (8, 44), (0, 6))]
    q = quote(_fitted_doc({"1P1D": ("separated", held), "x2": ("colocated", cliff)}))
    sep, col = q["arrangements"]["1P1D"], q["arrangements"]["x2"]
    assert sep["kind"] == "at_least" and col["kind"] == "point" and col["hi_rps"] == 2.0 > col["fit_hi_rps"]
    assert q["ratio"]["lo"] == pytest.approx(1.0) and q["ratio"]["meets_at_rps"] == 2.0
    assert q["decision"] == "yes"
    text = fitted_verdict(q)
    assert text.startswith("Separate prefill: yes") and "meet only at 2.00 req/s" in text
    # the same curves the other way round: colocated held, 1P1D failed: a no
    q = quote(_fitted_doc({"1P1D": ("separated", cliff), "x2": ("colocated", held)}))
    assert q["decision"] == "no" and q["ratio"]["meets"] == "below"
    assert fitted_verdict(q).startswith("Separate prefill: no.")
    # a colocated curve whose own interval reaches past 2.0: the two overlap, no order
    assert decide({"lo": 1.0, "hi": None}) == "unclear"
    # a ratio above 1 anyway: the meeting decides nothing and the verdict does not mention it
    q = quote(_fitted_doc({"1P1D": ("separated", held), "x2": ("colocated", cliff)}))
    q["ratio"]["lo"] = 1.05
    assert "meet only" not in fitted_verdict(q)
