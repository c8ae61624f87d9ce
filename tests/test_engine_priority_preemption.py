"""--scheduling-policy priority: a waiting urgent request that finds no batch slot, no KV blocks or
no token budget takes them from running requests of a lower priority (the lowest, then the newest,
is preempted and recomputed later with the same greedy tokens); fcfs never preempts to admit."""
from __future__ import annotations

import time

import pytest

from splitserve.kv_transfer import KVTransferConfig
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32
BLOCK_BYTES = 16 * TOKEN_BYTES
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("preempt") / "m", arch="llama")


def reference(tiny, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy tokens of every request run side by side, none ever preempted."""
    engine = make_engine(tiny, kv="4MiB")
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS)
    return run_to_end(engine)


def collect(engine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def held_blocks(engine) -> int:
    return sum(len(r.block_table) for r in engine.scheduler.running)


def run_low_then_urgent(engine, prompts, priorities, steps_before: int) -> tuple[dict, bool]:
    """Starts every request but 'urgent', runs `steps_before` steps, adds 'urgent' and runs one step:
    (tokens so far, whether 'urgent' got its first token in that step)."""
    tokens: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        if rid != "urgent":
            engine.add_request(rid, prompt, PARAMS, priority=priorities[rid])
    for _ in range(steps_before):
        collect(engine, tokens)
    engine.add_request("urgent", prompts["urgent"], PARAMS, priority=priorities["urgent"])
    collect(engine, tokens)
    return tokens, "urgent" in tokens


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_an_urgent_request_takes_the_batch_slot_of_the_lowest_priority_one(tiny, policy):
    prompts = {"low5": [5, 6, 7, 8] * 5, "low3": [9, 10, 11] * 6, "urgent": [12, 13, 14, 15] * 4}
    priorities = {"low5": 5, "low3": 3, "urgent": 0}
    engine = make_engine(tiny, max_num_seqs=2, scheduling_policy=policy)
    tokens, urgent_started = run_low_then_urgent(engine, prompts, priorities, steps_before=3)
    victim, other = engine.requests["low5"], engine.requests["low3"]
    if policy == "fcfs":
        assert not urgent_started and engine.stats().num_preemptions == 0
    else:
        assert urgent_started
        assert (victim.num_preemptions, other.num_preemptions) == (1, 0)
        assert victim.block_table == [] and victim not in engine.scheduler.running
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks - held_blocks(engine)
    for rid, new in run_to_end(engine).items():
        tokens.setdefault(rid, []).extend(new)
    assert tokens == reference(tiny, prompts)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks_total


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_an_urgent_request_takes_the_kv_blocks_of_a_lower_priority_one(tiny, policy):
    # 8 blocks of 16 tokens: the document (100 + 12 tokens, 7 blocks) and the chat (40, 3) do not fit together
    prompts = {"document": [(7 * i) % 500 + 3 for i in range(100)], "urgent": [20, 21, 22, 23] * 10}
    priorities = {"document": 1, "urgent": 0}
    engine = make_engine(tiny, kv=8 * BLOCK_BYTES, scheduling_policy=policy)
    tokens, urgent_started = run_low_then_urgent(engine, prompts, priorities, steps_before=4)
    document = engine.requests["document"]
    assert tokens["document"], "the document was decoding when the chat came"
    if policy == "fcfs":
        assert not urgent_started and document.num_preemptions == 0
    else:
        assert urgent_started and document.num_preemptions == 1 and document.block_table == []
    for rid, new in run_to_end(engine).items():
        tokens.setdefault(rid, []).extend(new)
    assert tokens == reference(tiny, prompts)
    assert engine.stats().num_free_blocks == 8


@pytest.mark.parametrize("policy,first", [("priority", "urgent"), ("fcfs", "document")])
def test_a_document_being_chunk_prefilled_yields_the_token_budget_to_an_urgent_prompt(tiny, policy, first):
    # 24 tokens: more than half the step's budget of 32, so the chat cannot jump the queue as a short prompt
    prompts = {"document": [(11 * i) % 500 + 3 for i in range(200)], "urgent": [30, 31, 32] * 8}
    priorities = {"document": 2, "urgent": 0}
    engine = make_engine(tiny, budget=32, scheduling_policy=policy)
    tokens, urgent_started = run_low_then_urgent(engine, prompts, priorities, steps_before=2)
    assert urgent_started == (policy == "priority")
    document = engine.requests["document"]
    # the budget is shared, not handed over: the document kept prefilling in that step
    assert document.num_computed_tokens == 32 * 2 + (32 - 24 if policy == "priority" else 32)
    order = list(tokens)
    for rid, new in run_to_end(engine).items():
        if rid not in order:
            order.append(rid)
        tokens.setdefault(rid, []).extend(new)
    assert order[0] == first
    assert engine.stats().num_preemptions == 0  # the budget is taken by ordering, not by eviction
    assert tokens == reference(tiny, prompts)


def step_until(engine, tokens, done, limit_s: float = 20.0) -> list:
    """Steps until done(); returns the outputs seen (KV moves on puller threads: wait a little)."""
    outputs, deadline = [], time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "engine made no progress"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            outputs.append(out)
        time.sleep(0.001)
    return outputs


def test_kv_arriving_for_an_urgent_request_preempts_a_lower_priority_decode(tiny):
    """Split serving: the decode instance has room for one of the two, and takes it for the urgent one."""
    prompts = {"document": [(13 * i) % 500 + 3 for i in range(100)], "urgent": [40, 41, 42, 43] * 10}
    priorities = {"document": 1, "urgent": 0}
    config = KVTransferConfig(transport="tcp")
    prefill = make_engine(tiny, role="prefill", kv_transfer=config, instance_id="p-prio",
                          scheduling_policy="priority")
    decode = make_engine(tiny, role="decode", kv_transfer=config, instance_id="d-prio", kv=8 * BLOCK_BYTES,
                         scheduling_policy="priority")
    tokens: dict[str, list[int]] = {}
    try:
        for rid in ("document", "urgent"):
            prefill.add_request(rid, prompts[rid], PARAMS, priority=priorities[rid])
            out = next(o for o in step_until(prefill, tokens, lambda: rid in tokens) if o.request_id == rid)
            decode.add_request(rid, prompts[rid], PARAMS, kv_descriptor=out.kv_descriptor,
                               first_token_ids=out.new_token_ids, priority=priorities[rid])
            if rid == "document":
                step_until(decode, tokens, lambda: len(tokens["document"]) >= 4)
        document = decode.requests["document"]
        step_until(decode, tokens, lambda: len(tokens["urgent"]) >= 2)
        assert document.num_preemptions == 1, "the document kept its blocks: the urgent chat waited"
        step_until(decode, tokens, lambda: not decode.has_unfinished_requests())
        assert tokens == reference(tiny, prompts)
        assert decode.stats().num_free_blocks == 8
    finally:
        prefill.close()
        decode.close()
