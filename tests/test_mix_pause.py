"""The chunk knob weighs the streams' longest pause (issue 31, session 22): among settings the step
model reads as equal on deadlines, the shortest gap; and with every target held, a much shorter
gap for a little more pressure."""
from __future__ import annotations

import numpy as np
import pytest

from splitserve.control.mix import InstanceView, MixController, MixTargets, SloClass
from splitserve.control.stepmodel import StepModel
from splitserve.control.whatif import ClassDemand, Demand, Held, Prediction, WhatIf

# the online fit of demand_unseen_overload's adaptive run (session 21, AMD EPYC Zen 4, 1 thread):
# a 32-token chunk step beside 3 streams about 0.14 s, 128 tokens about 0.38 s
ZEN4 = StepModel(overhead_s=0.0104, per_prefill_token_s=0.00257, per_prefill_attn_s=0.000996,
                 per_decode_seq_s=0.00324, per_decode_kv_token_s=3.48e-6)
TARGETS = MixTargets(4.0, 0.5, classes=(SloClass("agent", 2.5, 0.5), SloClass("chat", 4.0, 0.5)))


def option(pressure: float, gap_s: float, chunk: int):
    return (pressure, Prediction(pressure * 2.5, gap_s, "2 colocated"), (0, chunk))


def test_settings_equal_on_pressure_are_told_apart_by_the_gap():
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True)
    # a missed target: none holds the targets with room, 64 and 128 hold them within 10% of each other
    opts = [option(1.06, 0.13, 32), option(0.98, 0.22, 64), option(0.93, 0.41, 128)]
    assert ctrl._choose_knobs(opts) == 1
    assert MixController(ZEN4, TARGETS, chunk_knob=True, knob_tie=0.0)._choose_knobs(opts) == 2
    # 64 further from the least pressure than the tie: the least pressure
    assert ctrl._choose_knobs([option(1.06, 0.13, 32), option(0.99, 0.22, 64), option(0.85, 0.41, 128)]) == 2
    # the knobs as they are just past the targets, within the tie of one that holds them, at a
    # shorter gap: they stay (session 22: 64 -> 128 for 1.01x -> 0.97x doubled the agents' pauses)
    opts = [option(1.01, 0.22, 64), option(1.2, 0.13, 32), option(0.97, 0.41, 128)]
    assert ctrl._choose_knobs(opts) is None
    assert MixController(ZEN4, TARGETS, chunk_knob=True, knob_tie=0.0)._choose_knobs(opts) == 2
    # the same with a third setting tied on pressure at a shorter gap but past the targets: it is
    # not where a move would go, so it does not unseat the stay (session 24, demand_unseen_overload:
    # 32 tokens tied at 1.05x, the knobs left 64 (1.01x, 246 ms) for 128 (0.99x, 467 ms))
    opts = [option(1.01, 0.246, 64), option(1.05, 0.13, 32), option(0.99, 0.467, 128)]
    assert ctrl._choose_knobs(opts) is None
    # ... unless the move's target has the shorter gap
    assert ctrl._choose_knobs([option(1.01, 0.246, 64), option(1.05, 0.13, 32), option(0.99, 0.2, 96)]) == 2
    # a setting past the targets is never moved to for its gap over one that holds them
    assert ctrl._choose_knobs([option(1.06, 0.13, 32), option(1.01, 0.22, 64), option(0.95, 0.41, 128)]) == 2


def test_targets_held_at_long_steps_move_to_a_much_shorter_gap_for_a_little_pressure():
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True)
    now = option(0.85, 0.41, 128)  # held without room; the gap 82% of its target
    assert ctrl._choose_knobs([now, option(1.2, 0.13, 32), option(0.92, 0.22, 64)]) == 2
    # more than knob_tie more pressure, or past the targets: the knobs stay
    assert ctrl._choose_knobs([now, option(1.2, 0.13, 32), option(0.95, 0.22, 64)]) is None
    assert ctrl._choose_knobs([now, option(1.05, 0.13, 32)]) is None
    # a gap not `margin` shorter
    assert ctrl._choose_knobs([now, option(0.86, 0.35, 96)]) is None
    # the gap now within `calm` of its target: short pauses already, nothing chased
    assert ctrl._choose_knobs([option(0.62, 0.29, 64), option(0.63, 0.13, 32)]) is None


