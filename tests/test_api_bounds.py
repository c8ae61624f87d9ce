"""Every number a client may send is bounded by what the wire (msgspec, int64/uint64) and the
engine accept: a value the schema lets through always encodes and builds SamplingParams, and
a value past a bound is a 400 that names the field (never a 500 from deep in the stack)."""
from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from splitserve.api.openai_schema import ChatCompletionRequest, CompletionRequest, numeric_bounds
from splitserve.protocol import Codec, GenerateRequest, WireSamplingParams
from splitserve.sampling import SamplingParams

MSG = [{"role": "user", "content": "x"}]


def generate_request_for(body) -> bytes:
    """What serving does with an accepted body, down to the wire bytes."""
    max_tokens = body.answer_limit() or 1
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, seed=body.seed, min_tokens=min(body.min_tokens, max_tokens),
                            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos)
    wire = WireSamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, seed=params.seed, min_tokens=params.min_tokens,
                              stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos)
    return Codec().encode(GenerateRequest("r", [1], wire))


@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_every_numeric_field_has_both_bounds(schema):
    bounds = numeric_bounds(schema)
    for name in ("max_tokens", "top_k", "seed", "min_tokens", "n", "temperature", "top_p", "top_logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert name in bounds, name
        low, high = bounds[name]
        assert low is not None and high is not None, name


@pytest.mark.parametrize("schema,base", [(ChatCompletionRequest, {"messages": MSG}),
                                         (CompletionRequest, {"prompt": "x"})])
def test_the_extreme_values_the_schema_accepts_reach_the_wire(schema, base):
    for name, (low, high) in numeric_bounds(schema).items():
        for value in (low, high):
            body = schema.model_validate({**base, name: value})
            if name in ("n", "top_logprobs"):
                continue  # refused later with their own message, never sent
            generate_request_for(body)  # must not raise (msgspec overflow was a 500)


@pytest.mark.parametrize("schema,base", [(ChatCompletionRequest, {"messages": MSG}),
                                         (CompletionRequest, {"prompt": "x"})])
def test_a_value_past_either_bound_names_its_field(schema, base):
    for name, (low, high) in numeric_bounds(schema).items():
        step = 1 if isinstance(high, int) else 1e-3
        for value in (low - step, high + step):
            with pytest.raises(ValidationError) as info:
                schema.model_validate({**base, name: value})
            assert info.value.errors()[0]["loc"][0] == name


def test_top_k_of_ten_to_the_thirty_is_refused_before_the_wire():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MSG, "top_k": 10**30})
    with pytest.raises(OverflowError):  # what used to happen after the router took a slot
        msgspec.msgpack.encode(WireSamplingParams(max_tokens=1, top_k=10**30))


@pytest.mark.parametrize("field", ["stop_token_ids"])
def test_stop_token_ids_are_bounded_in_count_and_value(field):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MSG, field: [2**63]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MSG, field: list(range(1000))})


@pytest.mark.parametrize("schema,base", [(ChatCompletionRequest, {"messages": MSG}),
                                         (CompletionRequest, {"prompt": "x"})])
def test_the_extreme_values_the_schema_accepts_can_be_sampled(schema, base):
    # found by bench/fuzz.py: top_p=5e-324 passed every check, became 0 in float32 and the
    # sampler's multinomial raised, killing the engine
    import torch
    from types import SimpleNamespace

    from splitserve.engine.sampler import sample

    logits = torch.randn(2, 50)
    for name in ("temperature", "top_p", "top_k", "seed", "min_tokens"):
        low, high = numeric_bounds(schema)[name]
        for value in (low, high):
            body = schema.model_validate({**base, name: value, "max_tokens": 5})
            params = SamplingParams(max_tokens=5, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    seed=body.seed, min_tokens=min(body.min_tokens, 5))
            request = SimpleNamespace(params=params, generator=None, num_output_tokens=0, eos_token_ids=(1,))
            assert all(0 <= t < 50 for t in sample(logits, [request, request], torch.Generator()))
