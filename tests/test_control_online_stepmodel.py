"""The step model learnt online from measured steps (control/online_stepmodel.py): it recovers the
model that produced the steps whatever the prior, keeps the prior where the steps say nothing, and
a mix controller that learns it predicts and decides as one that knew the true model."""
from __future__ import annotations

import random

import pytest

from splitserve.control.mix import FALLBACK_STEP_MODEL, InstanceView, MixController, MixTargets
from splitserve.control.online_stepmodel import OnlineStepModel, OnlineStepModels, StepSample
from splitserve.control.stepmodel import COEFFICIENTS, StepModel, StepShape, prefill_attn_ktok2
from splitserve.control.whatif import ClassDemand, Demand, Held, WhatIf

TRUE = FALLBACK_STEP_MODEL.for_threads(1)  # the bundled model on the AVX2 box, 1 thread
STALE = StepModel(overhead_s=0.0447, per_prefill_token_s=0.00263, per_prefill_attn_s=0.00103,
                  per_decode_seq_s=0.00494, per_decode_kv_token_s=1.43e-5)  # the fit of an older engine elsewhere
DECODE_5X_CHEAP = StepModel(TRUE.overhead_s, TRUE.per_prefill_token_s, TRUE.per_prefill_attn_s,
                            TRUE.per_decode_seq_s / 5, TRUE.per_decode_kv_token_s / 5)


def steps(rng: random.Random, model: StepModel, n: int, kinds=("prefill", "decode", "mixed"), noise=0.03,
          max_context=1500, max_seqs=32, prompts=None) -> list[StepSample]:
    """n steps of `model`, each time off by a random few percent (log-normal)."""
    out = []
    for _ in range(n):
        kind = rng.choice(kinds)
        p, attn, d, kv = 0, 0.0, 0, 0
        if kind in ("prefill", "mixed"):
            p = rng.choice(prompts) if prompts else rng.randint(8, 256)
            attn = prefill_attn_ktok2(0 if prompts else rng.randint(0, 1500), p)
        if kind in ("decode", "mixed"):
            d = rng.randint(1, max_seqs)
            kv = d * rng.randint(20, max_context)  # the batch's mean context varies from step to step
        shape = StepShape(p, attn, d, kv)
        out.append(StepSample(shape, model.predict(shape) * rng.lognormvariate(0, noise)))
    return out


def off_by(model: StepModel, reference: StepModel) -> dict[str, float]:
    return {c: abs(getattr(model, c) / getattr(reference, c) - 1) for c in COEFFICIENTS if getattr(reference, c)}


def test_the_online_fit_recovers_the_model_that_made_the_steps_despite_a_stale_prior():
    assert max(off_by(STALE, TRUE).values()) > 0.4  # overhead 2x, decode KV 1.5x: a prior worth correcting
    online = OnlineStepModel(STALE)
    online.refit(steps(random.Random(0), TRUE, 300))
    assert online.ready and online.num_samples == 300 and online.num_fits == 1
    assert max(off_by(online.model, TRUE).values()) < 0.1, online.model
    assert online.median_error < 0.05  # the noise is 3%
    info = online.describe()
    assert info["source"] == "online" and info["coefficients"] == online.model.to_dict()
    assert info["prior"] == STALE.to_dict()


def test_with_only_decode_steps_measured_the_prefill_coefficients_stay_at_the_prior():
    online = OnlineStepModel(STALE)
    online.refit(steps(random.Random(1), TRUE, 300, kinds=("decode",)))
    prior_off, true_off = off_by(online.model, STALE), off_by(online.model, TRUE)
    assert prior_off["per_prefill_token_s"] < 0.03 and prior_off["per_prefill_attn_s"] < 0.03
    assert max(true_off[c] for c in ("overhead_s", "per_decode_seq_s", "per_decode_kv_token_s")) < 0.05, true_off


def test_a_prior_far_too_cheap_does_not_hold_back_the_coefficients_the_steps_pin_down():
    # relative to the prior's own times, its pseudo-samples would pull 25x harder than the steps
    online = OnlineStepModel(DECODE_5X_CHEAP)
    online.refit(steps(random.Random(2), TRUE, 60, kinds=("decode",)))
    assert max(off_by(online.model, TRUE).values()) < 0.12, online.model


