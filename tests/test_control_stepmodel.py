"""The step-time model: it recovers known coefficients from noisy synthetic steps, and
extrapolates thread counts with Amdahl's law."""
from __future__ import annotations

import numpy as np
import pytest

from splitserve.control.stepmodel import (StepModel, StepModels, StepShape, amdahl, fit_step_model,
                                          prefill_attn_ktok2, serial_fraction)

TRUE = StepModel(overhead_s=0.04, per_prefill_token_s=0.0025, per_prefill_attn_s=0.001,
                 per_decode_seq_s=0.005, per_decode_kv_token_s=1.5e-5)


def synthetic(noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = [StepShape(n, prefill_attn_ktok2(start, n)) for n in (32, 128, 512, 1024) for start in (0, 512)]
    shapes += [StepShape(0, 0.0, b, b * ctx) for b in (1, 4, 16) for ctx in (64, 512, 1024)]
    shapes += [StepShape(n, prefill_attn_ktok2(0, n), 8, 8 * 256) for n in (128, 512)]
    seconds = [TRUE.predict(s) * (1 + rng.normal(0, noise)) for s in shapes]
    return shapes, seconds


def test_fit_recovers_the_coefficients_of_noiseless_steps_exactly():
    report = fit_step_model(*synthetic(0.0))
    for name in ("overhead_s", "per_prefill_token_s", "per_prefill_attn_s", "per_decode_seq_s",
                 "per_decode_kv_token_s"):
        assert getattr(report.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert report.max_abs_rel_error < 1e-9


def test_fit_on_noisy_steps_predicts_within_a_few_percent():
    shapes, seconds = synthetic(0.03, seed=3)
    report = fit_step_model(shapes, seconds)
    assert report.median_abs_rel_error < 0.05
    assert report.model.prefill_s(1024) == pytest.approx(TRUE.prefill_s(1024), rel=0.08)
    assert report.model.decode_step_s(16, 16 * 512) == pytest.approx(TRUE.decode_step_s(16, 16 * 512), rel=0.08)


def test_fit_never_returns_a_negative_coefficient():
    # decode steps only: prefill columns are all zero and must come out 0, not negative noise
    shapes = [StepShape(0, 0.0, b, b * 100) for b in (1, 2, 4, 8)]
    report = fit_step_model(shapes, [0.01 + 0.002 * b for b in (1, 2, 4, 8)])
    assert all(v >= 0 for v in report.model.to_dict().values())


def test_chunked_prefill_costs_more_steps_of_overhead_than_whole():
    assert TRUE.prefill_s(1024, chunk_budget=256) == pytest.approx(TRUE.prefill_s(1024) + 3 * TRUE.overhead_s)


def test_serial_fraction_is_recovered_from_two_thread_counts():
    s1 = 1.0
    s2 = s1 * amdahl(2, 0.3) / amdahl(1, 0.3)
    assert serial_fraction(1, s1, 2, s2) == pytest.approx(0.3)


def test_unprofiled_thread_counts_are_extrapolated_from_the_nearest_profiled_below():
    models = StepModels({1: TRUE, 2: TRUE.scaled(amdahl(2, 0.25))})
    assert models.serial_fraction == pytest.approx(0.25)
    eight = models.for_threads(8)
    assert eight.overhead_s == pytest.approx(TRUE.overhead_s * amdahl(8, 0.25))
    assert models.for_threads(2) is models.by_threads[2]


def test_a_negative_coefficient_is_refused_naming_it():
    with pytest.raises(ValueError, match="per_decode_seq_s"):
        StepModel(0.01, 0.001, per_decode_seq_s=-1.0)


def test_a_step_of_more_rows_than_one_kernel_tile_pays_the_panel_cost_once():
    # the GGUF kernels dequantize every weight into panels once per step of more than 8 rows
    model = StepModel(0.01, 0.001, per_decode_seq_s=0.002, per_panel_step_s=0.05)
    assert model.step_s(decode_seqs=8) == pytest.approx(0.01 + 8 * 0.002)
    assert model.step_s(decode_seqs=9) == pytest.approx(0.01 + 9 * 0.002 + 0.05)
    assert model.step_s(prefill_tokens=8) == pytest.approx(0.01 + 0.008)
    assert model.step_s(prefill_tokens=4, decode_seqs=5) == pytest.approx(0.01 + 0.004 + 0.010 + 0.05)
    assert model.prefill_s(64, chunk_budget=32) == pytest.approx(2 * (0.01 + 0.032 + 0.05))


def test_fit_separates_the_panel_cost_from_the_cost_per_token():
    true = StepModel(**{**TRUE.to_dict(), "per_panel_step_s": 0.05})
    shapes, _ = synthetic(0.0)
    report = fit_step_model(shapes, [true.predict(s) for s in shapes])
    assert report.model.per_panel_step_s == pytest.approx(0.05, rel=1e-6)
    assert report.model.per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=1e-6)


def test_a_step_with_prompt_tokens_pays_the_prompt_step_cost_once_beside_its_decodes():
    model = StepModel(0.01, 0.001, per_decode_seq_s=0.002, per_panel_step_s=0.05, per_prompt_step_s=0.02)
    assert model.step_s(decode_seqs=16) == pytest.approx(0.01 + 16 * 0.002 + 0.05)   # no prompt: no prompt cost
    assert model.step_s(prefill_tokens=4) == pytest.approx(0.01 + 0.004 + 0.02)
    assert model.step_s(prefill_tokens=32, decode_seqs=8) == pytest.approx(0.01 + 0.032 + 0.016 + 0.05 + 0.02)
    assert model.prefill_s(64, chunk_budget=32) == pytest.approx(2 * (0.01 + 0.032 + 0.05 + 0.02))


def test_fit_tells_the_prompt_step_cost_from_the_panel_and_the_overhead():
    """A decode-only step of more than 8 rows pays the panel and no prompt cost, a decode step of
    8 or fewer pays neither: the profile's grid holds both, so the fit puts each fixed cost where it
    belongs (on the AMX Xeon the panel term alone read a 32-token
    prompt beside 8 decodes 24-29% short, since it charged the 16-decode steps the prompt's cost)."""
    true = StepModel(**{**TRUE.to_dict(), "per_panel_step_s": 0.007, "per_prompt_step_s": 0.025})
    shapes, _ = synthetic(0.0)
    report = fit_step_model(shapes, [true.predict(s) for s in shapes])
    assert report.model.per_prompt_step_s == pytest.approx(0.025, rel=1e-6)
    assert report.model.per_panel_step_s == pytest.approx(0.007, rel=1e-6)
    assert report.model.overhead_s == pytest.approx(TRUE.overhead_s, rel=1e-6)
