"""The mix controller's decisions on recorded demand, with an injected clock and synthetic load
readings: it does not flap when demand alternates faster than its horizon, it makes at most one
move per regime change when regimes outlast the horizon, it holds (and says so) when no mix meets
the targets, and it moves the local-prefill threshold before changing a role when that holds the
targets."""
from __future__ import annotations

from splitserve.control.mix import InstanceView, MixController, MixTargets, SloClass
from splitserve.control.stepmodel import StepModel
from splitserve.control.whatif import ClassDemand, Demand, Held, Prediction, WhatIf

# a CPU-like instance: 45 ms per step, 2.6 ms per prompt token, 5 ms per decode
MODEL = StepModel(overhead_s=0.045, per_prefill_token_s=0.0026, per_prefill_attn_s=0.001, per_decode_seq_s=0.005,
                  per_decode_kv_token_s=1.4e-5)
TARGETS = MixTargets(ttft_s=4.0, gap_s=0.5)


def chats(rate: float) -> Demand:  # short prompts, long answers: one decode instance saturates
    return Demand(rate, rate * 40, rate * 128, 40, 128, prompts=(20, 30, 40, 40, 50, 60))


def documents(rate: float) -> Demand:  # long prompts: their chunks stall colocated streams
    return Demand(rate, rate * 600, rate * 24, 600, 24, prompts=(600,) * 4)


def mix_of(*roles: str) -> list[InstanceView]:
    return [InstanceView(f"e{i}", role) for i, role in enumerate(roles)]


def apply(views: list[InstanceView], decision) -> list[InstanceView]:
    return [InstanceView(v.instance_id, decision.to_role) if v.instance_id == decision.instance_id else v
            for v in views]


def run_trace(ctrl: MixController, trace, views: list[InstanceView], interval_s: float = 1.0):
    """trace: (seconds, demand) regimes in order. Returns every decision with a role change."""
    moves, t = [], 0.0
    for seconds, demand in trace:
        end = t + seconds
        while t < end:
            d = ctrl.decide(views, t, demand)
            if d.instance_id is not None:
                moves.append(d)
                views = apply(views, d)
            t += interval_s
    return moves


