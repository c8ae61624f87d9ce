"""`serve --prefill 1 --decode 1 --disagg-policy threshold` over the real HTTP API (tiny random-weight
model): short prompts are prefilled on the decode instance itself with the colocated server's greedy
tokens, long ones on the prefill instance, a prompt whose prefix the decode instance holds stays
there; every answer reports `usage.prompt_tokens_details.cached_tokens`, and where it was prefilled."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from serve_disagg_support import DisaggServer, completion_body, stream_completion
from serve_support import all_blocks_free, metric_samples, wait_until
from tiny_models import write_tiny_checkpoint

LOCAL_MAX = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("local") / "tiny", arch="llama"))


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    arrangements = {
        "colocated": ("--instances", "1"),
        "threshold": ("--prefill", "1", "--decode", "1", "--kv-transport", "shm", "--disagg-policy", "threshold",
                      "--local-prefill-max-tokens", str(LOCAL_MAX), "--local-prefill-chunk-tokens", "16"),
        # a gap target no step can meet: auto never prefills on the decode instance (its streams would
        # pay), and the prefill instance always meets the TTFT target: every prompt remote
        "auto": ("--prefill", "1", "--decode", "1", "--kv-transport", "shm", "--disagg-policy", "auto",
                 "--slo-ttft-s", "30", "--slo-gap-s", "0.0001"),
    }
    started: dict[str, DisaggServer] = {}

    def get(name: str) -> DisaggServer:
        if name not in started:
            started[name] = DisaggServer(model, *arrangements[name], log_path=root / f"{name}.log").wait_ready()
        return started[name]

    yield get
    for name, srv in started.items():
        assert srv.stop() == 0, f"{name}: {srv.log()}"


def complete(base_url: str, body: dict) -> dict:
    r = httpx.post(base_url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_usage(base_url: str, path: str, body: dict) -> dict | None:
    """The usage of a streamed answer's final chunk."""
    async def read() -> dict | None:
        usage = None
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", base_url + path, json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        usage = httpx.Response(200, content=line[6:]).json().get("usage") or usage
        return usage
    return asyncio.run(read())


def test_short_prompt_is_prefilled_on_the_decode_instance_with_colocated_tokens(servers):
    body = completion_body(list(range(40, 60)), 12, stream=False)
    expected = complete(servers("colocated").base_url, body)
    srv = servers("threshold")
    got = complete(srv.base_url, body)
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    report = got["splitserve"]
    assert report["prefill"] == {"where": "local", "reason": "short"}
    assert "kv_transfer" not in report, "nothing moved between instances"

    async def stream() -> dict:
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream_completion(client, srv.base_url, {**body, "stream": True})

    streamed = asyncio.run(stream())
    assert streamed["text"] == expected["choices"][0]["text"] and streamed["report"]["prefill"]["where"] == "local"
    decisions = metric_samples(srv.base_url, "splitserve_disagg_decisions_total")
    assert decisions['{prefill="local",reason="short"}'] >= 2
    assert wait_until(lambda: all_blocks_free(srv.base_url))


def test_long_prompt_goes_to_the_prefill_instance(servers):
    body = completion_body(list(range(100, 200)), 6, stream=False)
    expected = complete(servers("colocated").base_url, body)
    got = complete(servers("threshold").base_url, body)
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    assert got["splitserve"]["prefill"] == {"where": "remote", "reason": "long"}
    assert got["splitserve"]["kv_transfer"]["outcome"] == "ok"


def test_a_prompt_whose_prefix_the_decode_instance_holds_is_prefilled_there(servers):
    srv = servers("threshold")
    doc = list(range(300, 380))  # 80 tokens: remote the first time
    first = complete(srv.base_url, completion_body(doc, 4, stream=False))
    assert first["splitserve"]["prefill"]["where"] == "remote"
    follow_up = completion_body(doc + [9, 10, 11, 12], 6, stream=False)
    got = complete(srv.base_url, follow_up)
    assert got["splitserve"]["prefill"] == {"where": "local", "reason": "cached"}
    # the decode instance's own prefix cache served the blocks it received for the first request
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    expected = complete(servers("colocated").base_url, follow_up)
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]


