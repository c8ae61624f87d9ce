"""`serve --api-server-count 2`: two HTTP processes behind one port, one coordinator for the engines.

One server with two API processes and, as the reference, one with the default single process
(tiny random-weight model, one engine each). Every answer names the process that served it
(X-Splitserve-Api-Server), and each request opens its own connection, so the kernel's
SO_REUSEPORT spread reaches both processes.
- Concurrent chat and text completions all succeed with the greedy tokens of the single-process
  server, and both processes served some.
- A stream cancelled by its client on API process 1 is aborted on the engine: its blocks are freed.
- Bad input gets the same OpenAI-style 400 body from either process.
- Stopping the server stops every process; a coordinator killed outright takes its API
  processes with it.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve_support import ServerProcess, all_blocks_free, metric_samples, process_alive, wait_until
from tiny_models import write_tiny_checkpoint

SERVED_BY = "x-splitserve-api-server"
ENGINE_FLAGS = ("--max-num-seqs", "16", "--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "128")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("apicount") / "tiny", arch="llama")


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("apicount-logs")
    two = ServerProcess(str(model), *ENGINE_FLAGS, "--api-server-count", "2", log_path=root / "two.log")
    one = ServerProcess(str(model), *ENGINE_FLAGS, log_path=root / "one.log")
    try:
        yield two.wait_ready(), one.wait_ready()
    finally:
        one.stop()
        pids = children(two.proc.pid)
        assert two.stop() == 0, two.log()
        assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=30), "a child outlived serve"


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def request_body(kind: str, i: int) -> dict:
    words = " ".join(["tell me about the weather"] * (1 + i % 4))
    common = {"max_tokens": 4 + 3 * (i % 5), "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if kind == "chat":
        return {"messages": [{"role": "user", "content": f"{i}: {words}"}], **common}
    return {"prompt": f"{i}: {words}", **common}


def answer_of(kind: str, payload: dict) -> tuple[str, list[int]]:
    choice = payload["choices"][0]
    return (choice["message"]["content"] if kind == "chat" else choice["text"]), choice["token_ids"]


async def post_on_a_new_connection(base_url: str, kind: str, body: dict) -> httpx.Response:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return await client.post(path, json=body)


def test_concurrent_chats_and_completions_match_one_process_and_land_on_both(servers):
    two, one = servers
    cases = [(kind, i) for i in range(16) for kind in ("chat", "text")]

    async def run_all(base_url: str, concurrent: bool) -> list[httpx.Response]:
        calls = [post_on_a_new_connection(base_url, kind, request_body(kind, i)) for kind, i in cases]
        if concurrent:
            return await asyncio.gather(*calls)
        return [await call for call in calls]

    answers = asyncio.run(run_all(two.base_url, concurrent=True))
    reference = asyncio.run(run_all(one.base_url, concurrent=False))
    assert [r.status_code for r in answers] == [200] * len(cases), [r.text for r in answers if r.status_code != 200]
    assert {r.headers[SERVED_BY] for r in answers} == {"0", "1"}
    assert all(SERVED_BY not in r.headers for r in reference)  # one process: today's answers, unchanged
    for (kind, i), got, want in zip(cases, answers, reference):
        assert answer_of(kind, got.json()) == answer_of(kind, want.json()), (kind, i, got.headers[SERVED_BY])


def test_a_stream_cancelled_on_api_process_1_frees_its_blocks(servers):
    two, _ = servers
    aborted_before = metric_samples(two.base_url, "splitserve_requests_total")['{outcome="abort"}']
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    num_cancelled = 0
    for _ in range(40):
        with httpx.Client(base_url=two.base_url, timeout=30) as client, \
                client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.headers[SERVED_BY] != "1":
                continue  # served by the coordinator itself: leaving aborts it too
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break
        num_cancelled += 1
        if num_cancelled == 3:
            break
    assert num_cancelled == 3, "no connection reached API process 1"
    assert wait_until(lambda: all_blocks_free(two.base_url)), httpx.get(two.base_url + "/metrics").text
    aborted = metric_samples(two.base_url, "splitserve_requests_total")['{outcome="abort"}']
    assert aborted - aborted_before >= 3


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}, "model"),
])
def test_bad_input_gets_the_same_openai_error_from_either_process(servers, body, param):
    two, _ = servers

    async def ask_until_both_answered() -> dict[str, httpx.Response]:
        by_process = {}
        for _ in range(40):
            response = await post_on_a_new_connection(two.base_url, "chat", body)
            by_process[response.headers[SERVED_BY]] = response
            if len(by_process) == 2:
                break
        return by_process

    by_process = asyncio.run(ask_until_both_answered())
    assert set(by_process) == {"0", "1"}
    first, second = by_process["0"], by_process["1"]
    assert first.status_code == second.status_code and first.status_code in (400, 404)
    assert first.json() == second.json()
    assert first.json()["error"]["param"] == param and first.json()["error"]["type"] == "invalid_request_error"


def test_the_admin_api_and_metrics_answer_the_same_on_either_process(servers):
    two, _ = servers
    seen = {}
    for _ in range(40):
        with httpx.Client(base_url=two.base_url, timeout=10) as client:
            response = client.get("/admin/instances")
        seen[response.headers[SERVED_BY]] = response
        if len(seen) == 2:
            break
    assert set(seen) == {"0", "1"}
    assert seen["0"].status_code == seen["1"].status_code == 200
    assert seen["0"].json()["instances"] == seen["1"].json()["instances"]


def test_serve_refuses_an_api_server_count_below_one(model):
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(model),
                           "--api-server-count", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--api-server-count must be >= 1" in proc.stderr


def test_a_port_another_server_shares_out_is_refused_not_shared(model, tmp_path):
    """SO_REUSEPORT would let a second server of the same user take half of the first one's
    connections; serve checks the port is free first."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(model), "--port",
                               str(port), "--api-server-count", "2", "--threads-per-instance", "1",
                               "--log-level", "warning"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Address already in use" in proc.stderr


def test_api_processes_leave_when_the_coordinator_is_killed_outright(model, tmp_path):
    server = ServerProcess(str(model), *ENGINE_FLAGS, "--api-server-count", "2",
                           log_path=tmp_path / "server.log").wait_ready()
    pids = children(server.proc.pid)
    api_pids = [p for p in pids if "splitserve.api.api_worker" in command_line(p)]
    assert len(api_pids) == 1 and len(pids) == 2  # the second API process and the engine
    os.kill(server.proc.pid, signal.SIGKILL)
    server.stop()
    # each notices within a second; the margin is for a box where others' work runs at higher priority
    assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=60), \
        [command_line(p) for p in pids if process_alive(p)]