def alternating(period_s: float, total_s: float):
    regimes = (chats(1.4), documents(0.3))
    return [(period_s, regimes[i % 2]) for i in range(int(total_s // period_s))]


def first_steps(moves):  # a two-change move (2 colocated -> 1 prefill + 1 decode) is one move
    return [d for d in moves if "second of two steps" not in d.reason]


def test_the_two_regimes_want_different_mixes():
    # the premise of the trace tests: each regime alone moves the controller
    to_separated = run_trace(MixController(MODEL, TARGETS), [(30, documents(0.3))], mix_of("colocated", "colocated"))
    assert {d.to_role for d in to_separated} == {"prefill", "decode"}
    to_colocated = run_trace(MixController(MODEL, TARGETS), [(30, chats(1.4))], mix_of("prefill", "decode"))
    assert to_colocated and {d.to_role for d in to_colocated} == {"colocated"}


def test_demand_alternating_much_faster_than_the_horizon_moves_at_most_once():
    # regimes of 10 s against a 60 s horizon, for 4 minutes (23 regime changes)
    moves = run_trace(MixController(MODEL, TARGETS, horizon_s=60.0), alternating(10, 240),
                      mix_of("colocated", "colocated"))
    assert len(first_steps(moves)) <= 1, [d.reason for d in moves]


def test_demand_alternating_a_little_faster_than_the_horizon_makes_at_most_one_move_per_regime_change():
    trace = alternating(40, 320)  # 40 s regimes, 60 s horizon: 7 regime changes
    moves = run_trace(MixController(MODEL, TARGETS, horizon_s=60.0), trace, mix_of("colocated", "colocated"))
    assert len(first_steps(moves)) <= len(trace) - 1, [d.reason for d in moves]


def test_regimes_longer_than_the_horizon_are_followed_once_each():
    trace = alternating(150, 600)  # 150 s regimes, 60 s horizon: it should follow each, once
    moves = run_trace(MixController(MODEL, TARGETS, horizon_s=60.0), trace, mix_of("colocated", "colocated"))
    steps = first_steps(moves)
    assert 1 <= len(steps) <= len(trace) - 1
    for d in moves:
        assert d.predicted_gain is not None and d.predicted_gain > d.predicted_cost


def test_undoing_a_recent_move_needs_a_higher_bar():
    ctrl = MixController(MODEL, TARGETS, horizon_s=60.0)
    views = mix_of("colocated", "colocated")
    moves = run_trace(ctrl, [(40, documents(0.3))], views)
    assert moves
    views = mix_of("prefill", "decode")
    decisions = []
    for t in range(40, 60):
        decisions.append(ctrl.decide(views, float(t), chats(1.4)))
        if decisions[-1].instance_id is not None:
            break
    # the chats saturate the one decode instance: moving back gains, but first waits on the higher bar
    held = [d for d in decisions if d.held == "cost"]
    assert held and all("undoing a recent move" in d.reason for d in held)
    assert all(d.predicted_gain <= d.predicted_cost for d in held)
    undo = decisions[-1]
    if undo.instance_id is not None:  # when it comes, it has paid undo_bar times a move's cost
        assert undo.to_role == "colocated" and undo.predicted_gain > undo.predicted_cost
        assert undo.predicted_cost >= ctrl.undo_bar * ctrl.move_cost_s()
        assert len(held) >= 3


def test_measured_change_times_are_the_cost():
    ctrl = MixController(MODEL, TARGETS)
    assert ctrl.move_cost_s() == ctrl.change_cost_s
    ctrl.record_change_cost(20.0)
    assert ctrl.move_cost_s() == 20.0
    ctrl.record_change_cost(0.0)
    ctrl.record_change_cost(0.0)
    assert ctrl.move_cost_s() >= ctrl.change_cost_s / 2  # a stall outlasts the drain


def test_overload_holds_the_mix_predicted_to_meet_the_most_deadlines_and_says_so():
    ctrl = MixController(MODEL, TARGETS, horizon_s=60.0)
    views = mix_of("colocated", "colocated")
    flood = Demand(6.0, 6.0 * 600, 6.0 * 128, 600, 128, prompts=(40, 600, 600, 600))  # past every mix
    decisions = [ctrl.decide(views, float(t), flood) for t in range(60)]
    assert all(d.instance_id is None for d in decisions)
    last = decisions[-1]
    assert last.overload and last.held == "overload"
    assert "no mix within reach meets the targets" in last.reason and "holding 2 colocated" in last.reason
    assert last.deadlines_met is not None and last.deadlines_met < 1


def test_per_class_targets_count_deadlines_by_share():
    t = MixTargets(4.0, 0.5, classes=(SloClass("chat", 2.0, 0.25, 3.0), SloClass("doc", 10.0, 1.0, 1.0)))
    from splitserve.control.whatif import Prediction
    p = Prediction(ttft_s=5.0, gap_s=0.2, serving="x")
    assert t.deadlines_met(p) == (3.0 * (2.0 / 5.0) + 1.0) / 4.0
    assert t.pressure(p) == 2.5  # the strictest class


def test_the_threshold_knob_moves_before_any_role_change_when_it_holds_the_targets():
    # 1 prefill + 1 decode, documents queued on the prefill instance: every chat waits behind them
    # there; prefilled on the decode instance instead, chats get their first token in time
    views = [InstanceView("e0", "prefill", queued_prompt_tokens=3000), InstanceView("e1", "decode")]
    ctrl = MixController(MODEL, TARGETS, local_prefill_max_tokens=0)
    d = ctrl.decide(views, 0.0, chats(0.5))
    assert d.instance_id is None and d.local_prefill_max_tokens is not None and d.local_prefill_max_tokens >= 64
    assert ctrl.local_prefill_max_tokens == d.local_prefill_max_tokens
    # without the knob the same reading asks for a role change (once patience is met)
    plain = MixController(MODEL, TARGETS)
    moved = [plain.decide(views, float(t), chats(0.5)) for t in range(3)]
    assert any(x.instance_id is not None for x in moved)


def test_the_loop_applies_the_threshold_and_logs_each_decision_with_its_numbers():
    import asyncio

    from splitserve.control.mix_loop import MixLoop
    views = [InstanceView("e0", "prefill", queued_prompt_tokens=3000), InstanceView("e1", "decode")]
    set_to, changed = [], []

    async def change_role(instance_id, role):
        changed.append((instance_id, role))

    loop = MixLoop(MixController(MODEL, TARGETS, local_prefill_max_tokens=0), lambda: views, change_role,
                   clock=lambda: 0.0, demand=lambda: chats(0.5), set_threshold=set_to.append)
    asyncio.run(loop.run_once())
    assert set_to and not changed and loop.num_threshold_moves == 1
    entry = loop.decisions[-1]
    assert entry["local_prefill_max_tokens"] == set_to[0] and entry["applied"] and entry["predicted_cost"] == 0.0


def test_with_the_chunk_budget_knob_alternating_demand_moves_the_knob_once_and_no_role():
    # small chunks hold the documents' gaps on two colocated instances and cost the chats nothing
    ctrl = MixController(MODEL, TARGETS, horizon_s=60.0, chunk_knob=True)
    views, knob_moves, t = mix_of("colocated", "colocated"), [], 0.0
    for seconds, demand in alternating(40, 320):
        for _ in range(seconds):
            d = ctrl.decide(views, t, demand)
            assert d.instance_id is None, d.reason
            if d.chunk_tokens is not None:
                knob_moves.append(d)
            t += 1.0
    # the knob moves once and stays: at the first interval, every target met with room, to its
    # resting budget (session 22: the largest whose whole-chunk step is within calm of the gap
    # target, 64 tokens here), which holds the documents' gaps too (before: to 32 in the first
    # document phase, the shortest-gap setting holding the targets with room)
    assert len(knob_moves) == 1 and knob_moves[0].predicted_cost == 0.0 and ctrl.chunk_tokens == 64
    assert "at rest" in knob_moves[0].reason


def documents_among_chats(rate: float) -> Demand:  # changing_demand's document phase: 3 documents to 1 chat
    mean = 0.75 * 600 + 0.25 * 80
    return Demand(rate, rate * mean, rate * 24, mean, 24, prompts=(60, 80, 600, 600, 600, 600, 650, 700))


def short_chats(rate: float) -> Demand:
    return Demand(rate, rate * 80, rate * 24, 80, 24, prompts=(40, 60, 80, 80, 100, 120, 200, 600))


def first_move_after(ctrl: MixController, shift_s: float, before: Demand, after: Demand, views, interval_s=2.0):
    """A minute of `before`, then `after`: the time of the first role change after the shift."""
    t = 0.0
    for demand, seconds in ((before, shift_s), (after, 60.0)):
        for _ in range(int(seconds / interval_s)):
            d = ctrl.decide(views, t, demand)
            if d.instance_id is not None and t >= shift_s:
                return t, d
            if d.instance_id is not None:
                views = apply(views, d)
            t += interval_s
    return None, None


def test_a_mix_is_judged_at_the_chunk_budget_it_would_run_at():
    # documents saturate the one prefill instance; two colocated instances at today's 256-token
    # chunks would stall every stream past the gap target, at 64-token ones they hold every target
    ctrl = MixController(MODEL, TARGETS, chunk_knob=True, patience=1)
    views = mix_of("prefill", "decode")
    d = ctrl.decide(views, 0.0, documents_among_chats(0.8))
    assert d.instance_id is not None and d.to_role == "colocated" and not d.overload, d.reason
    assert d.predicted_gap_s < TARGETS.gap_s and d.predicted_ttft_s < TARGETS.ttft_s
    # after the change, the knob goes where the move was judged
    views = apply(views, d)
    d2 = ctrl.decide(views, 2.0, documents_among_chats(0.8))
    assert d2.to_role == "colocated"
    d3 = ctrl.decide(apply(views, d2), 4.0, documents_among_chats(0.8))
    assert d3.chunk_tokens is not None and d3.chunk_tokens < 256


def test_missed_deadlines_weigh_more_so_a_phase_that_saturates_a_stage_is_answered_sooner():
    # a minute of chats on 1 prefill + 1 decode (where it is best), then documents that saturate the
    # prefill instance: the move back to colocated must not wait for the documents to fill the horizon
    moved_at = {}
    for weight in (0.0, 4.0):
        ctrl = MixController(MODEL, TARGETS, horizon_s=60.0, chunk_knob=True, miss_weight=weight)
        t, d = first_move_after(ctrl, 60.0, short_chats(1.0), documents_among_chats(0.8), mix_of("prefill", "decode"))
        assert d is not None and d.to_role == "colocated", weight
        moved_at[weight] = t - 60.0
    assert moved_at[4.0] <= 6.0 and moved_at[4.0] < moved_at[0.0], moved_at



def tied_settings(ctrl: MixController, met: dict[int, float]) -> list[int]:
    """Past every setting, those the controller counts equal to the best: within knob_tie (+ points)
    of the fewest missed and of the most met."""
    fewest, most = min(1 - m for m in met.values()), max(met.values())
    return [c for c in met if 1 - met[c] <= fewest * (1 + ctrl.knob_tie) + ctrl.knob_tie_points
            and met[c] * (1 + ctrl.knob_tie) + ctrl.knob_tie_points >= most]


def test_past_every_setting_the_knobs_move_once_to_the_setting_meeting_the_most_deadlines_and_stay():
    # long answers beside prompts in 32-token chunks: the TTFT is far past its target and no chunk
    # budget holds every target; larger chunks meet more TTFTs at longer pauses. The knobs go where
    # the most deadlines are predicted met, once, and stay there (session 17 moved them with no
    # margin and flapped them past every capacity)
    # (session 24: a deadline counts as met for the TTFT share times the gap share, a gap held only
    # with knob_headroom to spare; the demand here was 0.6 req/s of 300-token prompts, where 64 and
    # 128 now miss less than 20% fewer deadlines than 32 and the knobs rightly stay)
    # (session 28: 0.59 req/s, not 0.65: each chunk's step overhead now counts in the prompt work, and
    # at 0.65 32-token chunks saturate while 64 miss far more than 128, no tie left for the gap to break)
    writing = Demand(0.59, 0.59 * 250, 0.59 * 200, 250, 200, prompts=(150, 200, 250, 300, 350))
    ctrl = MixController(MODEL, TARGETS, chunk_knob=True, chunk_tokens=32)
    decisions = [ctrl.decide(mix_of("colocated", "colocated"), float(t), writing) for t in range(30)]
    moves = [d for d in decisions if d.chunk_tokens is not None]
    assert len(moves) == 1 and all(d.instance_id is None for d in decisions)
    assert decisions.index(moves[0]) == ctrl.patience - 1  # the same setting won `patience` intervals
    assert "no setting holds the targets; predicted to meet" in moves[0].reason
    assert decisions[-1].held == "overload"
    preds = {c: WhatIf(MODEL, c).predict([Held("colocated")] * 2, writing) for c in ctrl.chunk_choices}
    met = {c: ctrl.deadlines_met(p) for c, p in preds.items()}
    # the most deadlines, settings missing within knob_tie of the fewest counted equal and the
    # shortest gap of those taken (here 64 tokens, missing 45% where 128 miss 41% at longer steps)
    tied = tied_settings(ctrl, met)
    assert ctrl.chunk_tokens == min(tied, key=lambda c: preds[c].gap_s) != 32 and met[ctrl.chunk_tokens] > met[32]
    assert len(tied) > 1 and ctrl.chunk_tokens != max(met, key=met.get), "premise: a tie the gap breaks"
    # a setting that misses fewer deadlines, but not by the margin: the knobs stay
    assert (1 - met[ctrl.chunk_tokens]) > (1 - met[32]) * 0.1
    # the move waits for the same setting to win `patience` intervals running: with the demand read
    # alternating between two overloads whose best settings differ, nothing moves
    # (session 20, on 5ecb415: 64 -> 128 -> 64 -> 128 tokens in 4 s)
    alternating = MixController(MODEL, TARGETS, chunk_knob=True, chunk_tokens=32)
    # documents with short answers: 128-token chunks best (the tie broken by the gap, as the controller
    # does). Session 25: with a chunk's gap read at its prompt's last chunk, 4 chats among 6 800-token
    # documents (the demand here before) read 64 best too, a 128-token chunk at token 672 too long a step
    other = Demand(0.5, 0.5 * 600, 0.5 * 64, 600, 64, prompts=(600,) * 6)
    best = {}
    for d_ in (writing, other):
        preds_ = {c: WhatIf(MODEL, c).predict([Held("colocated")] * 2, d_) for c in alternating.chunk_choices}
        missed_ = {c: 1 - alternating.deadlines_met(p) for c, p in preds_.items()}
        tied_ = tied_settings(alternating, {c: 1 - x for c, x in missed_.items()})
        best[d_] = min(tied_, key=lambda c: preds_[c].gap_s)
        assert missed_[best[d_]] <= missed_[32] * (1 - alternating.margin), "premise: each alone would move"
    assert best[writing] != best[other] != 32, best
    decisions = [alternating.decide(mix_of("colocated", "colocated"), float(t), (writing, other)[t % 2])
                 for t in range(12)]
    assert all(d.chunk_tokens is None and d.instance_id is None for d in decisions), [d.reason for d in decisions]
    # (a margin too large for any move: tests/test_mix_pause.py, the overload margin read both ways)


def test_targets_met_without_room_move_the_chunk_knob_to_a_calm_setting_before_any_role():
    # changing_demand, session 18: chats at 256-token chunks read 0.61-0.69x (met, not calm), so
    # the mix went to 1 prefill + 1 decode; the repeat whose knob went to 32 tokens stayed
    # colocated and met every deadline when the documents came
    chats_ = Demand(1.0, 70.0, 64.0, 70.0, 64.0, prompts=tuple(range(30, 121, 15)))
    roles = run_trace(MixController(MODEL, TARGETS, chunk_knob=False), [(20, chats_)], mix_of("colocated", "colocated"))
    assert roles, "premise: without the knob, this reading moves a role"
    ctrl = MixController(MODEL, TARGETS, chunk_knob=True)
    views, decisions = mix_of("colocated", "colocated"), []
    for t in range(20):
        d = ctrl.decide(views, float(t), chats_)
        decisions.append(d)
        if d.instance_id is not None:
            views = apply(views, d)
    assert all(d.instance_id is None for d in decisions), [d.reason for d in decisions]
    moved = [d for d in decisions if d.chunk_tokens is not None]
    assert len(moved) == 1 and moved[0].chunk_tokens == 32 and "every target met with room" in moved[0].reason
    assert decisions[-1].held == "calm"


def test_a_knob_setting_the_margin_below_now_is_taken_before_a_role_change_even_if_not_calm():
    # changing_demand, session 20: one document among the first chats; 256-token chunks read 0.91x
    # (a chat's chunk in the gap), 64-token ones 0.67x (the document's TTFT: not calm), so the knob
    # stayed and the mix went to 1 prefill + 1 decode, which a role change may do for 20% less
    chats_p = tuple(range(30, 151, 10))
    mean = (sum(chats_p) + 700) / 14
    demand = Demand(0.4, 0.4 * mean, 0.4 * 64, mean, 64, prompts=chats_p + (700,),
                    classes=(ClassDemand("chat", 13 / 14, sum(chats_p) / 13, chats_p),
                             ClassDemand("document", 1 / 14, 700, (700,))))
    assert run_trace(MixController(MODEL, TARGETS, chunk_knob=False), [(10, demand)],
                     mix_of("colocated", "colocated")), "premise: without the knob, this reading moves a role"
    ctrl = MixController(MODEL, TARGETS, chunk_knob=True)
    decisions = [ctrl.decide(mix_of("colocated", "colocated"), float(t), demand) for t in range(10)]
    assert all(d.instance_id is None for d in decisions), [d.reason for d in decisions]
    moved = [d for d in decisions if d.chunk_tokens is not None]
    assert len(moved) == 1 and moved[0].chunk_tokens == 64 and "targets held" in moved[0].reason


def test_a_calm_seeking_knob_move_must_lower_the_pressure_by_the_margin():
    # demand_rotation, session 19: with every target met at 0.60-0.65x the chunk knob went 32 -> 64
    # tokens for a predicted 0.57x, and 64 -> 32 for 0.58x, undone 3 s later by a missed target;
    # small steps inside the band chase noise and lengthen the chunks the streams meet
    ctrl = MixController(MODEL, TARGETS, chunk_knob=True)

    def option(pressure: float, gap_s: float, chunk: int):
        return (pressure, Prediction(pressure * 4.0, gap_s, "2 colocated"), (0, chunk))

    now = option(0.65, 0.15, 32)
    assert ctrl._choose_knobs([now, option(0.57, 0.20, 64)]) is None  # calm, but 12% lower only
    assert ctrl._choose_knobs([now, option(0.57, 0.20, 64), option(0.50, 0.30, 128)]) == 2
    assert ctrl._choose_knobs([option(0.60, 0.30, 64), option(0.58, 0.15, 32)]) is None
    # by the margin but not calm: the least pressure of those below the bar (a role change needs no more)
    assert ctrl._choose_knobs([option(0.97, 0.45, 256), option(0.66, 0.13, 32), option(0.70, 0.2, 64)]) == 1
    # a missed target still moves to the shortest-gap setting that holds the targets, by any margin
    assert ctrl._choose_knobs([option(1.02, 0.15, 32), option(0.91, 0.20, 64)]) == 1
    loose = MixController(MODEL, TARGETS, chunk_knob=True, margin=0.0)
    assert loose._choose_knobs([now, option(0.57, 0.20, 64)]) == 1


def test_a_move_gaining_barely_more_than_its_cost_is_not_made():
    # the first move on a documents burst, with its gain and cost; a controller whose change cost is
    # set so that the same move gains 5% more than it costs holds it (within the model's error),
    # where one with no margin makes it (demand_shift, session 25: a gain of 10.6 against 10.0)
    first = MixController(MODEL, TARGETS)
    moves = run_trace(first, [(30, documents(0.3))], mix_of("colocated", "colocated"))
    assert moves and moves[0].predicted_gain > moves[0].predicted_cost * 1.1
    at = moves[0]
    cost_s = first.change_cost_s * (at.predicted_gain / at.predicted_cost) / 1.05
    held_run = run_trace(MixController(MODEL, TARGETS, change_cost_s=cost_s), [(30, documents(0.3))],
                         mix_of("colocated", "colocated"))
    moved_run = run_trace(MixController(MODEL, TARGETS, change_cost_s=cost_s, cost_margin=0.0),
                          [(30, documents(0.3))], mix_of("colocated", "colocated"))
    assert moved_run and moved_run[0].reason.split(";")[0] == at.reason.split(";")[0]
    assert not held_run or held_run[0].predicted_gain > held_run[0].predicted_cost * 1.1


def test_a_minute_in_which_both_mixes_were_calm_does_not_delay_the_move_out_of_a_saturated_stage():
    # demand_unseen_overload, session 32: a minute of light demand on 1 prefill + 1 decode, where 2
    # colocated would have met every target with room too, read as ~-0.3x a second against moving
    # back; when the closing chats saturated the one decode instance the move waited 7 s while chats
    # missed their TTFT. Room against room gains nothing: the move comes once it pays for itself on
    # the saturation alone (the code before: 7 s here)
    views = mix_of("prefill", "decode")
    probe = MixController(MODEL, TARGETS, horizon_s=60.0)
    probe.decide(views, 0.0, chats(0.3))
    assert TARGETS.pressure(probe.last["now"]) < probe.calm
    assert all(TARGETS.pressure(p) < probe.calm for _, p in probe.last["candidates"])  # premise: both calm
    probe.decide(views, 1.0, chats(1.15))
    assert 1.5 < TARGETS.pressure(probe.last["now"]) < 2.5  # premise: the decode instance saturated, ~2x
    ctrl = MixController(MODEL, TARGETS, horizon_s=60.0)
    t, d = first_move_after(ctrl, 60.0, chats(0.3), chats(1.15), views, interval_s=1.0)
    assert d is not None and d.to_role == "colocated" and d.predicted_gain > d.predicted_cost
    assert t - 60.0 <= 4.0, t