def uniform_prompts(low: int, high: int, n: int, seed: int = 0) -> tuple[int, ...]:
    """A window's n prompt lengths drawn uniformly in [low, high), sorted, as Demand keeps them."""
    return tuple(sorted(int(x) for x in np.random.default_rng(seed).uniform(low, high, n)))


def agents(rate: float, seed: int = 0) -> Demand:
    """Agent-style requests: 80-480-token tool results, 24-64-token answers (demand_unseen's bursts)."""
    prompts = uniform_prompts(80, 480, int(rate * 30), seed)
    mean = sum(prompts) / len(prompts)
    return Demand(rate, rate * mean, rate * 44, mean, 44, prompts, (ClassDemand("agent", 1.0, mean, prompts),))


def test_agent_bursts_run_the_shorter_chunk_that_holds_their_first_token_and_stay_there():
    # demand_unseen_overload, session 21: the agents' TTFT missed at 32-token chunks, and the knob went
    # to 128 (the least pressure) where 64 held the TTFT a few per cent later at half the step: every
    # agent then answering paused 0.38-0.7 s, against 1P1D's 0.33 s p99
    demand = agents(1.2)
    views = [InstanceView(f"e{i}", "colocated", queued_prompt_tokens=300, num_running=3, decode_kv_tokens=900)
             for i in range(2)]
    preds = {c: WhatIf(ZEN4, c).predict([Held("colocated", 300, 3)] * 2, demand) for c in (32, 64, 128, 256)}
    pressure = {c: TARGETS.pressure(p) for c, p in preds.items()}
    assert pressure[32] > 1 >= pressure[64] > pressure[128] > 0.9, pressure  # premise: 128 the least pressure
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True, chunk_tokens=32, min_samples=10 ** 6)
    decisions = [ctrl.decide(views, float(t), demand) for t in range(12)]
    moved = [d for d in decisions if d.chunk_tokens is not None]
    assert [d.chunk_tokens for d in moved] == [64], [d.reason for d in decisions]
    assert all(d.instance_id is None for d in decisions)


def test_at_rest_the_chunk_budget_is_the_largest_whose_whole_chunk_step_is_calm():
    # demand_unseen_overload, session 22: the first 1.7 s at serve's 256-token budget, before any
    # decision moved it, paused four agents 0.58-0.72 s; with every target met with room the knob
    # now rests at the largest budget whose whole-chunk step is within calm of the gap target
    chats = (30, 40, 50)  # a few short chats: no step carries a whole chunk now, so every budget reads calm
    quiet = Demand(0.1, 4.0, 12.0, 40, 120, chats, (ClassDemand("chat", 1.0, 40, chats),))
    views = [InstanceView(f"e{i}", "colocated") for i in range(2)]
    for model, rest in ((ZEN4, 64), (ZEN4.scaled(2.0), 32)):  # an AVX2 box is about half as fast
        ctrl = MixController(model, TARGETS, chunk_knob=True, min_samples=10 ** 6)
        decisions = [ctrl.decide(views, float(t), quiet) for t in range(8)]
        moved = [d for d in decisions if d.chunk_tokens is not None]
        assert [d.chunk_tokens for d in moved] == [rest] and decisions.index(moved[0]) == 0, \
            [d.reason for d in decisions]
        assert "at rest" in moved[0].reason and all(d.held == "calm" for d in decisions[1:])
        assert WhatIf(model).gap_s(rest * 2, 1, 0) > ctrl.calm * 0.5 >= WhatIf(model).gap_s(rest, 1, 0)
    # already at or below the resting budget: nothing moves
    low = MixController(ZEN4, TARGETS, chunk_knob=True, chunk_tokens=32, min_samples=10 ** 6)
    assert all(low.decide(views, float(t), quiet).chunk_tokens is None for t in range(5))


