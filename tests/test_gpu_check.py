"""The device check (bench/gpu/check.py) in its CPU mode: the same script a lent GPU machine runs,
on the suite's tiny model at small sizes, so it cannot rot between lent machines. Takes 1-3
minutes (three `splitserve serve` starts dominate it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "check.py"), "--device", "cpu", "--quick",
                           "--out", str(out / "out"), "--work", str(out / "work")],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "out" / "check.json").read_text()), (out / "out" / "summary.txt").read_text()


def test_the_check_runs_every_section_without_an_error(results):
    r, summary = results
    assert r["errors"] == {}
    assert r["mode"] == "quick" and r["system"]["device"] == "cpu"
    assert set(r["seconds"]) == {"checkpoints", "greedy", "steps", "stall", "handover"}
    for section in ("greedy", "steps", "stall", "handover"):
        assert section in summary


def test_fp32_greedy_tokens_equal_transformers_for_eight_prompt_lengths_and_bf16_is_reported(results):
    greedy = results[0]["greedy"]["tiny-qwen2"]
    fp32, bf16 = greedy["float32"], greedy["bfloat16"]
    lengths = [p["prompt_tokens"] for p in fp32["prompts"]]
    assert len(lengths) == 8 and min(lengths) == 5 and max(lengths) >= 256  # chunked prefill over cached blocks
    assert fp32["all_equal"] and all(p["leading_equal"] == fp32["num_tokens"] for p in fp32["prompts"])
    assert len(bf16["prompts"]) == 8
    assert all(0 <= p["leading_equal"] <= bf16["num_tokens"] for p in bf16["prompts"])


def test_step_times_of_both_sides_cover_every_batch_and_prefill(results):
    r = results[0]
    steps = r["steps"]["tiny-qwen2"]
    for side in ("engine", "transformers"):
        assert set(steps[side]["decode_step_s"]) == {str(b) for b in r["sizes"]["batches"]}
        assert set(steps[side]["prefill_step_s"]) == {str(t) for t in r["sizes"]["prefills"]}
        assert all(v > 0 for kind in steps[side].values() for v in kind.values())


def test_the_stall_has_a_longest_pause_per_stream_for_each_arrangement(results):
    r = results[0]
    assert set(r["stall"]) == {"colocated-whole", "colocated-chunked", "1P1D"}
    for run in r["stall"].values():
        assert len(run["longest_pause_per_stream_s"]) == r["sizes"]["streams"]
        assert all(p > 0 for p in run["longest_pause_per_stream_s"])
        assert run["no_load_step_s"] > 0 and run["long_ttft_s"] > 0


def test_the_handover_moved_the_whole_prompts_kv_and_is_set_beside_a_copy(results):
    r = results[0]
    h = r["handover"]
    assert h["transport"] == "tcp"
    [checkpoint] = r["checkpoints"]
    c = json.loads((Path(checkpoint["path"]) / "config.json").read_text())
    # k and v of every layer and kv head, fp32; the long prompt (a multiple of the block size) fills whole blocks
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 4
    assert r["sizes"]["long_tokens"] % 16 == 0
    assert h["lone_kv_transfer"]["bytes"] == r["sizes"]["long_tokens"] * per_token
    assert h["lone_kv_transfer"]["gbps"] > 0 and h["kv_transfer"]["gbps"] > 0
    assert h["copy_same_bytes"]["host_to_host_pageable_gbps"] > 0
