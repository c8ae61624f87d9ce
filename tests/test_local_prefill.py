"""A decode-role engine given a prompt without a KV handover prefills it itself (conditional
disaggregation): the same greedy tokens as colocated, in chunks no larger than its local-prefill
budget that share every step with its running streams, served by its prefix cache, and an abort
during that prefill frees every block."""
from __future__ import annotations

import random

import pytest

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.kv_transfer import KVTransferConfig
from splitserve.models.loader import load_model
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint

CHUNK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("local") / "m", arch="qwen2")


def decode_engine(tiny, chunk: int | None = CHUNK) -> EngineCore:
    config = EngineConfig(model=str(tiny), cache=CacheConfig(block_size=16, kv_cache_memory="2MiB"),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64), role="decode",
                          kv_transfer=KVTransferConfig(transport="tcp"), instance_id="d-local",
                          local_prefill_chunk_tokens=chunk)
    return EngineCore(config, load_model(str(tiny)))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def requests(seed: int = 0):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(3, 700) for _ in range(rng.choice([3, 17, 40, 90, 150]))],
             greedy(rng.randrange(1, 12))) for i in range(10)]


def assert_all_free(engine: EngineCore) -> None:
    s = engine.stats()
    assert s.num_free_blocks == s.num_blocks_total, s


def test_decode_instance_prefills_prompts_itself_with_colocated_greedy_tokens(tiny):
    colocated, decode = make_engine(tiny), decode_engine(tiny)
    for engine in (colocated, decode):
        for rid, prompt, params in requests():
            engine.add_request(rid, prompt, params)
    expected = run_to_end(colocated)
    assert run_to_end(decode) == expected
    assert_all_free(decode)
    decode.close()


def test_local_prefill_chunks_stay_within_budget_and_share_steps_with_streams(tiny):
    engine = decode_engine(tiny)
    engine.add_request("stream", [5, 6, 7], greedy(40))
    for _ in range(3):
        engine.step()  # the stream is decoding now
    engine.stats()  # drop the samples so far
    engine.add_request("doc", list(range(10, 130)), greedy(2))  # 120 tokens: 8 chunks of 16
    shapes = []
    while "doc" in engine.requests and engine.requests["doc"].num_output_tokens == 0:
        engine.step()
        shapes += engine.stats().step_samples
    prefill_steps = [s for s in shapes if s.prefill_tokens]
    assert sum(s.prefill_tokens for s in prefill_steps) == 120
    assert max(s.prefill_tokens for s in prefill_steps) <= CHUNK
    assert all(s.decode_seqs == 1 for s in prefill_steps), "the stream must get its token every step"
    run_to_end(engine)
    assert_all_free(engine)
    engine.close()


def test_without_a_budget_a_decode_instance_takes_the_step_budget(tiny):
    engine = decode_engine(tiny, chunk=None)
    engine.add_request("doc", list(range(10, 130)), greedy(1))
    engine.step()
    assert engine.stats().step_samples[0].prefill_tokens == 64  # max_num_batched_tokens alone bounds it
    run_to_end(engine)
    engine.close()


def test_local_prefill_on_a_decode_instance_uses_its_prefix_cache(tiny):
    engine = decode_engine(tiny)
    doc = list(range(100, 180))  # 80 tokens: 5 full blocks
    engine.add_request("first", doc, greedy(2))
    first = run_to_end(engine)
    engine.add_request("second", doc + [7, 8, 9], greedy(2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[0].num_cached_tokens == 80
    reference = make_engine(tiny)
    reference.add_request("second", doc + [7, 8, 9], greedy(2))
    assert [t for o in outputs for t in o.new_token_ids] == run_to_end(reference)["second"]
    assert first["first"]
    engine.close()


def test_abort_during_a_local_prefill_frees_every_block(tiny):
    engine = decode_engine(tiny)
    engine.add_request("stream", [5, 6, 7], greedy(30))
    engine.add_request("doc", list(range(10, 170)), greedy(5))
    for _ in range(3):
        engine.step()
    doc = engine.requests["doc"]
    assert 0 < doc.num_computed_tokens < doc.num_prompt_tokens and doc.block_table, "still prefilling"
    assert engine.abort_request("doc")
    run_to_end(engine)
    assert_all_free(engine)
    engine.close()


def test_a_chunk_budget_set_live_caps_every_step_beside_streams_and_outlives_a_role_change(tiny):
    config = EngineConfig(model=str(tiny), cache=CacheConfig(block_size=16, kv_cache_memory="2MiB"),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64), role="colocated",
                          kv_transfer=KVTransferConfig(transport="tcp"), instance_id="c-knob")
    engine = EngineCore(config, load_model(str(tiny)))
    engine.add_request("stream", [5, 6, 7], greedy(60))
    for _ in range(3):
        engine.step()
    engine.set_chunk_tokens(CHUNK)  # the mix controller's knob (SetChunkTokens)
    engine.stats()
    engine.add_request("doc", list(range(10, 130)), greedy(2))
    shapes = []
    while engine.requests["doc"].num_output_tokens == 0:
        engine.step()
        shapes += engine.stats().step_samples
    assert max(s.prefill_tokens for s in shapes) == CHUNK  # 64 before the knob moved
    engine.change_role("decode")
    assert engine.try_swap_role() and engine.connector.chunk_tokens == CHUNK
    engine.set_chunk_tokens(None)  # each role's own again: this config gives a decode instance none
    assert engine.connector.chunk_tokens is None
    with pytest.raises(ValueError, match="positive"):
        engine.set_chunk_tokens(0)
    run_to_end(engine)
    assert_all_free(engine)
    engine.close()


def test_a_prefill_role_keeps_its_own_budget_beside_carried_streams_whatever_the_knob(tiny):
    """The knob (set for the decode and colocated instances' pauses) does not reach a prefill
    role: beside the streams it carried over, its prompts step at its own carry budget, the one
    the mix controller judged the move with; as a decode instance again it takes the knob back."""
    carry = 48
    config = EngineConfig(model=str(tiny), cache=CacheConfig(block_size=16, kv_cache_memory="2MiB"),
                          scheduler=SchedulerConfig(max_num_batched_tokens=128), role="colocated",
                          kv_transfer=KVTransferConfig(transport="tcp"), instance_id="c-carry",
                          local_prefill_chunk_tokens=carry)
    engine = EngineCore(config, load_model(str(tiny)))
    engine.set_chunk_tokens(CHUNK)
    engine.add_request("stream", [5, 6, 7], greedy(200))
    for _ in range(3):
        engine.step()
    engine.change_role("prefill")
    assert engine.try_swap_role()   # the colocated connector had nothing in flight: the stream stays
    assert engine.connector.chunk_tokens == carry and engine.chunk_tokens == CHUNK
    engine.stats()
    engine.add_request("doc", list(range(10, 170)), greedy(1))
    shapes = []
    while "doc" in engine.requests and engine.requests["doc"].num_computed_tokens < 160:
        engine.step()
        shapes += engine.stats().step_samples
    beside = [s.prefill_tokens for s in shapes if s.prefill_tokens and s.decode_seqs]
    assert beside and max(beside) == carry, shapes   # not the knob's 16
    engine.change_role("decode")
    run_to_end(engine)
    assert engine.try_swap_role() and engine.connector.chunk_tokens == CHUNK
    assert_all_free(engine)
    engine.close()
