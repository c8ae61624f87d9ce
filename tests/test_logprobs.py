"""Logprobs come from the engine's logits and equal transformers' log-softmax on the same
weights, colocated and split (the prefill instance reports the first token's)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_support import make_engine, run_disaggregated
from splitserve.sampling import SamplingParams
from tiny_models import write_tiny_checkpoint

TOP = 5
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("lp") / "m", arch="qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, hf


def hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: the log-softmax that chose each token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1]


def check_against_hf(hf, prompt, outputs):
    entries = [lp for out in outputs for lp in (out.logprobs or [])]
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert [e.token_id for e in entries] == tokens and len(tokens) == NEW_TOKENS
    expected = hf_logprobs(hf, prompt, tokens)
    for row, e in zip(expected, entries):
        assert abs(e.logprob - float(row[e.token_id])) < 1e-4
        top = row.topk(TOP)
        assert e.top_token_ids == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(e.top_logprobs, top.values.tolist())) < 1e-4


PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 23, 140, 6]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_colocated_logprobs_equal_transformers(checkpoint, temperature):
    path, hf = checkpoint
    engine = make_engine(path, budget=8)  # chunked prefill: the last chunk's logits are the ones used
    collected = []
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, seed=3,
                                                   ignore_eos=True, logprobs=TOP))
    engine.add_request("plain", PROMPT[:5], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    while engine.has_unfinished_requests():
        collected += engine.step()
    check_against_hf(hf, PROMPT, [o for o in collected if o.request_id == "r"])
    assert all(o.logprobs is None for o in collected if o.request_id == "plain")  # only who asks pays


def test_split_logprobs_equal_transformers(checkpoint):
    path, hf = checkpoint
    prefill = make_engine(path, role="prefill", instance_id="p")
    decode = make_engine(path, role="decode", instance_id="d")
    outputs = []
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
        run_disaggregated(prefill, decode, [("r", PROMPT, params)], outputs=outputs)
    finally:
        prefill.close()
        decode.close()
    assert outputs[0].finish_reason == "prefill_done" and outputs[0].logprobs  # the first token's
    check_against_hf(hf, PROMPT, outputs)


def test_logprobs_zero_gives_the_chosen_token_only(checkpoint):
    path, _ = checkpoint
    engine = make_engine(path)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert all(len(o.logprobs) == 1 and o.logprobs[0].top_token_ids == [] for o in outs)
