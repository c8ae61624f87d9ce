"""The short-prompt lane under a chunk budget narrower than a chat: a chat arriving behind a
document's 32-token chunks is prefilled in the lane over a few steps, ahead of the document's
remaining chunks, instead of waiting for the whole document (session 30's demand_rotation: the
knob at 32 tokens, a 1,396-token summary in front, chats of 40-120 tokens waited 4-8 s); the
document keeps what the chat leaves, and every greedy token is what the requests give alone."""
from __future__ import annotations

import pytest

from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lane") / "m", arch="llama")


def steps_to_first_token(engine, rid: str, tokens: dict, limit: int = 200) -> int:
    for n in range(1, limit + 1):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if tokens.get(rid):
            return n
    raise AssertionError(f"{rid} got no token in {limit} steps")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_chat_wider_than_the_knob_is_prefilled_ahead_of_a_documents_chunks(tiny, policy):
    document = [(7 * i) % 500 + 3 for i in range(480)]
    chat = [(11 * i) % 400 + 5 for i in range(70)]  # short (<= 128 of 256), wider than 32
    engine = make_engine(tiny, budget=256, kv="4MiB", scheduling_policy=policy)
    engine.set_chunk_tokens(32)  # the mix controller's knob: 32 prompt tokens a step
    tokens: dict[str, list[int]] = {}
    engine.add_request("document", document, PARAMS)
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    done_before = engine.requests["document"].num_computed_tokens
    assert done_before == 3 * 32  # premise: the knob holds the document to 32 tokens a step
    engine.add_request("chat", chat, PARAMS)
    n = steps_to_first_token(engine, "chat", tokens)
    # 70 tokens at 32 a step: 3 steps, not the document's remaining 384 tokens (12 steps) first
    assert n == 3, n
    assert not tokens.get("document")  # the document is still being prefilled
    for rid, new in run_to_end(engine).items():
        tokens.setdefault(rid, []).extend(new)
    alone = {}
    for rid, prompt in (("document", document), ("chat", chat)):
        ref = make_engine(tiny, budget=256, kv="4MiB")
        ref.add_request(rid, prompt, PARAMS)
        alone.update(run_to_end(ref))
    assert tokens == alone


def test_a_lane_prompt_finishes_before_the_next_chat_takes_the_lane_and_whole_fits_still_jump(tiny):
    document = [(7 * i) % 500 + 3 for i in range(480)]
    chats = {"chat-a": [(3 * i) % 300 + 9 for i in range(50)], "chat-b": [(5 * i) % 300 + 9 for i in range(50)],
             "tiny": [17, 18, 19, 20, 21, 22, 23, 24]}
    engine = make_engine(tiny, budget=256, kv="4MiB")
    engine.set_chunk_tokens(32)
    engine.add_request("document", document, PARAMS)
    engine.step()
    for rid, prompt in chats.items():
        engine.add_request(rid, prompt, PARAMS)
    first_token_step, tokens = {}, {}
    for n in range(1, 40):
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first_token_step:
                first_token_step[out.request_id] = n
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if len(first_token_step) == 4:
            break
    # chat-a takes the lane first (50 tokens: 2 steps), then chat-b (2 steps); the 8-token chat fits
    # the lane whole beside chat-a's remaining 18 tokens and jumps at once; the document comes last
    assert first_token_step["tiny"] <= 2 and first_token_step["chat-a"] == 2
    assert first_token_step["chat-b"] <= 4 and first_token_step["document"] > first_token_step["chat-b"]
    assert engine.scheduler._lane == set()  # no lane prompt is left behind