def test_the_knobs_do_not_rest_back_at_a_budget_they_left_within_the_cooldown():
    # 64 -> 128 for a missed TTFT, and calm a moment later: back to 64 only after the cooldown
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True, chunk_tokens=128, min_samples=10 ** 6)
    ctrl._knob_left, ctrl._since_knob = (0, 64), 0
    views = [InstanceView(f"e{i}", "colocated") for i in range(2)]
    chats = (30, 40, 50)
    quiet = Demand(0.1, 4.0, 12.0, 40, 120, chats, (ClassDemand("chat", 1.0, 40, chats),))
    decisions = [ctrl.decide(views, float(t), quiet) for t in range(ctrl.cooldown + 2)]
    moved = [i for i, d in enumerate(decisions) if d.chunk_tokens is not None]
    assert moved == [ctrl.cooldown] and decisions[ctrl.cooldown].chunk_tokens == 64, [d.reason for d in decisions]


# demand_rotation_overload_x2's online fit on ec4f758 (session 22, AMD EPYC Zen 4, 1 thread), 7 s into
# its retrieval burst
X2 = StepModel(overhead_s=0.0037, per_prefill_token_s=0.00261, per_prefill_attn_s=0.00096,
               per_decode_seq_s=0.00503, per_decode_kv_token_s=14.2e-6)


def retrieval(rate: float) -> Demand:
    prompts = uniform_prompts(250, 450, max(int(rate * 30), 1))
    mean = sum(prompts) / len(prompts)
    return Demand(rate, rate * mean, rate * 48, mean, 48, prompts)


def test_the_decision_says_when_the_knobs_stay_by_the_tie_or_the_margin():
    # session 22: knobs held by the tie were logged only as "no better mix"
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True)
    assert ctrl._choose_knobs([option(1.01, 0.22, 64), option(1.2, 0.13, 32), option(0.97, 0.41, 128)]) is None
    assert "the knobs stay at chunk budget 64 tokens (1.01x" in ctrl._knob_note
    assert "within 10% of chunk budget 128 tokens (0.97x" in ctrl._knob_note
    demand = retrieval(1.8)
    busy = [InstanceView(f"e{i}", "colocated", queued_prompt_tokens=2000, num_running=8, decode_kv_tokens=3000)
            for i in range(2)]
    at_64 = MixController(X2, MixTargets(4.0, 0.5), chunk_knob=True, chunk_tokens=64, min_samples=10 ** 6)
    decision = at_64.decide(busy, 1.0, demand)
    assert decision.chunk_tokens is None
    # deep in overload every setting misses within the tie of the fewest: the shortest gap of them
    # (32 tokens) is not 20% fewer missed
    assert "the knobs stay at chunk budget 64 tokens, predicted to miss 91% of deadlines: chunk budget 32 " \
           "tokens would miss 93%, not 20% fewer" in decision.reason, decision.reason
    # a move leaves no note behind
    assert ctrl._choose_knobs([option(1.3, 0.13, 32), option(0.8, 0.22, 64)]) == 1 and ctrl._knob_note == ""


def test_past_every_setting_a_gap_at_its_target_counts_as_missed_not_met():
    # demand_rotation_overload_x2, session 23 (654a69c): in the retrieval burst 128-token chunks read
    # 82% of deadlines met against 64's 75%, the TTFT alone deciding (a class's share was 1/x of its
    # worst ratio) while 128's predicted gap sat at 0.96-1.03 of the 0.5 s target; the knobs moved
    # and the retrieval streams lost their gaps (0-1 of 36 met against 12 of 36 at 64)
    targets = MixTargets(4.0, 0.5, classes=(SloClass("retrieval", 4.0, 0.5),))
    at_64 = Prediction(4.0 * 1.33, 0.26, "2 colocated", ttft_by_class=(("retrieval", 4.0 * 1.33, 1.0),))
    at_128 = Prediction(4.0 * 1.22, 0.495, "2 colocated", ttft_by_class=(("retrieval", 4.0 * 1.22, 1.0),))
    # the TTFT share alone (a gap within its target counted met) prefers 128 by more than the tie
    assert targets.deadlines_met(at_128) > targets.deadlines_met(at_64) * 1.05
    ctrl = MixController(ZEN4, targets, chunk_knob=True, chunk_tokens=64)
    # read as the controller does, the gap held only with knob_headroom to spare: 128 meets no more
    assert ctrl.deadlines_met(at_128) <= ctrl.deadlines_met(at_64)
    assert ctrl.deadlines_met(at_64) == targets.deadlines_met(at_64) == 1 / 1.33  # a short gap: TTFT alone
    opts = [(targets.pressure(at_64), at_64, (0, 64)), (targets.pressure(at_128), at_128, (0, 128))]
    assert min(x[0] for x in opts) > 1  # premise: past every setting
    assert ctrl._choose_knobs(opts) is None and "the knobs stay at chunk budget 64" in ctrl._knob_note
    # TTFT and gap missed together: the shares multiply (a request is good only if it meets both)
    both = Prediction(8.0, 1.0, "2 colocated", ttft_by_class=(("retrieval", 8.0, 1.0),))
    assert targets.deadlines_met(both) == 0.5 * 0.5


