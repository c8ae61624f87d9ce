"""A real server with two colocated engine processes, under load and under faults.

One server per module (tiny random-weight model, 2 engines with 1 thread each); the tests run
in order and the last ones kill the engines.
- Many clients at once get complete answers, and no KV block leaks. Greedy answers of the same
  request must be identical however the batch around them looked, so each concurrent stream
  is checked against the same request run alone afterwards.
- Clients that leave mid-stream have their requests aborted and their blocks freed.
- An engine that dies is noticed: its requests end with an error, never a hang; the survivor
  takes the traffic; with no engine left the API answers 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from serve_support import ServerProcess, free_port, all_blocks_free, metric_samples, process_alive, wait_until
from splitserve.trial.engine_steps import step_counts, steps_since
from tiny_models import write_tiny_checkpoint

# (prompt words, answer tokens): mixed prompt and answer lengths
CASES = [(1, 1), (2, 5), (4, 17), (8, 2), (14, 33), (20, 9), (30, 64), (3, 100)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    srv = ServerProcess(str(model), "--max-num-seqs", "32", "--max-queued-requests", "64",
                        "--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "128", "--log-level", "info",
                        instances=2, log_path=root / "server.log").wait_ready()
    yield srv
    pids = [i["pid"] for i in srv.health()["instances"]]
    assert srv.stop() == 0, srv.log()
    assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=10), "engines outlived serve"


def test_a_normal_start_of_two_engines_is_not_taken_for_a_restart(server):
    """An engine's first stats may overtake its hello (two sockets): that is no restart."""
    log = server.log_path.read_text(errors="replace")
    assert "engine engine-0 ready" in log and "engine engine-1 ready" in log, log  # info lines are on
    assert "without a hello" not in log and "does not know us" not in log, log


def test_a_taken_port_stops_serve_before_any_engine_starts(tmp_path):
    """The HTTP port is bound first: a taken one is said at once, not after the engines loaded the
    model, and no ephemeral port an engine socket binds meanwhile can land on the port serve was given."""
    model = write_tiny_checkpoint(tmp_path / "tiny", arch="llama")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(model), "--port",
                               str(port), "--threads-per-instance", "1", "--log-level", "info"],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"splitserve serve: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "connecting to" not in proc.stderr + proc.stdout, proc.stderr[-2000:]  # no engine was started


def test_serve_exits_with_a_clear_error_when_the_model_cannot_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(tmp_path / "missing"),
                           "--port", str(free_port()), "--threads-per-instance", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "splitserve serve:" in proc.stderr and "missing" in proc.stderr.splitlines()[-1]


def messages(words: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(["hello world the answer"] * words)}]


async def stream_answer(client: openai.AsyncOpenAI, model: str, case: int) -> tuple[str, int, str]:
    words, max_tokens = CASES[case]
    stream = await client.chat.completions.create(
        model=model, messages=messages(words), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, completion_tokens = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            completion_tokens = chunk.usage.completion_tokens
    return text, completion_tokens, finish


def test_64_concurrent_streams_get_complete_correct_answers_and_free_all_blocks(server):
    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            results = await asyncio.gather(*(stream_answer(client, model, i % len(CASES)) for i in range(64)))
            # The same requests, one at a time, as the reference.
            alone = [await stream_answer(client, model, c) for c in range(len(CASES))]
            return results, alone

    results, alone = asyncio.run(run_all())
    for i, (text, completion_tokens, finish) in enumerate(results):
        case = i % len(CASES)
        assert completion_tokens == CASES[case][1], f"stream {i} got {completion_tokens} tokens"
        assert finish == "length"
        assert text == alone[case][0], f"stream {i} differs from the same request run alone"
    assert wait_until(lambda: all_blocks_free(server.base_url))
    free = metric_samples(server.base_url, "splitserve_instance_kv_blocks_free")
    assert len(free) == 2  # both instances report, and both are fully free
    prompts_seen = metric_samples(server.base_url, "splitserve_instance_prefix_cache_hit_rate")
    assert all(rate > 0 for rate in prompts_seen.values()), "the router left an instance idle"


def test_admin_steps_report_every_step_the_engines_ran(server):
    """GET /admin/steps (what a trial keeps per run): each engine's steps with their shapes and times;
    every answer token after the first is one decode in one step, so the decodes add up exactly."""
    before = step_counts(server.base_url)
    assert before is not None and len(before) == 2

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(stream_answer(client, model, c) for c in range(len(CASES))))

    results = asyncio.run(run_all())
    expected_decodes = sum(tokens - 1 for _, tokens, _ in results)

    def decodes() -> int:
        got = steps_since(server.base_url, before)
        return sum(s[2] for inst in got["instances"].values() for s in inst["samples"])
    assert wait_until(lambda: decodes() == expected_decodes, timeout_s=5), (decodes(), expected_decodes)
    got = steps_since(server.base_url, before)
    assert got["fields"] == ["prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds",
                             "loop_seconds", "cpu_seconds"]
    samples = [s for inst in got["instances"].values() for s in inst["samples"]]
    assert all(inst["role"] == "colocated" and inst["missing"] == 0 for inst in got["instances"].values())
    assert all(s[0] + s[2] >= 1 and s[4] > 0 for s in samples)  # every sample ran something, and took time
    assert sum(s[0] for s in samples) > 0 and all(s[3] >= s[2] for s in samples)  # a decode attends to >= 1 token
    looped = [s for s in samples if s[5] > 0]
    assert looped and all(s[5] >= s[4] for s in looped)  # a loop turn holds its step
    # the engine thread's CPU time in the step: some, and never more than the step's wall time
    # (1-thread engines: the model runs on that thread alone)
    assert all(0 < s[6] <= s[4] * 1.05 + 1e-3 for s in samples)
    assert httpx.get(f"{server.base_url}/admin/steps", params={"tail": 1}).json()["instances"][0]["first"] >= 0
    bad = httpx.get(f"{server.base_url}/admin/steps", params={"tail": -1})
    assert bad.status_code == 400 and "tail" in bad.json()["error"]["message"]