def test_with_few_steps_measured_the_prior_serves_and_a_refit_comes_only_with_new_steps():
    models = OnlineStepModels(FALLBACK_STEP_MODEL, min_samples=30)
    few = steps(random.Random(3), DECODE_5X_CHEAP, 20)
    online = models.update(2, [("a", 20, few)])
    assert not online.ready and online.model == FALLBACK_STEP_MODEL.for_threads(2)
    assert online.describe()["source"] == "prior" and online.median_error is None
    more = steps(random.Random(4), DECODE_5X_CHEAP, 40)
    assert models.update(2, [("a", 20, few), ("b", 40, more)]).num_fits == 1
    assert models.update(2, [("a", 20, few), ("b", 40, more)]).num_fits == 1  # nothing new: no refit
    assert models.update(2, [("a", 21, few), ("b", 40, more)]).num_fits == 2
    assert models.by_threads[2].num_samples == 60 and set(models.by_threads) == {2}


TARGETS = MixTargets(ttft_s=2.0, gap_s=0.2)
CHATS = Demand(1.0, 40.0, 128.0, 40, 128, prompts=(40,) * 6)  # chats of one length: the gap is decode plus a 40-token chunk


def colocated_at_chats(rng: random.Random) -> list[InstanceView]:
    """Two colocated instances serving chats, with the steps they measured (true model)."""
    views = []
    for i in range(2):
        window = tuple(steps(rng, TRUE, 150, kinds=("decode", "mixed", "decode"), noise=0.05, max_context=170,
                             max_seqs=6, prompts=(20, 30, 40, 60)))
        views.append(InstanceView(f"c{i}", "colocated", step_samples=window, num_step_samples=len(window)))
    return views


def test_a_controller_whose_prior_underrates_decode_5x_learns_the_gap_and_decides_as_the_true_model_would():
    # With decodes 5x cheaper, one decode instance seems to keep up with the chats at 30 ms gaps, so
    # splitting two colocated instances into 1 prefill + 1 decode looks like a cure for their 170 ms
    # gaps. At the true cost the decode instance saturates (over 1 s gaps): staying colocated is better.
    w_true, w_cheap = WhatIf(TRUE), WhatIf(DECODE_5X_CHEAP)
    cc, pd = [Held("colocated")] * 2, [Held("prefill"), Held("decode")]
    assert w_true.predict(pd, CHATS).saturated == ("decode",) and not w_cheap.predict(pd, CHATS).saturated
    true_gap = w_true.predict(cc, CHATS).gap_s  # the mean step's, as a controller with no steps measured reads it
    views = colocated_at_chats(random.Random(5))
    blind = MixController(DECODE_5X_CHEAP, TARGETS, patience=1).decide(
        [InstanceView(v.instance_id, v.role) for v in views], 0.0, CHATS)
    assert blind.to_role == "decode" and "model: prior x1.00 (0 of 30 steps measured" in blind.reason
    assert blind.gap_estimate_s < 0.9 * true_gap  # the wrong prior is more than 10% off (the 40-token chunk is right)

    learnt = MixController(DECODE_5X_CHEAP, TARGETS, patience=1)
    knowing = MixController(TRUE, TARGETS, patience=1)
    decision, truth = learnt.decide(views, 0.0, CHATS), knowing.decide(views, 0.0, CHATS)
    # the gap is a step with a 40-token chunk at the 90th percentile of the steps' 5% spread
    tail = learnt.last["model"]["prompt_step_tail"]
    assert 1.0 < tail < 1.15 and learnt.last["model"]["num_prompt_steps"] > 50
    assert decision.gap_estimate_s == pytest.approx(WhatIf(TRUE, gap_tail=tail).predict(cc, CHATS).gap_s, rel=0.05)
    assert decision.instance_id is None and truth.instance_id is None
    # both stay, for the same reason (with the tail the gap sits just past its 200 ms target: overload)
    assert decision.held == truth.held and decision.held in ("no better mix", "overload")
    assert "model: online fit of 300 steps, median error" in decision.reason
    model = learnt.last["model"]
    assert model["source"] == "online" and model["num_samples"] == 300 and model["threads"] == 1
    assert model["median_abs_rel_error"] < 0.08 and model["prior"] == DECODE_5X_CHEAP.to_dict()