def test_a_chunk_deep_in_a_long_prompt_is_read_as_the_longer_step_it_is_and_the_knobs_rest_below_it():
    # demand_rotation, session 24: the longest pauses were the steps carrying the last 64-token chunks
    # of 1,000-1,400-token summaries (67-76 attention ktok2 where a first chunk scores 2), 0.38-0.50 s
    # beside 7 streams, while every chunk's gap was read as a first chunk's (~0.2 s), so the knobs
    # rested at 64. A chunk's gap is read at its prompt's last whole chunk
    from splitserve.control.stepmodel import prefill_attn_ktok2
    what_if, kv = WhatIf(ZEN4), 7 * 600
    assert what_if.gap_s(64, 7, kv) == ZEN4.step_s(64, prefill_attn_ktok2(0, 64), 7, kv)
    assert what_if.gap_s(64, 7, kv, 1300) == ZEN4.step_s(64, prefill_attn_ktok2(1236, 64), 7, kv)
    assert what_if.gap_s(64, 7, kv, 1300) > 1.3 * what_if.gap_s(64, 7, kv)
    assert what_if.gap_s(64, 7, kv, 40) == what_if.gap_s(64, 7, kv)  # a prompt shorter than a chunk
    # every target met with room; the knobs rest at the largest chunk whose whole step stays within
    # `calm` of the gap target: 64 tokens at a prompt's start (0.26 s at a 1.2 tail), not at token
    # 1,236 of a 1,300-token summary (0.35 s), where 32 (0.21 s) does
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True, chunk_tokens=64)
    live = [InstanceView("e0", "colocated", num_running=7, decode_kv_tokens=kv),
            InstanceView("e1", "colocated", num_running=3, decode_kv_tokens=1500)]
    opts = [option(0.40, 0.2, 64), option(0.45, 0.15, 32), option(0.35, 0.3, 128)]
    assert ctrl._resting_chunk(opts, live, ZEN4, 1.2) is None
    assert ctrl._resting_chunk(opts, live, ZEN4, 1.2, 1300) == 1
    # the controller reads the window's longest prompt: chats alone rest at 64, a summary among them
    # at 32 (before the online fit, the tail is 1; a 0.45 s gap target: 64 tokens step 0.21 s at a
    # prompt's start, 0.29 s at token 1,236, past 0.6 x 0.45 s; 32 tokens there 0.17 s)
    def decide(prompts: tuple[int, ...]):
        c = MixController(ZEN4, MixTargets(15.0, 0.45), chunk_knob=True, chunk_tokens=64)
        d = Demand(0.3, 0.3 * sum(prompts) / len(prompts), 0.3 * 100, sum(prompts) / len(prompts), 100,
                   prompts=tuple(sorted(prompts)))
        return c.decide(live, 0.0, d)
    assert decide((60,) * 8).chunk_tokens is None
    assert decide((60,) * 8 + (1300,)).chunk_tokens == 32