def outcome_counts(base_url: str) -> dict[str, float]:
    """The server's finished requests by outcome, and the tokens it generated (all, and those
    of requests it aborted), from /metrics."""
    counts = {k.split('"')[1]: v for k, v in metric_samples(base_url, "splitserve_requests_total").items()}
    counts["generated"] = metric_samples(base_url, "splitserve_generation_tokens_total")[""]
    aborted = metric_samples(base_url, "splitserve_aborted_tokens_total")
    counts["generated_aborted"] = aborted.get('{kind="generated"}', 0.0)
    return counts


def test_20_clients_disconnecting_mid_stream_free_their_blocks(server):
    """Each client leaves after 3 of 400 tokens. Whether the server had already generated all 400
    when the disconnect reached it depends on the box's speed, so the test counts what the server
    registered: each request ended exactly once, as an abort or (finished first) a full answer,
    never an error; the tokens it counted add up; and the disconnects were noticed at all."""
    before = outcome_counts(server.base_url)
    max_tokens = 400  # the tiny model's context is 512; the prompt is ~20 tokens

    async def leave_early(client, model, i):
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"client {i} says hello"}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        received = 0
        async for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 3:
                break
        await stream.close()
        return received

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(leave_early(client, model, i) for i in range(20)))

    assert asyncio.run(run_all()) == [3] * 20
    assert wait_until(lambda: all_blocks_free(server.base_url), timeout_s=60), \
        httpx.get(server.base_url + "/metrics").text
    delta = {k: v - before[k] for k, v in outcome_counts(server.base_url).items()}
    assert delta["abort"] + delta["length"] == 20, delta
    assert delta["stop"] == delta["error"] == delta["rejected"] == 0, delta
    assert delta["abort"] >= 1, delta  # a client leaving 397 tokens early is noticed
    # a full answer is 400 tokens, an aborted one what it got before the abort: nothing counted twice
    assert delta["generated"] == delta["length"] * max_tokens + delta["generated_aborted"], delta
    assert delta["generated_aborted"] < delta["abort"] * max_tokens, delta
    # ... and the server keeps serving.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    answer = client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5


def test_non_streaming_client_leaving_aborts_its_request(server):
    body = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True}
    # the client leaves a quarter of the way through the answer, however fast this box makes it
    # (a fixed 0.15 s once outlasted the whole answer on a fast box)
    started = time.perf_counter()
    assert httpx.post(server.base_url + "/v1/completions", timeout=60, json=body).status_code == 200
    whole_s = time.perf_counter() - started
    aborted_before = metric_samples(server.base_url, "splitserve_requests_total")['{outcome="abort"}']
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", timeout=whole_s / 4, json=body)
    assert wait_until(lambda: metric_samples(server.base_url, "splitserve_requests_total")[
        '{outcome="abort"}'] == aborted_before + 1)
    assert wait_until(lambda: all_blocks_free(server.base_url))


def engine_pids(server) -> dict[str, int]:
    return {i["id"]: i["pid"] for i in server.health()["instances"]}


def test_killed_engine_leaves_rotation_and_its_stream_resumes_on_the_survivor(server):
    """Issue 11: a stream decoding on an engine that dies is resumed elsewhere (prompt + tokens so
    far recomputed) instead of ending with an error; greedy, it ends with the same text."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    args = dict(model=model, prompt="hello world", max_tokens=300, stream=True, temperature=0,
                extra_body={"ignore_eos": True})
    reference = client.completions.create(**{**args, "stream": False}).choices[0].text
    # Least outstanding tokens puts the second stream on the other (idle) engine.
    streams = [iter(client.completions.create(**args)) for _ in range(2)]
    firsts = [next(s).choices[0].text for s in streams]
    os.kill(engine_pids(server)["engine-0"], signal.SIGKILL)

    texts = [first + "".join(c.choices[0].text for c in s if c.choices) for first, s in zip(firsts, streams)]
    assert texts == [reference, reference]
    assert sum(metric_samples(server.base_url, "splitserve_request_resumes_total").values()) == 1

    health = server.health()
    assert health["instances_alive"] == 1
    assert {i["id"]: i["alive"] for i in health["instances"]} == {"engine-0": False, "engine-1": True}
    for _ in range(3):  # every new request goes to the survivor
        answer = client.completions.create(model=model, prompt="hello", max_tokens=4,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4


def test_no_engine_left_means_503_with_retry_after(server):
    os.kill(engine_pids(server)["engine-1"], signal.SIGKILL)
    assert wait_until(lambda: server.health()["instances_alive"] == 0)
    assert httpx.get(server.base_url + "/health").status_code == 503
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "no_engine"
