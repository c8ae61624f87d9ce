"""Tool calls through the HTTP API with the openai SDK's own tool-calling loop (a request, the tool's
result, the final answer), streaming and not, on a tiny Qwen2 model whose chat template renders tools
(the Hermes form); and every malformed tools request is a 400 with OpenAI's error body. The bundled
SmolLM2 (a template without tools: the fallback prompt) is the real-model test. (A forced call across
a prefill and a decode instance: tests/test_structured_output.py; one more server start here cost
45 s on the shared box.)"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from serve_disagg_support import DisaggServer
from serve_support import ServerProcess
from tiny_models import QWEN_TOOLS_TEMPLATE, write_tiny_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "what is the weather in Rome?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tools") / "tiny", arch="qwen2",
                                 chat_template=QWEN_TOOLS_TEMPLATE, max_position_embeddings=2048)
    srv = DisaggServer(str(path), "--instances", "1", log_path=tmp_path_factory.mktemp("log") / "serve.log")
    yield srv.wait_ready()
    assert srv.stop() == 0, srv.log()


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, tools=(WEATHER,)) -> None:
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])


def streamed(chunks) -> tuple[str, list[dict], str, list[dict]]:
    """Accumulates a stream as the SDK's users do -> (content, calls, finish_reason, raw tool deltas)."""
    content, calls, finish, raw = "", [], None, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            raw.append(d.model_dump(exclude_none=True))
            if d.id is not None:
                calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments})
            else:
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish, raw


def test_the_sdk_tool_loop_with_a_required_call_stream_and_not(server):
    client = sdk(server)
    model = client.models.list().data[0].id
    ask = dict(model=model, tools=[WEATHER, TIME], tool_choice="required", max_tokens=400, temperature=1.0, seed=0)
    first = client.chat.completions.create(messages=QUESTION, **ask)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, (WEATHER, TIME))

    content, calls, finish, raw = streamed(client.chat.completions.create(messages=QUESTION, stream=True, **ask))
    assert finish == "tool_calls" and content == ""
    # the same seed gives the same calls (ids are fresh per answer)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    firsts = [d for d in raw if "id" in d]
    assert all(d["type"] == "function" and d["function"]["arguments"] == "" and d["function"]["name"] for d in firsts)
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in raw if "id" not in d)

    # the loop: the assistant's message as the SDK returned it, each call's result, the final answer
    messages = QUESTION + [choice.message] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny, 24 C"} for c in choice.message.tool_calls]
    rendered = httpx.post(server.base_url + "/v1/chat/completions/render", json={
        "messages": json.loads(json.dumps([m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                                           for m in messages])), "tools": [WEATHER, TIME]}).json()["prompt"]
    assert rendered.count("<tool_response>\nsunny, 24 C\n</tool_response>") == len(choice.message.tool_calls)
    assert f'<tool_call>\n{{"name": "{choice.message.tool_calls[0].function.name}"' in rendered
    final = client.chat.completions.create(messages=messages, model=model, tools=[WEATHER, TIME], max_tokens=6,
                                           extra_body={"ignore_eos": True})
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.content
    text, calls, finish, _ = streamed(client.chat.completions.create(
        messages=messages, model=model, tools=[WEATHER, TIME], max_tokens=6, stream=True,
        extra_body={"ignore_eos": True}))
    assert finish == "length" and text


def test_a_named_function_is_called_exactly_once(server):
    client = sdk(server)
    for seed in range(3):
        answer = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=QUESTION, tools=[WEATHER, TIME], seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=400)
        calls = answer.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        check_calls(calls)


def test_tool_choice_none_answers_in_text_without_tools_in_the_prompt(server):
    client = sdk(server)
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION,
                                            tools=[WEATHER], tool_choice="none", max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
    rendered = httpx.post(server.base_url + "/v1/chat/completions/render",
                          json={"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"}).json()["prompt"]
    assert "get_weather" not in rendered
    auto = httpx.post(server.base_url + "/v1/chat/completions/render",
                      json={"messages": QUESTION, "tools": [WEATHER]}).json()["prompt"]
    assert json.dumps(WEATHER) in auto


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
    ({"messages": QUESTION + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                              {"role": "tool", "content": "sunny"}]}, "messages[2].tool_call_id"),
    ({"messages": QUESTION + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     "messages[1].tool_call_id"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "get_weather", "arguments": "not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400_with_an_openai_error(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": QUESTION, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


@pytest.mark.real_model
@pytest.mark.timeout(600)
def test_the_bundled_model_calls_a_required_tool_through_the_fallback_prompt(tmp_path):
    server = ServerProcess(None, "--kv-cache-memory", "256MiB", log_path=tmp_path / "serve.log").wait_ready()
    try:
        client = sdk(server)
        model = client.models.list().data[0].id
        # one call: with parallel calls allowed this 135M model repeats its call until max_tokens
        ask = dict(model=model, messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=60,
                   temperature=0, parallel_tool_calls=False)
        choice = client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
        _, calls, finish, _ = streamed(client.chat.completions.create(**ask, stream=True))
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        messages = QUESTION + [choice.message] + [
            {"role": "tool", "tool_call_id": c.id, "content": "sunny, 24 C"} for c in choice.message.tool_calls]
        final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=40,
                                               temperature=0)
        assert final.choices[0].message.content
        print("bundled model:", choice.message.tool_calls, "->", final.choices[0].message.content)
    finally:
        assert server.stop() == 0, server.log()
