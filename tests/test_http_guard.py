"""The HTTP front door, in process: Host checking (DNS rebinding), the admin key, the cap on
engines started through the admin API, and uvicorn's connection limits and timeouts."""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from fastapi.testclient import TestClient

from serve_support import free_port
from splitserve.api.api_server import build_server_app
from splitserve.api.http_guard import HttpGuard, add_http_guard_arguments, uvicorn_limits
from splitserve.api.instance_budget import InstanceBudget
from splitserve.api.limits import add_limit_arguments
from splitserve.api.openai_schema import ApiError
from splitserve.api.api_keys import add_api_key_arguments

API_KEY, ADMIN_KEY = "api-key-0123456789", "admin-key-0123456789abcdef"


class StubClient:
    """The EngineClient surface the admin routes and the budget read."""

    def __init__(self, num_alive: int = 1) -> None:
        hello = SimpleNamespace(role="colocated", pid=os.getpid())
        self.instances = {f"engine-{i}": SimpleNamespace(alive=True, hello=hello) for i in range(num_alive)}
        self.router = SimpleNamespace(instances={})
        self.address, self.renderer, self.drained = "tcp://127.0.0.1:1", None, []

    def live_instances(self):
        return [i for i in self.instances.values() if i.alive]

    def drain(self, engine_id: str) -> None:
        self.drained.append(engine_id)


def server_args(tmp_path, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--startup-timeout", type=float, default=600)
    add_api_key_arguments(p)
    add_http_guard_arguments(p)
    add_limit_arguments(p)
    return p.parse_args(list(argv))


def app_client(tmp_path, *argv: str, spawned: list | None = None, num_alive: int = 1) -> TestClient:
    spawn = (lambda role: spawned.append(role) or f"{role}-added-{len(spawned)}") if spawned is not None else None
    app, _ = build_server_app(StubClient(num_alive), SimpleNamespace(), spawn, server_args(tmp_path, *argv))
    return TestClient(app, base_url="http://localhost:8000")


def admin_key_file(tmp_path) -> str:
    path = tmp_path / "admin.key"
    path.write_text(ADMIN_KEY + "\n")
    return str(path)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_admin_routes_need_the_admin_key_and_the_api_key_does_not_open_them(tmp_path):
    client = app_client(tmp_path, "--api-key", API_KEY, "--admin-key-file", admin_key_file(tmp_path))
    for headers in ({}, bearer(API_KEY), bearer("wrong")):
        r = client.get("/admin/instances", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key", r.text
    assert client.get("/admin/instances", headers=bearer(ADMIN_KEY)).status_code == 200
    assert client.get("/v1/models", headers=bearer(ADMIN_KEY)).status_code == 401  # not an API key


def test_without_an_admin_key_admin_is_off_on_a_server_with_an_api_key_or_off_loopback(tmp_path):
    r = app_client(tmp_path, "--api-key", API_KEY).get("/admin/instances", headers=bearer(API_KEY))
    assert r.status_code == 403 and "--admin-key-file" in r.json()["error"]["message"]
    exposed = app_client(tmp_path, "--host", "0.0.0.0")
    assert exposed.delete("/admin/instances/engine-0").status_code == 403
    # an open loopback server keeps its open admin API (Host checking guards it from web pages)
    assert app_client(tmp_path).get("/admin/instances").status_code == 200


@pytest.mark.parametrize("host,ok", [("localhost:8000", True), ("127.0.0.1:1234", True), ("[::1]:80", True),
                                     ("LOCALHOST", True), ("evil.example", False), ("evil.example:8000", False),
                                     ("127.0.0.1.evil.example", False), ("my.box:8000", True)])
def test_a_loopback_server_refuses_foreign_host_headers(tmp_path, host, ok):
    client = app_client(tmp_path, "--allowed-hosts", "my.box")
    for path in ("/admin/instances", "/health"):
        r = client.get(path, headers={"Host": host})
        if ok:
            assert r.json().get("error", {}).get("code") != "invalid_host", (host, r.text)
        else:
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)


def test_post_admin_instances_stops_at_the_cap_counting_engines_still_starting(tmp_path):
    spawned = []
    client = app_client(tmp_path, "--max-instances", "3", spawned=spawned)
    assert client.post("/admin/instances", json={"role": "colocated"}).status_code == 202
    assert client.post("/admin/instances", json={"role": "colocated"}).status_code == 202
    r = client.post("/admin/instances", json={"role": "colocated"})  # 1 alive + 2 starting
    assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_instances", r.text
    assert len(spawned) == 2


def test_an_engine_that_would_not_fit_in_memory_is_not_started():
    spawned = []
    budget = InstanceBudget(lambda role: spawned.append(role) or "x", StubClient(1), max_instances=100,
                            rss=lambda pid: 3 << 30, available=lambda: 4 << 30)
    budget("decode")  # 3 GiB of 4 free: fits
    with pytest.raises(ApiError) as info:
        budget("decode")  # a second 3 GiB, while the first is still starting: does not
    assert info.value.status == 503 and info.value.code == "insufficient_memory"
    assert "MiB" in info.value.message and spawned == ["decode"]
    from splitserve.api.instance_budget import rss_bytes
    assert rss_bytes(1) is None  # not a splitserve engine: a remote engine's pid must not count here


# ---- uvicorn: connections that never finish their request -----------------------------------------

@pytest.fixture()
def guarded_server():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    guard = HttpGuard(limit_concurrency=4, timeout_request_headers=0.5, timeout_keep_alive=0.5)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                                           **uvicorn_limits(guard)))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_never_finishes_its_headers_is_closed(guarded_server):
    with socket.create_connection(("127.0.0.1", guarded_server)) as silent, \
            socket.create_connection(("127.0.0.1", guarded_server)) as trickling:
        trickling.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # ...and never the blank line
        assert closed_within(silent, 5) and closed_within(trickling, 5)


