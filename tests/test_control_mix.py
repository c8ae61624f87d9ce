"""The adaptive mix controller's decisions: hysteresis, one change per interval, cooldown,
never a stage left without an instance, a reason for everything; and the loop that applies them."""
from __future__ import annotations

import asyncio
import random

import pytest

from splitserve.control.mix import InstanceView, MixController, MixTargets
from splitserve.control.mix_loop import MixLoop
from splitserve.control.stepmodel import StepModel

MODEL = StepModel(overhead_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.005, per_decode_kv_token_s=1e-5)
TARGETS = MixTargets(ttft_s=2.0, gap_s=0.5)


def controller(**kw) -> MixController:
    return MixController(MODEL, TARGETS, **kw)


def idle_prefill(i):
    return InstanceView(f"p{i}", "prefill")


def busy_decode(i):  # 60 streams at 1k context: 0.01 + 0.3 + 0.6 = 0.91 s a step, 1.8x the gap target
    return InstanceView(f"d{i}", "decode", num_running=60, decode_kv_tokens=60_000)


def test_no_change_within_targets_and_the_reason_says_so():
    d = controller().decide([InstanceView("p0", "prefill", queued_prompt_tokens=100),
                             InstanceView("d0", "decode", num_running=4, decode_kv_tokens=400)])
    assert d.instance_id is None
    assert "within the hysteresis band" in d.reason and "TTFT estimate" in d.reason


def test_decode_pressure_moves_one_prefill_instance_only_after_patience_then_cools_down():
    ctl = controller(patience=2, cooldown=2)
    views = [idle_prefill(0), idle_prefill(1), busy_decode(0), busy_decode(1)]
    first = ctl.decide(views, 0.0)
    assert first.instance_id is None and "decode pressure for 1 of 2 intervals" in first.reason
    second = ctl.decide(views, 1.0)
    assert (second.instance_id, second.from_role, second.to_role) == ("p0", "prefill", "decode")
    assert "becomes decode" in second.reason and "inter-token estimate" in second.reason
    third = ctl.decide(views, 2.0)
    assert third.instance_id is None and "cooldown" in third.reason


def test_prefill_pressure_moves_the_least_busy_decode_instance():
    ctl = controller(patience=1)
    views = [InstanceView("p0", "prefill", queued_prompt_tokens=8000),
             InstanceView("d0", "decode", num_running=3, decode_kv_tokens=300),
             InstanceView("d1", "decode", num_running=1, decode_kv_tokens=100)]
    d = ctl.decide(views)
    assert (d.instance_id, d.to_role) == ("d1", "prefill")
    assert "prefill is short" in d.reason


def test_the_last_prefill_instance_becomes_colocated_never_decode():
    d = controller(patience=1).decide([idle_prefill(0), busy_decode(0)])
    assert (d.instance_id, d.from_role, d.to_role) == ("p0", "prefill", "colocated")


def test_both_stages_over_target_changes_nothing():
    ctl = controller(patience=1)
    d = ctl.decide([InstanceView("p0", "prefill", queued_prompt_tokens=8000), busy_decode(0)])
    assert d.instance_id is None and "both stages over target" in d.reason


def test_a_lost_decode_stage_is_rescued_at_once_by_a_survivor_turning_colocated():
    ctl = controller(patience=3, cooldown=5)
    views = [idle_prefill(0), InstanceView("p1", "prefill", queued_prompt_tokens=50),
             InstanceView("d0", "decode", alive=False)]
    d = ctl.decide(views)
    assert (d.instance_id, d.to_role) == ("p0", "colocated")
    assert "no live instance can decode" in d.reason


def test_random_views_never_lead_to_a_decision_that_uncovers_a_stage():
    rng = random.Random(7)
    ctl = controller(patience=1, cooldown=0)
    for _ in range(500):
        views = [InstanceView(f"i{k}", rng.choice(["prefill", "decode", "colocated"]), alive=rng.random() > 0.2,
                              queued_prompt_tokens=rng.choice([0, 100, 5000, 20000]),
                              num_running=(n := rng.choice([0, 2, 30, 80])), decode_kv_tokens=n * 800)
                 for k in range(rng.randint(1, 5))]
        d = ctl.decide(views)
        assert d.reason
        if d.instance_id is not None and MixController.covered(views):
            assert MixController.covered(views, (d.instance_id, d.to_role)), (views, d)


def test_measured_step_times_correct_the_model():
    slow = [InstanceView("p0", "prefill"), InstanceView("d0", "decode", num_running=10, decode_kv_tokens=1000,
                                                       recent_step_s=0.3)]
    ttft, gap = controller().estimates(slow)
    assert gap == pytest.approx(MODEL.step_s(0, 0, 10, 1000) * 3.0)  # 0.3 / 0.07 clamps at 3x


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="low < high"):
        controller(low=1.5, high=1.0)
    with pytest.raises(ValueError, match="role"):
        InstanceView("x", "both")


def test_loop_applies_changes_logs_every_decision_and_survives_a_failed_change():
    views = [idle_prefill(0), idle_prefill(1), busy_decode(0)]
    calls = []

    async def change_role(instance_id, role):
        calls.append((instance_id, role))
        if len(calls) == 1:
            raise RuntimeError("409: draining")

    async def go():
        loop = MixLoop(controller(patience=1, cooldown=0), lambda: views, change_role, interval_s=0.01, max_log=3)
        for _ in range(4):
            await loop.run_once()
        return loop

    loop = asyncio.run(go())
    assert calls == [("p0", "decode")] * 4
    assert loop.num_failed_changes == 1 and loop.num_role_changes == 3
    assert len(loop.decisions) == 3  # bounded
    assert all(d["applied"] for d in loop.changes())
    assert loop.decisions[-1]["reason"].endswith("becomes decode")


def test_loop_runs_on_its_interval_until_stopped():
    async def go():
        loop = MixLoop(controller(), lambda: [idle_prefill(0), busy_decode(0)], lambda *_: asyncio.sleep(0),
                       interval_s=0.01)
        task = asyncio.create_task(loop.run())
        await asyncio.sleep(0.1)
        loop.stop()
        await asyncio.wait_for(task, 1.0)
        return loop

    assert len(asyncio.run(go()).decisions) >= 2
