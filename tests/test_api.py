"""The OpenAI-compatible API, driven by the official `openai` client against a real server.

One `splitserve serve` (frontend + one engine process, tiny random-weight model) per module.
The engine admits 4 requests and queues none, so the fifth concurrent one must get a 429.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from serve_support import ServerProcess, all_blocks_free, metric_samples, process_alive, wait_until
from tiny_models import write_tiny_checkpoint

MAX_NUM_SEQS = 4
CHAT = [{"role": "user", "content": "hello world, what is the answer?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    srv = ServerProcess(str(model), "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", "0",
                        "--kv-cache-memory", "8MiB", log_path=root / "server.log").wait_ready()
    yield srv
    pids = [i["pid"] for i in srv.health()["instances"]]
    assert srv.stop() == 0, srv.log()  # SIGTERM: a clean stop of the frontend and its engine
    assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=10), "engine outlived serve"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def greedy_chat(client, model, **kw):
    args = dict(model=model, messages=CHAT, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    args.update(kw)
    return client.chat.completions.create(**args)


def collect_stream(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_and_health(server, client, model):
    assert [m.id for m in client.models.list().data] == [model]
    health = server.health()
    assert health["status"] == "ok" and health["instances_alive"] == 1


def test_chat_answer_has_exact_length_and_usage(server, client, model):
    answer = greedy_chat(client, model, max_tokens=12)
    prompt_tokens = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT}).json()["count"]
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 12
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.total_tokens == prompt_tokens + 12


def test_chat_stream_equals_non_stream_and_reports_usage_last(client, model):
    full = greedy_chat(client, model)
    text, chunks = collect_stream(greedy_chat(client, model, stream=True, stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_stream_non_stream_and_token_prompt_agree(server, client, model):
    args = dict(model=model, prompt="the answer is", temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "the answer is"}).json()["tokens"]
    assert client.completions.create(**{**args, "prompt": ids}).choices[0].text == full.choices[0].text
    assert full.usage.completion_tokens == 16 and full.usage.prompt_tokens == len(ids)


def test_return_token_ids_names_every_token_in_both_modes(server, client, model):
    """vLLM's return_token_ids: the streamed ids are the non-streamed ones, every step gets a chunk
    (text held back by the detokenizer or not), and their text is the answer's text."""
    args = dict(model=model, prompt="the answer is", temperature=0, max_tokens=20,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.completions.create(**args)
    ids = full.choices[0].model_extra["token_ids"]
    assert len(ids) == 20
    chunks = list(client.completions.create(**args, stream=True))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
    assert len(chunks) == 20  # one per engine step of one token
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    detok = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert detok == full.choices[0].text
    chat = list(greedy_chat(client, model, max_tokens=20, stream=True,
                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    streamed = [t for c in chat for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert len(streamed) == 20
    assert "token_ids" not in client.completions.create(**{**args, "extra_body": {"ignore_eos": True}}
                                                        ).choices[0].model_extra


def test_stop_string_trims_the_answer_in_both_modes(client, model):
    text = greedy_chat(client, model, max_tokens=40).choices[0].message.content
    start = next(i for i in range(len(text) // 3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    expected = text[:text.find(stop)]
    answer = greedy_chat(client, model, max_tokens=40, stop=[stop, "never-there"])
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < 40  # the engine stopped early, not at max_tokens
    streamed, chunks = collect_stream(greedy_chat(client, model, max_tokens=40, stop=stop, stream=True))
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client, model):
    def sample(seed):
        return greedy_chat(client, model, temperature=1.0, max_tokens=16, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_max_completion_tokens_and_min_tokens(client, model):
    answer = greedy_chat(client, model, max_tokens=None, max_completion_tokens=5)
    assert answer.usage.completion_tokens == 5
    answer = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                            extra_body={"min_tokens": 6})
    assert answer.usage.completion_tokens == 6


def test_x_request_id_is_honoured_and_echoed(client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=CHAT, max_tokens=2, extra_headers={"X-Request-Id": "my-req-42"})
    assert raw.headers["x-request-id"] == "my-req-42"
    assert raw.parse().id == "chatcmpl-my-req-42"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("change,param", [
    ({"n": 2}, "n"),
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hello " * 600}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}, *CHAT]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages[0].name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice.function.name"),
])
def test_bad_values_are_400_through_the_openai_client(client, model, change, param):
    args = {"model": model, "messages": CHAT, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"]
    assert set(info.value.body) == {"message", "type", "param", "code"}


def test_message_shapes_developer_name_and_text_parts_are_served(client, model):
    plain = greedy_chat(client, model, messages=[{"role": "system", "content": "Be brief."}, *CHAT])
    shaped = greedy_chat(client, model, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {**CHAT[0], "name": "ann"}])
    # ChatML ignores name and lacks developer: the same prompt, so the same greedy answer
    assert shaped.usage.prompt_tokens == plain.usage.prompt_tokens
    assert shaped.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("body", [
    b"{not json", b"", b"[]", b'"a string"', b'{"messages": "hi"}', b'{"max_tokens": 3}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "seed": 1e400}',
    b'{"messages": [{"role": "user", "content": {"a": 1}}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}',
    b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}",
    "{\"messages\": [{\"role\": \"user\", \"content\": \"\\udcff\"}]}".encode(),
])
def test_malformed_bodies_are_400_with_an_openai_error(server, body):
    r = httpx.post(server.base_url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_completion_prompt_checks(server):
    url = server.base_url + "/v1/completions"
    for body, param in [({"prompt": [10**9]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": ""}, "prompt"), ({"prompt": "x", "logprobs": True}, "logprobs")]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_full_queue_is_429_with_retry_after(server, client, model):
    # Four 400-token streams fill every slot (no queue). The tiny model can finish a stream within
    # a second, so on a loaded box one may end before the fifth request arrives, and then the fifth
    # is rightly admitted: such an attempt is tried again. A server that never refuses fails.
    for _attempt in range(5):
        streams = [greedy_chat(client, model, max_tokens=400, stream=True) for _ in range(MAX_NUM_SEQS)]
        try:
            for s in streams:
                next(iter(s))
            try:
                greedy_chat(client, model, max_tokens=2)
            except openai.RateLimitError as e:
                assert int(e.response.headers["retry-after"]) >= 1
                break
        finally:
            for s in streams:
                s.close()  # disconnecting aborts them in the engine
    else:
        pytest.fail("a fifth request was admitted in five attempts while four streams held every slot")
    assert wait_until(lambda: all_blocks_free(server.base_url))
    assert greedy_chat(client, model, max_tokens=2).usage.completion_tokens == 2


def test_tokenize_detokenize_and_render(server):
    base = server.base_url
    tokens = httpx.post(base + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert httpx.post(base + "/detokenize", json={"tokens": tokens}).json()["prompt"] == "hello world"
    rendered = httpx.post(base + "/v1/chat/completions/render", json={"messages": CHAT}).json()
    by_tokenize = httpx.post(base + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert rendered["prompt_token_ids"] == by_tokenize
    assert rendered["prompt"].endswith("<|im_start|>assistant\n")
    assert httpx.post(base + "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.post(base + "/tokenize", json={}).status_code == 400


def test_metrics_count_outcomes_and_latencies(server, client, model):
    greedy_chat(client, model, max_tokens=3)
    outcomes = metric_samples(server.base_url, "splitserve_requests_total")
    assert outcomes['{outcome="length"}'] >= 1
    assert metric_samples(server.base_url, "splitserve_time_to_first_token_seconds_count")[""] >= 1
    assert metric_samples(server.base_url, "splitserve_inter_token_gap_seconds_count")[""] >= 1
    assert wait_until(lambda: all_blocks_free(server.base_url))
    text = httpx.get(server.base_url + "/metrics").text
    assert 'splitserve_instance_prefix_cache_hit_rate{instance="engine-0",role="colocated"}' in text


def test_unknown_route_is_a_json_404(server):
    r = httpx.get(server.base_url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert json.loads(httpx.post(server.base_url + "/v1/models").text)["error"]["message"]
