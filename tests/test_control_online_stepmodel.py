"""The step model learnt online from measured steps (control/online_stepmodel.py): it recovers the
model that produced the steps whatever the prior, keeps the prior where the steps say nothing, and
a mix controller that learns it predicts and decides as one that knew the true model."""
from __future__ import annotations

import random

import pytest

from splitserve.control.mix import FALLBACK_STEP_MODEL, InstanceView, MixController, MixTargets
from splitserve.control.online_stepmodel import OnlineStepModel, OnlineStepModels, StepSample
from splitserve.control.stepmodel import COEFFICIENTS, StepModel, StepShape, prefill_attn_ktok2
from splitserve.control.whatif import Demand, Held, WhatIf

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
    true_gap = w_true.predict(cc, CHATS).gap_s
    views = colocated_at_chats(random.Random(5))
    blind = MixController(DECODE_5X_CHEAP, TARGETS, patience=1).decide(
        [InstanceView(v.instance_id, v.role) for v in views], 0.0, CHATS)
    assert blind.to_role == "decode" and "model: prior x1.00 (0 of 30 steps measured" in blind.reason
    assert blind.gap_estimate_s < 0.9 * true_gap  # the wrong prior is more than 10% off (the 40-token chunk is right)

    learnt = MixController(DECODE_5X_CHEAP, TARGETS, patience=1)
    knowing = MixController(TRUE, TARGETS, patience=1)
    decision, truth = learnt.decide(views, 0.0, CHATS), knowing.decide(views, 0.0, CHATS)
    assert decision.gap_estimate_s == pytest.approx(true_gap, rel=0.05)
    assert decision.instance_id is None and truth.instance_id is None
    assert "no mix predicts 20% less pressure" in decision.reason
    assert "model: online fit of 300 steps, median error" in decision.reason
    model = learnt.last["model"]
    assert model["source"] == "online" and model["num_samples"] == 300 and model["threads"] == 1
    assert model["median_abs_rel_error"] < 0.08 and model["prior"] == DECODE_5X_CHEAP.to_dict()
