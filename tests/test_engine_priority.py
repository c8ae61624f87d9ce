"""--scheduling-policy priority: lower `priority` is admitted first, and under memory pressure the
lowest priority is preempted first; a preempted request still gives its greedy answer."""
from __future__ import annotations

import pytest

from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("priority") / "m", arch="llama")


def first_token_order(engine, late=None) -> list[str]:
    """Request ids in the order their first token came out; `late` = (step, id, prompt, priority)."""
    order = []
    for step in range(10_000):
        if late is not None and step == late[0]:
            engine.add_request(late[1], late[2], GREEDY, priority=late[3])
        if not engine.has_unfinished_requests():
            return order
        for out in engine.step():
            if out.new_token_ids and out.request_id not in order:
                order.append(out.request_id)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("policy,expected", [("priority", ["c", "a", "d", "late", "b"]),
                                             ("fcfs", ["a", "b", "c", "d", "late"])])
def test_waiting_prompts_are_admitted_by_priority_then_arrival(tiny, policy, expected):
    engine = make_engine(tiny, max_num_seqs=1, scheduling_policy=policy)
    for rid, prio in (("a", 0), ("b", 5), ("c", -1), ("d", 0)):
        engine.add_request(rid, [5, 6, 7, 8], GREEDY, priority=prio)
    # arrives while c runs: under priority it overtakes b (5) but not a or d (0, earlier)
    assert first_token_order(engine, late=(2, "late", [9, 10, 11], 1)) == expected


def test_the_lowest_priority_is_preempted_first_and_resumes_with_the_same_greedy_tokens(tiny):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": [5 + i, 6, 7, 8, 9] * 8 for i in range(6)}
    # two interactive requests (0) fit the cache together (2 x 5 blocks of 12); the batch class (3) competes
    priorities = {"r0": 3, "r1": 0, "r2": 3, "r3": 0, "r4": 3, "r5": 3}
    roomy = make_engine(tiny, kv="4MiB")
    tight = make_engine(tiny, kv=12 * 16 * TOKEN_BYTES, budget=32, scheduling_policy="priority")
    for engine in (roomy, tight):
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params, priority=priorities[rid])
    requests = dict(tight.requests)
    expected, got = run_to_end(roomy), run_to_end(tight)
    assert tight.stats().num_preemptions > 0
    preempted = {rid for rid, r in requests.items() if r.num_preemptions}
    assert preempted and all(priorities[rid] == 3 for rid in preempted)
    assert got == expected
    assert tight.stats().num_free_blocks == 12


def test_a_priority_outside_the_bounds_is_refused(tiny):
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("x", [5, 6], GREEDY, priority=2**40)
