"""Hostile input: whatever a client sends, the answer is a 4xx with a JSON error (or a real
answer), never a 5xx, never a hang, and the server stays up; whatever lands on an engine's
socket, the engine rejects it, logs it, and keeps serving.

One real server per module (tiny random-weight model, 1 MiB body limit). The fuzz test sends
hypothesis-generated bodies to both generation endpoints; the hand-written cases cover what
random generation rarely hits (sizes, nesting, encodings, content types).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_support import REPO, ServerProcess, free_port, wait_until, stop_process
from splitserve.protocol import (AbortRequests, Codec, EngineHello, GenerateRequest, StepOutputs, WireSamplingParams,
                                 socket_identity)
from tiny_models import write_tiny_checkpoint

MAX_REQUEST_BYTES = 1024 * 1024
CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny", arch="llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile-log") / "server.log"
    srv = ServerProcess(str(model_dir), "--max-request-bytes", str(MAX_REQUEST_BYTES), "--kv-cache-memory", "8MiB",
                        "--max-num-seqs", "8", log_path=log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def post(server, path: str, content: bytes, content_type: str | None = "application/json",
         timeout_s: float = 60) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=timeout_s)


def assert_json_client_error(r: httpx.Response, *statuses: int) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if statuses:
        assert r.status_code in statuses, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"] and error["type"]


def assert_still_serving(server) -> None:
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.base_url + TEXT_URL, json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- hand-written cases ---------------------------------------------------------------------

MSG = '"messages": [{"role": "user", "content": "x"}]'
HOSTILE_BODIES = {
    "empty": b"",
    "whitespace": b"   \n",
    "null": b"null",
    "deep nesting, 100k lists": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep nesting, 50k objects": b'{"x": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    "invalid utf-8": b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}',
    "utf-16 bom": '{"prompt": "x"}'.encode("utf-16"),
    "lone surrogate escape": b'{"prompt": "\\ud800"}',
    "NaN temperature": ("{" + MSG + ', "temperature": NaN}').encode(),
    "Infinity top_p": ("{" + MSG + ', "top_p": Infinity}').encode(),
    "-Infinity seed": ("{" + MSG + ', "seed": -Infinity}').encode(),
    "negative max_tokens": ("{" + MSG + ', "max_tokens": -5}').encode(),
    "enormous max_tokens": ("{" + MSG + ', "max_tokens": 99999999999999999999999999}').encode(),
    "float max_tokens": ("{" + MSG + ', "max_tokens": 1.5}').encode(),
    "bool max_tokens": ("{" + MSG + ', "max_tokens": true}').encode(),
    "enormous seed": ("{" + MSG + ', "seed": 123456789012345678901234567890}').encode(),
    "unknown role": b'{"messages": [{"role": "root", "content": "x"}]}',
    "role missing": b'{"messages": [{"content": "x"}]}',
    "content as number": b'{"messages": [{"role": "user", "content": 5}]}',
    "messages empty": b'{"messages": []}',
    "messages as object": b'{"messages": {"role": "user"}}',
    "stop as object": ("{" + MSG + ', "stop": {"a": 1}}').encode(),
    "stream as string": ("{" + MSG + ', "stream": "yes"}').encode(),
    "many stop strings": ("{" + MSG + ', "stop": ' + json.dumps(["s"] * 1000) + "}").encode(),
    "top_k huge negative": ("{" + MSG + ', "top_k": -1000000}').encode(),
    "top_k past int64": ("{" + MSG + ', "top_k": 1000000000000000000000000000000}').encode(),
    "min_tokens past int64": ("{" + MSG + ', "min_tokens": 1000000000000000000000000000000}').encode(),
    "n past int64": ("{" + MSG + ', "n": 1000000000000000000000000000000}').encode(),
    "stop_token_ids past uint64": ("{" + MSG + ', "stop_token_ids": [100000000000000000000000]}').encode(),
    "top_logprobs huge": ("{" + MSG + ', "top_logprobs": 1000000000000000000000}').encode(),
    "presence_penalty huge": ("{" + MSG + ', "presence_penalty": 1e308}').encode(),
    "duplicate keys": ("{" + MSG + ", " + MSG + ', "max_tokens": 1, "max_tokens": -1}').encode(),
    "trailing garbage": ("{" + MSG + "} {}").encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_chat_body_is_a_json_4xx(server, name):
    assert_json_client_error(post(server, CHAT_URL, HOSTILE_BODIES[name]))


@pytest.mark.parametrize("prompt", [-1, 10**30, None, [[]], [[1, 2], [3]], [True], {"a": 1}, [1.5]])
def test_hostile_completion_prompts_are_a_json_4xx(server, prompt):
    assert_json_client_error(post(server, TEXT_URL, json.dumps({"prompt": prompt, "max_tokens": 2}).encode()))


def test_body_over_the_limit_is_413_without_reading_it_all(server):
    huge = b'{"prompt": "' + b"a" * (MAX_REQUEST_BYTES + 10) + b'"}'
    assert_json_client_error(post(server, TEXT_URL, huge), 413)

    def chunked():  # no Content-Length: the limit holds on the bytes received
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(server.base_url + TEXT_URL, content=chunked(), headers={"content-type": "application/json"},
                   timeout=60)
    assert_json_client_error(r, 413)
    assert "--max-request-bytes" in r.json()["error"]["message"]
    assert_still_serving(server)


def test_prompt_of_most_of_a_megabyte_is_400_too_long_never_a_hang(server):
    prompt = "lorem ipsum dolor " * 50_000  # 900 kB of text: far past the 512-token context
    r = post(server, TEXT_URL, json.dumps({"prompt": prompt, "max_tokens": 4}).encode())
    assert_json_client_error(r, 400)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, CHAT_URL, json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode())
    assert_json_client_error(r, 400)
    assert_still_serving(server)


def test_a_burst_of_megabyte_prompts_does_not_stall_the_event_loop(server):
    # Each prompt takes ~0.6 s to tokenize; on the event loop six of them held it for seconds,
    # long enough for the watchdog to declare the (healthy) engine dead.
    import concurrent.futures
    prompt = "lorem ipsum dolor " * 50_000
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        burst = [pool.submit(post, server, TEXT_URL, body) for _ in range(6)]
        slowest, alive = 0.0, []
        while not all(f.done() for f in burst):
            start = time.monotonic()
            r = httpx.get(server.base_url + "/health", timeout=30)
            slowest = max(slowest, time.monotonic() - start)
            alive.append(r.json()["instances_alive"])
            time.sleep(0.05)
        for f in burst:
            assert_json_client_error(f.result(), 400)
    assert slowest < 1.5, f"/health took {slowest:.2f} s while prompts were tokenized"
    assert min(alive) == 1, alive
    assert_still_serving(server)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
def test_wrong_content_type_is_415(server, content_type):
    r = post(server, CHAT_URL, ("{" + MSG + "}").encode(), content_type)
    assert_json_client_error(r, 415)


def test_json_content_type_variants_are_accepted(server):
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = post(server, TEXT_URL, b'{"prompt": "hi", "max_tokens": 1}', content_type)
        assert r.status_code == 200, (content_type, r.text)
    assert_json_client_error(post(server, TEXT_URL, b'{"prompt": "hi"}', content_type=None), 400)


def raw_http(server, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: sock.recv(65536), b""))


@pytest.mark.parametrize("headers,body", [
    (b"Content-Length: 2\r\n", b'{"prompt": "hi"}'),
    (b"Content-Length: abc\r\n", b"{}"),
    (b"Content-Length: -5\r\n", b"{}"),
    (b"Content-Length: 99999999999999999999\r\n", b"{}"),
    (b"Transfer-Encoding: chunked\r\n", b"zz\r\nnot hex\r\n"),
])
def test_lying_or_broken_framing_headers_are_a_4xx(server, headers, body):
    answer = raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + headers + b"Connection: close\r\n\r\n" + body)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    assert status is None or 400 <= status < 500, answer[:200]  # None: the server just hung up
    assert_still_serving(server)


# ---- fuzz -------------------------------------------------------------------------------------

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "n", "stream", "stream_options", "ignore_eos", "min_tokens", "logprobs",
          "echo", "suffix", "tools", "add_generation_prompt", "user", "top_logprobs", "response_format", "tool_choice"]
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.sampled_from([0, 1, 2, -1, 4, 1e-9, "user", "assistant", "system", "tool", ""]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(["role", "content", "include_usage", "a", "type",
                                                              "text", "name"]) | st.text(max_size=5),
                                             inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])
                                                   | json_values, "content": st.text(max_size=30) | json_values}),
                    max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8) | st.fixed_dictionaries(
    {"messages": messages, "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 300), max_size=8)},
    optional={"max_tokens": st.integers(-3, 8) | json_values, "temperature": json_values, "stream": st.booleans(),
              "stop": json_values, "seed": json_values, "top_k": json_values, "n": json_values})


@pytest.mark.parametrize("path", [CHAT_URL, TEXT_URL])
def test_fuzzed_bodies_never_get_a_5xx(server, path):
    seen = {"ok": 0, "client_error": 0}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies | json_values)
    def check(body):
        raw = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals on purpose
        r = post(server, path, raw)
        assert r.status_code < 500, (r.status_code, raw[:300], r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
            seen["client_error"] += 1
        else:
            seen["ok"] += 1

    check()
    assert seen["client_error"] > 50, seen
    assert_still_serving(server)


# ---- the engine's socket ---------------------------------------------------------------------

def test_engine_rejects_garbage_and_forged_frames_and_keeps_serving(model_dir, tmp_path):
    """The test plays the frontend: it binds the ROUTER an engine joins, then sends the engine
    frames no frontend would send. Each is dropped (logged) or refused with an error output;
    a real request afterwards is answered in full."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    log_path = tmp_path / "engine.log"
    with open(log_path, "wb") as log:
        engine = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "engine", "--connect",
                                   f"tcp://127.0.0.1:{port}", "--engine-id", "e0", "--model", str(model_dir),
                                   "--threads-per-instance", "1", "--kv-cache-memory", "4MiB"],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    codec = Codec()
    to_engine = socket_identity("e0", "in")
    try:
        hello, deadline = None, time.monotonic() + 180
        while hello is None and time.monotonic() < deadline:  # stats or a heartbeat may come first
            if router.poll(1000):
                identity, payload = router.recv_multipart()
                message = codec.from_engine.decode(payload)
                hello = message if isinstance(message, EngineHello) and identity == to_engine else None
        assert hello is not None and hello.engine_id == "e0", "the engine never said hello"
        encode = msgspec.msgpack.encode
        good = WireSamplingParams(max_tokens=3, ignore_eos=True)
        garbage = [
            b"", b"\x00" * 64, b"\xff" * 7, b"not msgpack at all",
            encode({"type": "launch_missiles", "x": 1}),  # unknown tag
            encode({"type": "generate"}),  # right tag, missing fields
            encode({"type": "generate", "request_id": 5, "prompt_token_ids": "abc", "params": {}}),
            encode(["generate", "r", [1], {}]),  # array where a map belongs
            b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 billion items
            encode({"type": "abort", "request_ids": [["nested"]]}),
        ]
        refused = [  # decodable, but the engine must refuse them (error outputs, not a crash)
            GenerateRequest("neg", [1, 2], WireSamplingParams(max_tokens=-4)),
            GenerateRequest("vocab", [10**9], good),
            GenerateRequest("empty", [], good),
            GenerateRequest("temp", [1], WireSamplingParams(max_tokens=2, temperature=float("nan"))),
            GenerateRequest("long", [1] * 100_000, good),
            GenerateRequest("big", [2**64 - 1], good),
        ]
        for payload in garbage:
            router.send_multipart([to_engine, payload])
        router.send_multipart([to_engine, b"extra", b"frames"])
        for message in refused:
            router.send_multipart([to_engine, codec.encode(message)])
        router.send_multipart([to_engine, codec.encode(AbortRequests(["never-existed"]))])
        router.send_multipart([to_engine, codec.encode(GenerateRequest("real", [5, 6, 7], good))])

        errors, tokens, deadline = {}, [], time.monotonic() + 120
        while time.monotonic() < deadline and not (len(tokens) == 3 and len(errors) == len(refused)):
            if not router.poll(1000):
                continue
            identity, payload = router.recv_multipart()
            message = codec.from_engine.decode(payload)
            if isinstance(message, StepOutputs):
                for out in message.outputs:
                    if out.request_id == "real":
                        tokens += out.new_token_ids
                    elif out.finish_reason == "error":
                        errors[out.request_id] = out.error
        assert tokens and len(tokens) == 3, "the engine stopped serving"
        assert set(errors) == {m.request_id for m in refused}, errors
        assert all(errors.values()), errors
        assert engine.poll() is None, "the engine died"
        logged = log_path.read_text(errors="replace")
        assert len(re.findall(r"dropping", logged)) >= len(garbage), logged[-3000:]
    finally:
        stop_process(engine)
        ctx.destroy(linger=0)


def test_bench_fuzz_bodies_get_no_5xx_and_leave_nothing_held(server):
    """bench/fuzz.py's generator, 200 bodies (the lead's full run sends 10,000 per arrangement)."""
    import asyncio

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import fuzz
    finally:
        sys.path.remove(str(REPO / "bench"))
    result = asyncio.run(fuzz.fuzz(server.base_url, count=200, seconds=60, seed=7, concurrency=4))
    assert result["sent"] == 200 and result["num_5xx"] == 0, result["server_errors"]
    assert result["statuses"].get(200, 0) > 50  # the generator reaches the engine, not only the validator
    check = fuzz.check_server(server.base_url, settle_s=30)
    assert not check["leaked"] and check["answers_normally"], check