def test_cached_tokens_are_reported_on_every_kind_of_answer(servers):
    base = servers("colocated").base_url
    prompt = list(range(500, 540))  # 2 full blocks once cached (the last token is always recomputed)
    cold = complete(base, completion_body(prompt, 2, stream=False))
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    warm = complete(base, completion_body(prompt, 2, stream=False))
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}

    assert streamed_usage(base, "/v1/completions", completion_body(prompt, 2, stream=True))[
        "prompt_tokens_details"] == {"cached_tokens": 32}
    chat = {"messages": [{"role": "user", "content": "hello there, " * 8}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    usage = streamed_usage(base, "/v1/chat/completions", {**chat, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert usage["prompt_tokens_details"]["cached_tokens"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_are_counted_on_whichever_instance_prefilled_the_prompt(servers):
    remote = servers("auto").base_url  # every prompt prefilled on the prefill instance
    prompt = list(range(220, 260))  # 2 full blocks once cached
    cold = complete(remote, completion_body(prompt, 3, stream=False))
    assert cold["splitserve"]["prefill"]["where"] == "remote"
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    warm = complete(remote, completion_body(prompt, 3, stream=False))
    assert warm["splitserve"]["prefill"]["where"] == "remote"
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # the prefill instance's hit
    assert streamed_usage(remote, "/v1/completions", completion_body(prompt, 3, stream=True))[
        "prompt_tokens_details"] == {"cached_tokens": 32}
    local = servers("threshold").base_url
    chat = list(range(60, 80))  # short: the decode instance prefills it, 1 full block
    assert complete(local, completion_body(chat, 3, stream=False))["splitserve"]["prefill"]["where"] == "local"
    assert streamed_usage(local, "/v1/completions", completion_body(chat, 3, stream=True))[
        "prompt_tokens_details"] == {"cached_tokens": 16}  # the decode instance's own hit


def test_client_leaving_a_locally_prefilled_stream_frees_every_block(servers):
    srv = servers("threshold")
    body = completion_body(list(range(600, 630)), 200, stream=True)

    async def leave() -> dict:
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream_completion(client, srv.base_url, body, leave_after=2)

    left = asyncio.run(leave())
    assert left["chunks"] == 2
    assert wait_until(lambda: all_blocks_free(srv.base_url))
    assert metric_samples(srv.base_url, "splitserve_requests_total").get('{outcome="abort"}', 0) >= 1


def test_auto_prefers_remote_prefill_when_the_prefill_instance_meets_the_ttft_target(servers):
    srv = servers("auto")
    body = completion_body(list(range(700, 720)), 8, stream=False)
    got = complete(srv.base_url, body)
    assert got["choices"][0]["text"] == complete(servers("colocated").base_url, body)["choices"][0]["text"]
    prefill = got["splitserve"]["prefill"]
    assert (prefill["where"], prefill["reason"]) == ("remote", "remote_meets_slo")
    assert 0 < prefill["ttft_remote_s"] < 30 and prefill["gap_local_s"] > 0
    assert got["splitserve"]["kv_transfer"]["outcome"] == "ok"


def test_an_answer_ended_by_a_stop_string_still_reports_its_prefill_and_cached_tokens(servers):
    srv = servers("threshold")
    body = completion_body(list(range(410, 434)), 40, stream=False)
    full = complete(srv.base_url, body)["choices"][0]["text"]
    # a 3-character stop that first occurs after the answer's start (the tiny model repeats itself)
    starts = [k for k in range(5, len(full) - 3) if full.find(full[k:k + 3]) == k and full[k:k + 3].strip()]
    assert starts, f"no stop candidate in {full!r}"
    stop = full[starts[0]:starts[0] + 3]
    cut = complete(srv.base_url, {**body, "stop": [stop]})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["splitserve"]["prefill"] == {"where": "local", "reason": "short"}
    assert cut["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}  # the first answer's prompt blocks