def test_with_no_prompt_in_the_window_a_queue_is_not_read_as_one_prompt_as_long_as_its_sum():
    # demand_rotation_overload_x2, session 25 on 6e40f4f: 70 s after the last arrival the backlog's
    # queued tokens were read as the depth of one prompt, a 32-token chunk's step as 372 ms, and the
    # mix made a role change for it. The queued tokens are many prompts' sum: with no prompt in the
    # window to say how long they are, the chunks are read as first chunks
    what_if = WhatIf(ZEN4, 32)
    backlog = [Held("colocated", queued_prompt_tokens=6000, num_running=6)] * 2
    drained = what_if.predict(backlog, Demand())
    assert drained.gap_s == pytest.approx(what_if.gap_s(32, 6, 0))
    # with prompts in the window, the chunk is read as deep as the window's longest prompt
    d = Demand(0.1, 0.1 * 900, 0.1 * 30, 900, 30, prompts=(900,))
    assert what_if.predict(backlog, d).gap_s > what_if.gap_s(32, 6, 0)


def test_a_setting_whose_gap_sits_at_its_target_is_not_moved_to_as_holding_the_targets():
    # demand_unseen_overload, session 25 on 6e40f4f: for the agents' missed TTFT the knobs went
    # 32 -> 128 tokens at 0.98x with the gap predicted 461-481 ms against 500, and all 5 streams on
    # the instance paused 0.43 s at one 128-token step. A gap counts as held for a move only with
    # knob_headroom to spare; past that, the settings are weighed on deadlines met, where 64 tokens
    # (1.09x on the TTFT, 270 ms) miss fewer than 128 (the gap's coin toss)
    ctrl = MixController(ZEN4, TARGETS, chunk_knob=True)
    opts = [option(2.7, 0.14, 32), option(0.98, 0.481, 128), option(1.09, 0.27, 64)]
    missed = [1 - ctrl.deadlines_met(x[1]) for x in opts]
    assert missed[2] < missed[1] < missed[0] * 0.2, missed  # premise
    assert ctrl._choose_knobs(opts) == 2
    # a gap with room: the setting that holds the targets is taken as before
    assert ctrl._choose_knobs([option(2.7, 0.14, 32), option(0.98, 0.40, 128), option(1.09, 0.27, 64)]) == 1


def test_past_every_setting_deadlines_within_a_few_points_of_the_fewest_are_tied_and_the_gap_decides():
    # one class, so the shares read plainly: 128 tokens miss 6.4% (the gap at 0.96 of its target),
    # 64 tokens 8.3% (TTFT 1.09x): 30% more, past knob_tie alone, but 1.9 points, inside what the
    # step model tells apart; the shorter gap (64) is taken
    one = MixTargets(2.5, 0.5)
    ctrl = MixController(ZEN4, one, chunk_knob=True)
    opts = [option(2.7, 0.14, 32), option(0.98, 0.481, 128), option(1.09, 0.27, 64)]
    missed = [1 - ctrl.deadlines_met(x[1]) for x in opts]
    assert missed[1] < missed[2] < missed[1] + 0.03 and missed[2] > missed[1] * 1.1, missed  # premise
    assert ctrl._choose_knobs(opts) == 2
    assert MixController(ZEN4, one, chunk_knob=True, knob_tie_points=0.0)._choose_knobs(opts) == 1