# ---- the spread of steps that carry prompt tokens: a gap is one step, not a mean ----------------

SESSION19 = StepModel(overhead_s=0.0112, per_prefill_token_s=0.00314, per_prefill_attn_s=0.00064,
                      per_decode_seq_s=0.00395, per_decode_kv_token_s=3.3e-6)  # a 1-thread fit on the Zen 4 box


def contended(rng: random.Random, slow_share: float, n: int = 300) -> tuple[StepSample, ...]:
    """Steps of SESSION19: a third carry 32-100 prompt tokens, and of those `slow_share` run 1.35x
    (the other engine computing at the same time); 3% noise on every step."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            p, d = rng.choice((32, 32, 64, 100)), rng.randint(0, 3)
            shape, factor = StepShape(p, prefill_attn_ktok2(rng.randint(0, 600), p), d, d * 650), \
                1.35 if rng.random() < slow_share else 1.0
        else:
            d = rng.randint(1, 4)
            shape, factor = StepShape(0, 0.0, d, d * 650), 1.0
        out.append(StepSample(shape, SESSION19.predict(shape) * factor * rng.lognormvariate(0, 0.03)))
    return tuple(out)


def test_the_prompt_step_tail_is_the_90th_percentile_of_their_measured_to_fitted_ratio():
    even, spread = OnlineStepModel(SESSION19), OnlineStepModel(SESSION19)
    even.refit(contended(random.Random(0), 0.0))
    spread.refit(contended(random.Random(0), 0.3))
    assert even.num_prompt_steps == spread.num_prompt_steps == 100
    assert 1.0 <= even.prompt_step_tail < 1.08  # 3% noise
    assert 1.15 < spread.prompt_step_tail < 1.35  # 30% of them 1.35x: the fit's mean sits between
    assert spread.describe()["prompt_step_tail"] == spread.prompt_step_tail
    # decode steps do not count; nor do a few prompt steps; a handful stalled by something else is capped
    decodes = OnlineStepModel(SESSION19)
    decodes.refit([s for s in contended(random.Random(0), 1.0) if s.shape.prefill_tokens == 0])
    assert decodes.ready and decodes.prompt_step_tail == 1.0 and decodes.num_prompt_steps == 0
    few = [s for s in contended(random.Random(0), 1.0)]
    few = [s for s in few if s.shape.prefill_tokens == 0] + [s for s in few if s.shape.prefill_tokens][:9]
    decodes.refit(few)
    assert decodes.prompt_step_tail == 1.0
    stalled = [StepSample(s.shape, s.seconds * (10 if s.shape.prefill_tokens else 1))
               for s in contended(random.Random(0), 0.0)]
    decodes.refit(stalled[:60] + list(contended(random.Random(1), 0.0)))
    assert decodes.prompt_step_tail <= 2.0


def test_the_gap_tail_stretches_only_the_steps_that_carry_a_prompt_chunk():
    docs = Demand(0.3, 0.3 * 600, 0.3 * 24, 600, 24, prompts=(600,) * 4)
    plain, tailed = WhatIf(SESSION19, 64), WhatIf(SESSION19, 64, gap_tail=1.3)
    for roles in (["colocated"] * 2, ["prefill", "decode"]):
        a, b = plain.predict([Held(r) for r in roles], docs), tailed.predict([Held(r) for r in roles], docs)
        assert b.ttft_s == a.ttft_s and b.tpot_s == a.tpot_s  # a prompt's many steps average out
        # colocated: the stream meets a 64-token chunk; 1P1D: its gap is a decode step, no chunk in it
        assert b.gap_s == pytest.approx(a.gap_s * (1.3 if roles[0] == "colocated" else 1.0))
    # a decode instance prefilling short prompts itself: its gap carries their chunk
    local = plain.predict([Held("prefill"), Held("decode")], docs, local_max_tokens=600)
    assert tailed.predict([Held("prefill"), Held("decode")], docs, local_max_tokens=600).gap_s == \
        pytest.approx(local.gap_s * 1.3)


def test_a_stream_meets_a_prompt_chunk_only_as_often_as_prompts_arrive_during_its_life():
    # one 600-token document in ten requests: at 0.02 requests/s a stream's life (its prefill and
    # 24 steps, under a second) sees one arrival in ~100 streams, so 90% of streams meet no chunk:
    # their gap is a decode step; at 1 request/s one stream in ~25 meets the document, so the 90th
    # meets a chat's chunk; at 3 requests/s, one in ~8: the document's
    w = WhatIf(SESSION19, 256)
    prompts = (60,) * 9 + (600,)

    def at(rate: float):
        return w.predict([Held("colocated")] * 2, Demand(rate, rate * 114, rate * 24, 114, 24, prompts=prompts))
    decode_only = SESSION19.step_s(0, 0.0, 1, 126)
    assert at(0.02).gap_s == pytest.approx(decode_only, rel=0.05)
    assert SESSION19.step_s(60, 0.0) < at(1.0).gap_s < SESSION19.step_s(100, 0.0)
    assert at(3.0).gap_s > SESSION19.step_s(256, 0.0) > 5 * decode_only


def test_with_the_steps_spread_the_chunk_knob_does_not_go_where_the_gap_runs_past_its_target():
    # changing_demand's document phase at 32-token chunks (session 19): the documents' TTFT misses.
    # With the steps' mean alone, 128-token chunks look like they hold every target (seen there:
    # 32 -> 128, whose steps ran 0.51-0.78 s against the 500 ms gap target); with 30% of the
    # prompt steps 1.35x slower, as measured beside a second engine, 128 misses the gap and the
    # knob goes to 64
    chat = ClassDemand("chat", 0.25, 80, (60, 80, 100))
    doc = ClassDemand("document", 0.75, 640, (600, 620, 640, 648, 660, 691))
    # (0.74 req/s since session 25: with a chunk's gap read at its prompt's last chunk, 64 tokens at
    # 0.7 req/s read 0.95x and 32 1.02x, within knob_tie, so the knobs stayed at 32 either way)
    demand = Demand(0.74, 0.74 * 500, 0.74 * 24, 500, 24, prompts=(60, 80, 100, 600, 620, 640, 648, 660, 691),
                    classes=(chat, doc))
    targets = MixTargets(ttft_s=4.0, gap_s=0.5)
    chosen = {}
    for slow in (0.0, 0.3):
        rng = random.Random(3)
        views = [InstanceView(f"e{i}", "colocated", num_running=1, decode_kv_tokens=650,
                              step_samples=contended(rng, slow), num_step_samples=300) for i in range(2)]
        ctrl = MixController(SESSION19, targets, chunk_knob=True, chunk_tokens=32)
        decisions = [ctrl.decide(views, float(t), demand) for t in range(3)]
        assert all(d.instance_id is None for d in decisions)
        moved = [d for d in decisions if d.chunk_tokens is not None]
        assert len(moved) == 1, [d.reason for d in decisions]
        chosen[slow] = (moved[0].chunk_tokens, decisions.index(moved[0]), ctrl.last["model"]["prompt_step_tail"])
    # the mean reads 128 as the one setting holding every target (0.98x; 64 1.01x, 32 1.09x): at once,
    # to 128; at the tail 128's gap runs past its target (1.22x), no setting holds them, and 64
    # tokens, predicted to meet the most deadlines, wins the patience's two intervals first
    # (wip/knob-room: a gap counts as held for a move only with knob_headroom to spare, and 128's,
    # 488 ms at the mean, has none: the mean also weighs deadlines met, and 64 wins after patience)
    assert chosen[0.0][:2] == (64, 1) and chosen[0.3][:2] == (64, 1), chosen
    assert chosen[0.3][2] > 1.15
