"""Structured output: the engine masks every token with the request's grammar, so answers are
valid JSON under the schema, colocated and split (the decode instance continues the grammar)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from engine_support import make_engine, run_disaggregated, run_to_end
from splitserve.sampling import SamplingParams
from tiny_models import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from schemas import schemas  # noqa: E402

SCHEMAS = schemas(5, seed=1)
PROMPT = [5, 17, 99, 3, 250, 41, 8]
MAX_TOKENS = 400  # the tiny vocabulary spells most things a character at a time


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("so") / "m", arch="qwen2")


def params(schema: dict, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, json_schema=json.dumps(schema))


def check_valid(tokenizer, schema, tokens):
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


def test_colocated_answers_are_valid_under_their_schemas(checkpoint):
    engine = make_engine(checkpoint)
    for i, schema in enumerate(SCHEMAS):
        engine.add_request(str(i), PROMPT, params(schema, i))
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True))
    got = run_to_end(engine)
    for i, schema in enumerate(SCHEMAS):
        assert len(got[str(i)]) < MAX_TOKENS, "the grammar should end the answer (EOS) well before the limit"
        check_valid(engine.tokenizer, schema, got[str(i)])
    assert len(got["free"]) == 8  # a free request in the same batch is untouched


def test_split_answers_are_valid_and_the_decode_instance_continues_the_grammar(checkpoint):
    prefill = make_engine(checkpoint, role="prefill", instance_id="p")
    decode = make_engine(checkpoint, role="decode", instance_id="d")
    try:
        results = run_disaggregated(prefill, decode, [(str(i), PROMPT, params(s, i)) for i, s in enumerate(SCHEMAS)])
    finally:
        prefill.close()
        decode.close()
    for i, schema in enumerate(SCHEMAS):
        tokens, reason, error = results[str(i)][:3]
        assert error is None and reason == "stop", (reason, error)
        check_valid(prefill.tokenizer, schema, tokens)


def test_a_resumed_request_continues_its_grammar(checkpoint):
    engine = make_engine(checkpoint)
    schema = SCHEMAS[0]
    engine.add_request("a", PROMPT, params(schema, 7))
    full = run_to_end(engine)["a"]
    # as the dispatcher resumes it elsewhere: prompt + the tokens so far, answer_prefix_len of them
    k = len(full) // 2
    p = params(schema, 7)
    p.answer_prefix_len = k
    engine.add_request("b", PROMPT + full[:k], p)
    rest = run_to_end(engine)["b"]
    check_valid(engine.tokenizer, schema, full[:k] + rest)


def test_tokens_that_break_the_grammar_or_a_bad_schema_are_refused(checkpoint):
    engine = make_engine(checkpoint)
    bad = params(SCHEMAS[0], 0)
    bad.answer_prefix_len = 1
    not_json = engine.tokenizer.encode("x", add_special_tokens=False)  # an answer must start with "{"
    with pytest.raises(ValueError, match="does not fit"):
        engine.add_request("x", PROMPT + not_json, bad)
    with pytest.raises(ValueError, match="JSON schema"):
        engine.add_request("y", PROMPT, SamplingParams(max_tokens=4, json_schema='{"type": "nonsense"}'))
    assert not engine.requests


def test_a_forced_tool_call_grammar_is_continued_by_the_decode_instance(checkpoint):
    from splitserve.api.tool_parsers import HermesToolParser

    function = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}
    grammar = HermesToolParser.forced_grammar([function], parallel=False).serialize_json()
    prefill = make_engine(checkpoint, role="prefill", instance_id="p")
    decode = make_engine(checkpoint, role="decode", instance_id="d")
    requests = [(str(i), PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=grammar))
                for i in range(3)]
    try:
        results = run_disaggregated(prefill, decode, requests)
    finally:
        prefill.close()
        decode.close()
    for i in range(3):
        tokens, reason, error = results[str(i)][:3]
        assert error is None and reason == "stop", (reason, error)
        content, calls = HermesToolParser().parse(prefill.tokenizer.decode(tokens, skip_special_tokens=True))
        assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), function["parameters"])
