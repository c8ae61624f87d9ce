"""The engine benchmark's arithmetic and its splitserve driver, on a tiny model.

The benchmark itself is slow and lives in bench/; these check that what it reports
means what docs/benchmarks.md says it means.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import engine_report  # noqa: E402
from flops import ModelShape  # noqa: E402
from records import DecodeResult, PrefillResult, StepTimer, as_row, quiet  # noqa: E402
from splitserve.config import ModelConfig  # noqa: E402

from tiny_models import write_tiny_checkpoint  # noqa: E402

SMOLLM2_135M = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, tie_word_embeddings=True)


def test_weight_bytes_count_every_matrix_of_smollm2_once():
    shape = ModelShape.from_config(SMOLLM2_135M)
    hf_param_count = 134_515_008  # transformers' count for the bundled model, norms included
    norm_params = (2 * 30 + 1) * 576
    assert shape.weight_bytes() == 4 * (hf_param_count - norm_params)


def test_attention_flops_count_only_the_causal_scores():
    shape = ModelShape.from_config(SMOLLM2_135M)
    past, new = 10, 7
    scores = sum(past + i + 1 for i in range(new))
    assert shape.attention_flops(new, past) == 30 * 4 * 9 * 64 * scores


def test_quiet_time_is_cpu_time_at_one_thread_and_wall_time_above():
    assert quiet(wall_s=3.0, cpu_s=1.0, threads=1) == 1.0
    assert quiet(wall_s=3.0, cpu_s=5.0, threads=2) == 3.0
    row = as_row(DecodeResult("hf", 1, 8, 256, 6, best_step_s=0.4, median_step_s=0.5,
                              best_step_cpu_s=0.2))
    assert row["tokens_per_s"] == pytest.approx(20.0) and row["quiet_tokens_per_s"] == pytest.approx(40.0)


def test_step_timer_keeps_the_fastest_step():
    timer = StepTimer()
    for _ in range(3):
        with timer:
            pass
    assert timer.best <= timer.median and timer.best_cpu >= 0.0 and len(timer.cpu_times) == 3


def _report(ours_b32_step: float, ours_b1_step: float, prefill_s: float) -> dict:
    hardware = {
        "matmul": [{"threads": 1, "m": m, "k": k, "n": n, "seconds": 1.0,
                    "cpu_seconds": 2.0 * m * k * n / 100e9}
                   for m, k, n in [(2048, 576, 1536), (2048, 1536, 576), (2048, 576, 576)]],
        "bandwidth": [{"threads": 1, "kind": "read", "gb_per_s": 1.0, "quiet_gb_per_s": 10.0}],
    }
    rows = [as_row(PrefillResult("splitserve", 1, 2048, 99.0, prefill_s, 1)),
            as_row(DecodeResult("splitserve", 1, 1, 256, 6, 9.0, 9.0, ours_b1_step)),
            as_row(DecodeResult("splitserve", 1, 32, 256, 6, 9.0, 9.0, ours_b32_step)),
            as_row(DecodeResult("hf", 1, 32, 256, 6, 9.0, 9.0, 0.3))]
    return {"rows": rows, "hardware": hardware}


def test_targets_judge_on_quiet_figures_against_the_measured_limits():
    shape = ModelShape.from_config(SMOLLM2_135M)
    bound_s = shape.weight_bytes() / 10e9
    fast_prefill_s = shape.prefill_flops(2048) / (0.9 * 100e9)  # 90% of the 100 GFLOP/s ceiling
    report = _report(ours_b32_step=0.09, ours_b1_step=1.2 * bound_s, prefill_s=fast_prefill_s)
    verdicts = {t["target"]: t for t in engine_report.targets(report, shape)}
    assert verdicts["prefill_vs_matmul"]["value"] == pytest.approx(0.9, abs=1e-3)
    assert verdicts["prefill_vs_matmul"]["met"]
    assert verdicts["decode_b1_vs_memory"]["met"]
    assert verdicts["decode_b32_vs_hf"]["value"] == pytest.approx(0.3 / 0.09, abs=1e-3)
    assert verdicts["decode_b32_vs_hf"]["met"]

    slow = _report(ours_b32_step=0.2, ours_b1_step=1.4 * bound_s, prefill_s=2 * fast_prefill_s)
    assert not any(t["met"] for t in engine_report.targets(slow, shape))


def test_engine_bench_prefills_in_one_step_and_decodes_every_batch_size(tmp_path):
    from splitserve_runs import build_engine, engine_decode, engine_prefill

    torch.set_num_threads(1)
    model = write_tiny_checkpoint(tmp_path / "tiny")
    engine = build_engine(max_prompt_tokens=64, max_batch=4, kv_cache_memory="8MiB", model=str(model))
    generator = torch.Generator().manual_seed(0)
    prefill = engine_prefill(engine, 48, threads=1, repeats=2, generator=generator)
    assert prefill.num_tokens == 48 and prefill.seconds > 0
    decode = engine_decode(engine, [1, 4, 2], prompt_len=16, num_steps=2, threads_list=[1],
                           generator=generator)
    assert [r.batch_size for r in decode] == [4, 2, 1]
    assert [r.context_len for r in decode] == [18, 21, 24]  # prompt, warm-up, then the mid step
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks_total