def test_a_larger_chunk_budget_is_not_taken_when_a_whole_chunk_of_the_longest_prompt_would_stall_the_streams():
    # demand_rotation, session 26 (25058cc): with few streams answering, the predicted gap (the
    # streams at the attainment share, who meet no prompt) read 256-token chunks as short, the knobs
    # went 32 -> 256 at 49.6 s, and 256-token steps deep in a 1,396-token summary paused a chat 0.70 s
    model = StepModel(overhead_s=0.0107, per_prefill_token_s=0.00268, per_prefill_attn_s=0.00100,
                      per_decode_seq_s=0.00378, per_decode_kv_token_s=3.0e-6)  # that run's online fit
    # (the writing target 3.1 s, not the spec's 3.0: since session 28 each chunk's step overhead counts
    # in the prompt work, and 64 tokens read 3.005 s there, a hair past 3.0; the premise is that 64 holds)
    targets = MixTargets(4.0, 0.5, classes=(SloClass("writing", 3.1, 0.5), SloClass("summary", 15.0, 0.5)))
    summaries, writing = (1330, 1360, 1396), tuple(range(40, 130, 4))
    demand = Demand(0.2, 272, 8.0, 1360, 40, prompts=tuple(sorted(summaries + writing)),
                    classes=(ClassDemand("summary", 0.2, 1362, summaries), ClassDemand("writing", 0.8, 84, writing)))
    views = [InstanceView("e0", "colocated", queued_prompt_tokens=30, num_running=2, decode_kv_tokens=1200),
             InstanceView("e1", "colocated", num_running=2, decode_kv_tokens=1200)]
    predicted = {c: WhatIf(model, c).predict([Held("colocated", 30, 2), Held("colocated", 0, 2)], demand)
                 for c in (32, 64, 128, 256)}
    # premise: 256 reads the least pressure and a gap inside the target, while its whole chunk at the
    # longest prompt's last chunk steps for about a second
    assert min(predicted, key=lambda c: targets.pressure(predicted[c])) == 256 and predicted[256].gap_s < 0.45
    assert WhatIf(model).gap_s(256, 2, 1200, 1396) > 0.9
    assert targets.pressure(predicted[64]) <= 1 < targets.pressure(predicted[32])  # 64 holds the targets, 32 not
    ctrl = MixController(model, targets, chunk_knob=True, chunk_tokens=32)
    d = ctrl.decide(views, 0.0, demand)
    assert d.chunk_tokens == 64, d.reason  # the largest whose whole chunk there steps inside the target
    assert WhatIf(model).gap_s(64, 2, 1200, 1396) < 0.5
    assert "left out: chunk budgets 128, 256 tokens" in d.reason
    # past every setting (overload) the lesser evil is read on deadlines, every budget in
    busy = [InstanceView(v.instance_id, "colocated", queued_prompt_tokens=v.queued_prompt_tokens, num_running=8,
                         decode_kv_tokens=4800) for v in views]
    assert "left out" not in MixController(model, targets, chunk_knob=True, chunk_tokens=32).decide(busy, 0.0,
                                                                                                     demand).reason


def overloaded(met: float, gap_s: float, chunk: int):
    """A knob setting past the targets, predicted to meet `met` of the deadlines (one class, TTFT
    target 4 s, gap within its target): TTFT 4 s / met."""
    p = Prediction(4.0 / met, gap_s, "2 colocated")
    return (TARGETS_ONE.pressure(p), p, (0, chunk))


TARGETS_ONE = MixTargets(4.0, 0.5)


def test_deep_in_overload_settings_tie_and_move_on_the_share_met_as_well_as_the_share_missed():
    # demand_unseen_overload, session 27 (AMX Xeon): in the agents' bursts 64-token chunks read 45-61%
    # missed against 128's 39-51%, inside a tie of 10% of the missed share + 3 points, so the knobs
    # stayed at the shorter gap; the pair at 256 met 85% of agents, the adaptive server 58%. Deep in
    # overload the share met is the small number, and the model's error is relative to it
    ctrl = MixController(ZEN4, TARGETS_ONE, chunk_knob=True, chunk_tokens=64)
    assert ctrl.deadlines_met(overloaded(0.14, 0.2, 64)[1]) == pytest.approx(0.14)
    # 14% met against 20%: within 10% + 3 points of the fewest missed (86% vs 80%), not of the most met
    opts = [overloaded(0.14, 0.2, 64), overloaded(0.20, 0.42, 256)]
    assert ctrl._choose_knobs(opts) == 1
    # near the top the missed share is the small number, and the tie holds as before: 85% vs 88% met
    assert ctrl._choose_knobs([overloaded(0.85, 0.2, 64), overloaded(0.88, 0.42, 256)]) is None
    # a move needs margin (20%) fewer missed or 20% more met: 40% -> 48% met is neither (and no tie), 50% is
    assert ctrl._choose_knobs([overloaded(0.40, 0.2, 64), overloaded(0.48, 0.42, 256)]) is None
    assert "not 20% fewer (nor meet 20% more)" in ctrl._knob_note
    assert ctrl._choose_knobs([overloaded(0.40, 0.2, 64), overloaded(0.50, 0.42, 256)]) == 1
    # a setting whose gap misses its target pays for it in the share met (0.5 / 0.8 of its streams)
    assert ctrl._choose_knobs([overloaded(0.14, 0.2, 64), overloaded(0.20, 0.8, 256)]) is None
