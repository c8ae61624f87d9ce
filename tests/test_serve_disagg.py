"""`splitserve serve --prefill 1 --decode 1` against a colocated server, over the real HTTP API.

Servers run the tiny random-weight model, one thread per engine; one server per arrangement
per module, started on first use.
- Greedy answers of 16 mixed requests (sent at once, streamed and not) are identical to the
  colocated server's, over shm and over tcp, and each carries a transfer report.
- A prompt whose first token already ends the answer (max_tokens=1) never reaches the decode
  instance and reports no transfer.
- Stop strings end the request on both instances.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from serve_disagg_support import DisaggServer, completion_body, stream_completion
from serve_support import all_blocks_free, metric_samples, wait_until
from tiny_models import write_tiny_checkpoint

NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("disagg") / "tiny", arch="llama"))


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """Lazily started servers by name, all stopped at the end of the module."""
    root = tmp_path_factory.mktemp("servers")
    arrangements = {
        "colocated": ("--instances", "1"),
        "shm": ("--prefill", "1", "--decode", "1", "--kv-transport", "shm"),
        "tcp": ("--prefill", "1", "--decode", "1", "--kv-transport", "tcp"),
    }
    started: dict[str, DisaggServer] = {}

    def get(name: str) -> DisaggServer:
        if name not in started:
            started[name] = DisaggServer(model, *arrangements[name],
                                         log_path=root / f"{name}.log").wait_ready()
        return started[name]

    yield get
    for name, srv in started.items():
        assert srv.stop() == 0, f"{name}: {srv.log()}"


def mixed_requests(seed: int = 0, n: int = NUM_REQUESTS) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 17, 40, 90, 160]))]
        out.append(completion_body(prompt, rng.choice([1, 2, 7, 20, 33]), stream=i % 3 != 0))
    return out


async def answer(client: httpx.AsyncClient, base_url: str, body: dict) -> dict:
    if body["stream"]:
        return await stream_completion(client, base_url, body)
    r = await client.post(base_url + "/v1/completions", json={**body, "stream_options": None})
    data = r.json()
    return {"status": r.status_code, "text": data["choices"][0]["text"], "finish": data["choices"][0]["finish_reason"],
            "num_tokens": data["usage"]["completion_tokens"], "report": data.get("splitserve"), "error": None,
            "done": True}


async def answer_all(base_url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(answer(client, base_url, b) for b in bodies)))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_greedy_answers_equal_colocated_and_report_each_transfer(servers, transport):
    bodies = mixed_requests()
    reference = asyncio.run(answer_all(servers("colocated").base_url, bodies))
    disagg = servers(transport)
    got = asyncio.run(answer_all(disagg.base_url, bodies))
    for i, (body, ref, res) in enumerate(zip(bodies, reference, got)):
        assert res["error"] is None and res["done"], (i, res)
        assert res["num_tokens"] == body["max_tokens"], (i, res)
        assert res["text"] == ref["text"], f"request {i} differs from colocated"
        assert ref["report"] is None  # colocated: no transfer, no report
        if body["max_tokens"] == 1:
            assert res["report"] is None, "the first token ended it: nothing to hand over"
        else:
            kv = res["report"]["kv_transfer"]
            assert kv["outcome"] == "ok" and kv["transport"] == transport and kv["bytes"] > 0, kv
    handed_over = sum(b["max_tokens"] > 1 for b in bodies)
    transfers = metric_samples(disagg.base_url, "splitserve_kv_transfers_total")
    assert transfers['{outcome="ok"}'] == handed_over
    assert wait_until(lambda: all_blocks_free(disagg.base_url))


def test_health_and_metrics_name_each_instance_role(servers):
    srv = servers("shm")
    roles = {i["id"]: i["role"] for i in srv.health()["instances"]}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode"}
    assert metric_samples(srv.base_url, "splitserve_instance_role") == {
        '{instance="prefill-0",role="prefill"}': 1.0, '{instance="decode-0",role="decode"}': 1.0}
    assert "splitserve_kv_transfer_seconds_bucket" in httpx.get(srv.base_url + "/metrics").text


def test_stop_string_ends_the_request_on_both_instances(servers):
    srv = servers("shm")
    body = completion_body([5, 6, 7, 8], 60, stream=False)
    full = asyncio.run(answer_all(srv.base_url, [body]))[0]["text"]
    stop = full[8:11]
    assert stop and stop not in full[:8]
    cut = asyncio.run(answer_all(srv.base_url, [{**body, "stop": [stop]}]))[0]
    assert cut["finish"] == "stop" and cut["text"] == full[:full.index(stop)]
    assert wait_until(lambda: all_blocks_free(srv.base_url))
