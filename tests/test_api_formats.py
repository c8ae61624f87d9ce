"""The application formats through the HTTP API with the openai client: logprobs (chat and
completions, stream and not, colocated and split) equal transformers' log-softmax, echo, and
structured output (response_format) valid under its schema."""
from __future__ import annotations

import math

import json
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serve_disagg_support import DisaggServer
from tiny_models import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from schemas import schemas  # noqa: E402

ARRANGEMENTS = {"colocated": ("--instances", "1"),
                "split": ("--prefill", "1", "--decode", "1", "--kv-transport", "shm")}
MAX_TOKENS = 6
TOP = 3
CHAT = [{"role": "user", "content": "hello world, what is the answer?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("formats") / "tiny", arch="qwen2")
    return path, AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """Lazily started servers by arrangement, all stopped at the end of the module."""
    root = tmp_path_factory.mktemp("log")
    started: dict[str, DisaggServer] = {}

    def get(name: str) -> DisaggServer:
        if name not in started:
            started[name] = DisaggServer(str(checkpoint[0]), *ARRANGEMENTS[name],
                                         log_path=root / f"{name}.log").wait_ready()
        return started[name]

    yield get
    for name, srv in started.items():
        assert srv.stop() == 0, f"{name}: {srv.log()}"


@pytest.fixture(params=list(ARRANGEMENTS))
def server(request, servers) -> DisaggServer:
    return servers(request.param)


@pytest.fixture
def colocated(servers) -> DisaggServer:
    return servers("colocated")


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def hf_rows(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1]


def chat_prompt_ids(server) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT})
    return r.json()["tokens"]


def check_chat_content(hf, prompt, token_ids, content):
    assert len(content) == len(token_ids) == MAX_TOKENS
    for row, token, entry in zip(hf_rows(hf, prompt, token_ids), token_ids, content):
        assert abs(entry.logprob - float(row[token])) < 1e-4
        assert [round(t.logprob, 4) for t in entry.top_logprobs] == [round(v, 4) for v in row.topk(TOP).values.tolist()]
        assert entry.bytes == list(entry.token.encode())


def test_chat_logprobs_equal_transformers_stream_and_not(server, checkpoint):
    hf, client = checkpoint[1], openai_client(server)
    args = dict(model=client.models.list().data[0].id, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                logprobs=True, top_logprobs=TOP, extra_body={"ignore_eos": True, "return_token_ids": True})
    answer = client.chat.completions.create(**args)
    choice = answer.choices[0]
    prompt = chat_prompt_ids(server)
    check_chat_content(hf, prompt, choice.token_ids, choice.logprobs.content)
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same tokens, and the same logprobs to float rounding: two requests need not run the same
    # shapes (the second finds its prompt in the prefix cache), and on an AVX-512/AMX Xeon (session
    # 27) they differed in the 7th digit (-1.8513309 against -1.8513314); on Zen 4 they were equal
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-5)


def test_completion_logprobs_and_offsets_stream_and_not(server, checkpoint):
    hf, client = checkpoint[1], openai_client(server)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    args = dict(model=client.models.list().data[0].id, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                logprobs=TOP, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = client.completions.create(**args).choices[0]
    lp = choice.logprobs
    rows = hf_rows(hf, prompt, choice.token_ids)
    assert all(abs(a - float(row[t])) < 1e-4 for a, row, t in zip(lp.token_logprobs, rows, choice.token_ids))
    assert all(len(top) in (TOP, TOP + 1) and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert all(math.isfinite(x) and x <= 0 for x in streamed)


def test_echo_repeats_the_prompt_stream_and_not(colocated):
    client = openai_client(colocated)
    args = dict(model=client.models.list().data[0].id, prompt="hello world", temperature=0, max_tokens=4,
                echo=True, extra_body={"ignore_eos": True})
    plain = client.completions.create(**{**args, "echo": False}).choices[0].text
    assert client.completions.create(**args).choices[0].text == "hello world" + plain
    assert "".join(c.choices[0].text for c in client.completions.create(**args, stream=True)
                   if c.choices) == "hello world" + plain


def test_echo_with_logprobs_scores_the_prompt_as_transformers_stream_and_not(server, checkpoint):
    hf, client = checkpoint[1], openai_client(server)
    prompt = [5, 17, 99, 3, 250, 41, 8, 17, 99]
    args = dict(model=client.models.list().data[0].id, prompt=prompt, temperature=0, max_tokens=3, echo=True,
                logprobs=TOP, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = client.completions.create(**args).choices[0]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(prompt) + 3
    rows = hf_rows(hf, prompt[:1], prompt[1:] + choice.token_ids)  # row i scores token i + 1
    scored = prompt[1:] + choice.token_ids
    assert all(abs(a - float(row[t])) < 1e-4 for a, row, t in zip(lp.token_logprobs[1:], rows, scored, strict=True))
    assert all(max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
               for top, row in zip(lp.top_logprobs[1:], rows))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_max_tokens_0_with_echo_scores_only_the_prompt(colocated, checkpoint):
    hf, client = checkpoint[1], openai_client(colocated)
    prompt = [5, 17, 99, 3, 250]
    args = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    answer = client.completions.create(**args)
    choice = answer.choices[0]
    rows = hf_rows(hf, prompt[:1], prompt[1:])
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(prompt)
    assert all(abs(a - float(row[t])) < 1e-4 for a, row, t in zip(choice.logprobs.token_logprobs[1:], rows, prompt[1:]))
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 0
    assert choice.text == httpx.post(colocated.base_url + "/detokenize", json={"tokens": prompt}).json()["prompt"]
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 0


@pytest.mark.parametrize("path,body,param", [
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
])
def test_bad_logprobs_requests_are_400_with_an_openai_error(colocated, path, body, param):
    r = httpx.post(f"{colocated.base_url}/v1/{path}", json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param or param in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_answers_are_valid_json(server, stream):
    client = openai_client(server)
    model = client.models.list().data[0].id
    for i, schema in enumerate(schemas(2, seed=5)):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        kw = dict(model=model, temperature=1.0, seed=i, max_tokens=400)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                messages=CHAT, stream=True, response_format=fmt, **kw) if c.choices)
        else:  # completions take it too (as vLLM); the SDK only types it for chat
            text = client.completions.create(prompt="give me json", extra_body={"response_format": fmt},
                                             **kw).choices[0].text
        jsonschema.validate(json.loads(text), schema)
    answer = client.chat.completions.create(model=model, messages=CHAT, max_tokens=400, seed=1,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_bad_response_formats_are_400_naming_the_problem(colocated, fmt, param):
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions",
                   json={"messages": CHAT, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    if param.endswith("schema"):
        assert "nonsense" in error["message"] or "schema" in error["message"]
