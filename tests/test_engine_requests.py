"""Request validation and sampling behaviour of the engine core."""
from __future__ import annotations

import pytest

from splitserve.config import CacheConfig, SchedulerConfig, parse_size
from splitserve.control.stepmodel import prefill_attn_ktok2
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(write_tiny_checkpoint(tmp_path_factory.mktemp("req") / "m"), kv="128KiB")  # 16 blocks of 16 tokens


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -1.0), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("seed", "7"), ("min_tokens", 99),
    ("stop_token_ids", [-1]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value, "max_tokens": 16} if field != "max_tokens" else {field: value})


def test_settings_validate_and_sizes_parse():
    assert parse_size("1GiB") == 1 << 30 and parse_size("512MB") == 512_000_000 and parse_size(4096) == 4096
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="prefill_policy"):
        SchedulerConfig(prefill_policy="eager")
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=12)


def test_bad_requests_are_refused_before_scheduling_and_leave_blocks_alone(engine):
    total = engine.stats().num_blocks_total
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], ok)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [1, 10**9], ok)
    with pytest.raises(ValueError, match="maximum context length is 512"):
        engine.add_request("c", [5] * 510, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="whole cache"):  # 308 tokens > 16 blocks of 16
        engine.add_request("d", [5] * 300, SamplingParams(max_tokens=8))
    with pytest.raises(TypeError):
        engine.add_request("e", [5], {"max_tokens": 3})
    engine.add_request("f", [5, 6], ok)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("f", [5, 6], ok)
    assert not engine.has_unfinished_requests() or sorted(engine.requests) == ["f"]
    run_to_end(engine)
    assert engine.stats().num_free_blocks == total


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine.add_request("alone", [5, 6, 7], params)
    alone = run_to_end(engine)["alone"]
    for i in range(5):
        engine.add_request(f"noise{i}", [9, 10 + i], SamplingParams(max_tokens=12, temperature=1.0))
    engine.add_request("crowded", [5, 6, 7], params)
    assert run_to_end(engine)["crowded"] == alone


def test_top_k_one_is_greedy_and_min_tokens_hold_back_stops(engine):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("g", [5, 6, 7], greedy)
    first = run_to_end(engine)["g"]
    engine.add_request("k1", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.7, top_k=1, ignore_eos=True))
    assert run_to_end(engine)["k1"] == first
    # The greedy answer's first token as a stop token ends the request at once...
    engine.add_request("stop", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first[0]]))
    out = run_to_end(engine)["stop"]
    assert out == first[:1]
    # ...unless min_tokens forbids stopping that early.
    engine.add_request("min", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0, min_tokens=3,
                                                        stop_token_ids=[first[0]]))
    out = run_to_end(engine)["min"]
    assert len(out) >= 3 and first[0] not in out[:2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("short-first") / "m")


def test_a_short_prompt_does_not_wait_behind_a_long_prompts_chunks(tiny):
    """Chunked prefill, budget 64: a 300-token prompt needs 5 steps. A 10-token prompt that
    arrives after its first chunk is prefilled whole in the next step (first token out), and the
    long prompt still gets the rest of that step's budget."""
    engine = make_engine(tiny, policy="chunked", budget=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("long", [5 + i % 50 for i in range(300)], params)
    engine.step()
    long = engine.requests["long"]
    assert long.num_computed_tokens == 64
    engine.add_request("short", list(range(20, 30)), params)
    outputs = {out.request_id for out in engine.step()}
    assert "short" in outputs  # its first token, one step after it arrived
    assert long.num_computed_tokens == 64 + 54
    # a prompt longer than half the budget waits its turn behind the long one, as before
    engine.add_request("medium", list(range(40, 80)), params)
    engine.step()
    assert engine.requests["medium"].num_computed_tokens == 0
    run_to_end(engine)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks_total


def test_stats_carry_each_model_steps_shape_and_seconds_once_and_only_the_newest_64(tiny):
    """What the mix controller fits its step model on (control/online_stepmodel.py): per step, the
    prompt tokens and the attention of each chunk at its offset, the decodes and their contexts."""
    engine = make_engine(tiny, policy="chunked", budget=64, prefix=False)
    assert engine.stats().step_samples == []
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", [5 + i % 50 for i in range(100)], params)
    engine.step()  # the first chunk: 64 tokens at offset 0
    engine.step()  # the rest, 36 at offset 64: a's first token
    engine.add_request("b", list(range(20, 40)), SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    engine.step()  # a decodes at position 100 (101 tokens of context) beside b's whole prompt
    engine.step()  # a at 101 and b at 20 decode
    samples = engine.stats().step_samples
    assert [(s.prefill_tokens, s.prefill_attn_ktok2, s.decode_seqs, s.decode_kv_tokens) for s in samples] == [
        (64, prefill_attn_ktok2(0, 64), 0, 0), (36, prefill_attn_ktok2(64, 36), 0, 0),
        (20, prefill_attn_ktok2(0, 20), 1, 101), (0, 0.0, 2, 102 + 21)]
    assert all(s.seconds > 0 for s in samples)
    assert engine.stats().step_samples == []  # each sample goes out once
    run_to_end(engine)  # b's 78 more decode steps: only the newest 64 are kept
    samples = engine.stats().step_samples
    assert len(samples) == 64 and samples[-1].decode_kv_tokens == 20 + 80 - 1
    assert [s.decode_kv_tokens for s in samples] == list(range(20 + 80 - 64, 20 + 80))
