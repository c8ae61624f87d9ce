"""Block accounting: whatever happens to requests, every block comes back."""
from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import BlockManager, chain_hash
from splitserve.engine.request import Request
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("blocks") / "m", arch="llama")


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_prefix_blocks_are_shared_only_after_they_are_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(10)))
    bm.allocate(a, a.num_tokens)
    b = _request("b", list(range(10)))
    assert bm.can_allocate(b, b.num_tokens)
    bm.allocate(b, b.num_tokens)
    assert b.num_cached_tokens == 0  # a's blocks are allocated but not yet computed
    bm.free(b)
    a.num_computed_tokens = 10
    bm.publish_computed(a)
    c = _request("c", list(range(10)))
    bm.allocate(c, c.num_tokens)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]
    bm.free(a)
    bm.free(c)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.publish_computed(a)
    b = _request("b", list(range(8)))
    bm.allocate(b, 8)
    assert b.num_cached_tokens == 4  # the second block holds the last token: recomputed
    bm.free(a)
    bm.free(b)


def test_freed_cached_blocks_are_reused_in_lru_order_and_evicted_when_overwritten():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.publish_computed(a)
    bm.free(a)
    assert len(bm.hash_to_block) == 2
    # A stranger takes all blocks: the cached ones are overwritten and leave the index.
    s = _request("s", [9] * 8)
    bm.allocate(s, 8)
    assert bm.hash_to_block == {}
    bm.free(s)
    assert bm.num_free_blocks == 4


def test_mixed_completed_aborted_and_preempted_requests_free_every_block(tiny):
    # A cache of 24 blocks of 16 tokens cannot hold 12 requests of ~70 tokens: preemption.
    engine = make_engine(tiny, kv=24 * 16 * TOKEN_BYTES, budget=48, max_num_seqs=12)
    stats = engine.stats()
    assert stats.num_blocks_total == 24
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(12):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 40),
                                                           temperature=0, ignore_eos=True))
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if step in (3, 9, 20):  # abort while prefilling, decoding and after preemptions
            alive = sorted(engine.requests)
            if alive:
                assert engine.abort_request(rng.choice(alive))
    assert engine.stats().num_preemptions > 0
    assert len(finished) + 3 == 12 and set(finished.values()) == {"length"}
    assert engine.stats().num_free_blocks == 24
    assert not engine.abort_request("r0")  # unknown or finished: nothing to free


def test_preempted_requests_still_produce_the_greedy_answer(tiny):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9] * 8 for i in range(6)]
    roomy = make_engine(tiny, kv="4MiB")
    tight = make_engine(tiny, kv=12 * 16 * TOKEN_BYTES, budget=32)
    for engine in (roomy, tight):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
    expected, got = run_to_end(roomy), run_to_end(tight)
    assert tight.stats().num_preemptions > 0
    assert got == expected


def test_prefix_cache_hash_has_no_buildable_collisions():
    # Python's hash() of an int is the value mod 2**61 - 1, so these two blocks collided and a
    # tenant could poison another's cache; a cryptographic digest over the exact ids cannot.
    mod = 2**61 - 1
    assert chain_hash(None, [1, 2]) != chain_hash(None, [1 + mod, 2])
    assert chain_hash(chain_hash(None, [5]), [7]) != chain_hash(chain_hash(None, [5 + mod]), [7])
    assert chain_hash(None, [1, 2]) == chain_hash(None, (1, 2))  # still deterministic
