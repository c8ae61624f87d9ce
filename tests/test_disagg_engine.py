"""Prefill and decode on separate engines: the same greedy tokens as colocated serving, over
shm and tcp; transfer failures follow the policy; aborts at every stage free every block."""
from __future__ import annotations

import random

import pytest

from splitserve.kv_transfer import KVTransferConfig
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_disaggregated, run_to_end
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("disagg") / "m", arch="qwen2")


def mixed_requests(n: int, seed: int = 0, vocab: int = 700):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 40, 90, 150]))]
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0,
                                                    ignore_eos=True)))
    return out


def pair(tiny, transport, policy="recompute", **kv):
    config = KVTransferConfig(transport=transport, **kv)
    prefill = make_engine(tiny, role="prefill", kv_transfer=config, instance_id=f"p-{transport}")
    decode = make_engine(tiny, role="decode", kv_transfer=config, instance_id=f"d-{transport}",
                         failure_policy=policy)
    return prefill, decode


def assert_all_free(*engines):
    for engine in engines:
        s = engine.stats()
        assert s.num_free_blocks == s.num_blocks_total, (s.role, s)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_disaggregated_greedy_tokens_equal_colocated(tiny, transport):
    requests = mixed_requests(16)
    colocated = make_engine(tiny)
    for rid, prompt, params in requests:
        colocated.add_request(rid, prompt, params)
    expected = run_to_end(colocated)
    prefill, decode = pair(tiny, transport)
    try:
        got = run_disaggregated(prefill, decode, requests)
        assert {rid: r[0] for rid, r in got.items()} == expected
        moved = [r[3] for r in got.values() if r[3] is not None]
        assert len(moved) == sum(1 for _, _, p in requests if p.max_tokens > 1)
        assert all(rec.outcome.value == "done" and rec.num_bytes > 0 for rec in moved)
        assert_all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_injected_transfer_failures_follow_the_policy(tiny, policy):
    requests = [(rid, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                for rid, prompt, _ in mixed_requests(20, seed=1)]
    colocated = make_engine(tiny)
    for rid, prompt, params in requests:
        colocated.add_request(rid, prompt, params)
    expected = run_to_end(colocated)
    prefill, decode = pair(tiny, "tcp", policy=policy, fault_rate=0.2, seed=3)
    try:
        got = run_disaggregated(prefill, decode, requests)
        failed = {rid for rid, r in got.items() if r[3] is not None and r[3].outcome.value == "failed"}
        outcomes = {rid: r[4] for rid, r in got.items()}
        assert 1 <= len(failed) <= 10  # ~20% of 20, seeded
        assert decode.stats().kv.num_failed == len(failed)
        for rid, (tokens, reason, error, record, _) in got.items():
            if rid in failed and policy == "fail":
                assert reason == "error" and "KV transfer" in error and tokens == expected[rid][:1]
                assert outcomes[rid] == "failed"  # decided by the decode connector, reported as is
            elif rid in failed:
                assert outcomes[rid] == "recomputed"
            else:
                assert (tokens, reason) == (expected[rid], "length")
        assert_all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_aborts_at_every_stage_free_every_block_on_both_sides(tiny):
    rng = random.Random(7)
    requests = mixed_requests(300, seed=2)  # the 300, aborted while queued, prefilling,
    prefill, decode = pair(tiny, "shm", delay_ms=5)  # held for handover, transferring, decoding
    aborted = set()

    def abort_some(step):
        for engine in (prefill, decode):
            live = sorted(set(engine.requests) | set(getattr(engine.connector, "held", {}))
                          | set(getattr(engine.connector, "waiting", {})))
            for rid in live:
                if rng.random() < 0.08:
                    prefill.abort_request(rid)
                    decode.abort_request(rid)
                    aborted.add(rid)

    try:
        got = run_disaggregated(prefill, decode, requests, on_step=abort_some)
        assert len(aborted) >= 50
        finished = {rid for rid, r in got.items() if r[1] in ("length", "stop")}
        assert finished | aborted >= {rid for rid, _, _ in requests}
        assert_all_free(prefill, decode)
        assert not prefill.connector.held and not decode.connector.waiting
    finally:
        prefill.close()
        decode.close()


def test_a_handover_reaching_an_instance_that_just_became_colocated_is_recomputed_there(tiny):
    """The frontend hands a stream over before it hears that the decode instance swapped its
    connector: the request is prefilled there (prompt + first token) instead of rejected."""
    requests = mixed_requests(4, seed=3)
    colocated = make_engine(tiny)
    for rid, prompt, params in requests:
        colocated.add_request(rid, prompt, params)
    expected = run_to_end(colocated)
    prefill, decode = pair(tiny, "shm")
    try:
        decode.change_role("colocated")
        assert decode.try_swap_role() and decode.role == "colocated"
        got = run_disaggregated(prefill, decode, requests)
        assert {rid: r[0] for rid, r in got.items()} == expected
        assert all(r[2] is None for r in got.values())
    finally:
        prefill.close()
        decode.close()