def test_connections_past_the_cap_are_closed_and_requests_still_served(guarded_server):
    idle = [socket.create_connection(("127.0.0.1", guarded_server)) for _ in range(80)]
    try:
        time.sleep(0.2)
        assert closed_within(idle[-1], 2)  # past limit_concurrency + 64: closed at once
    finally:
        for s in idle:
            s.close()
    with socket.create_connection(("127.0.0.1", guarded_server), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b"200" in s.recv(4096).split(b"\r\n")[0]


def test_a_body_that_stalls_is_refused_with_408_and_a_finished_body_never_times_out():
    from fastapi import HTTPException

    from splitserve.api.limits import RequestLimitsMiddleware

    async def run(chunks: list[dict]) -> list:
        seen = []

        async def receive():
            if chunks:
                return chunks.pop(0)
            await asyncio.sleep(3600)  # a client that stopped sending

        async def app(scope, receive_, send):
            while True:
                message = await receive_()
                seen.append(message)
                if not message.get("more_body"):
                    break
            await asyncio.wait_for(receive_(), 0.3)  # waiting for a disconnect is not a stalled body

        scope = {"type": "http", "method": "POST", "headers": [(b"content-type", b"application/json")]}
        try:
            await RequestLimitsMiddleware(app, body_timeout_s=0.2)(scope, receive, None)
        except (HTTPException, TimeoutError) as e:
            seen.append(e)
        return seen

    stalled = asyncio.run(run([{"type": "http.request", "body": b"{", "more_body": True}]))
    assert isinstance(stalled[-1], HTTPException) and stalled[-1].status_code == 408
    finished = asyncio.run(run([{"type": "http.request", "body": b"{}", "more_body": False}]))
    assert isinstance(finished[-1], TimeoutError)  # the app's own 0.3 s wait, not a 408


def test_large_prompts_wait_in_a_bounded_render_queue_and_small_ones_skip_it():
    from splitserve.api import serving as serving_module
    from splitserve.api.serving import OpenAIServing

    release = threading.Event()

    class SlowRenderer:
        def tokenize(self, text, add_special_tokens=True):
            if len(text) >= serving_module.INLINE_RENDER_CHARS:
                release.wait(10)
            return [len(text)]

    async def scenario():
        serving = OpenAIServing(StubClient(), SlowRenderer(), render_threads=2)
        big = "x" * serving_module.INLINE_RENDER_CHARS
        waiting = [asyncio.create_task(serving.tokenize(big)) for _ in range(serving_module.MAX_PENDING_RENDERS)]
        await asyncio.sleep(0.1)
        with pytest.raises(ApiError) as info:
            await serving.tokenize(big)
        assert info.value.status == 429 and info.value.code == "render_queue_full"
        assert await serving.tokenize("small") == [5]  # inline: not queued behind the big ones
        release.set()
        assert len(await asyncio.gather(*waiting)) == serving_module.MAX_PENDING_RENDERS

    asyncio.run(scenario())
