"""Secrets by default: `serve` secures the engine link and the KV sockets of the engines it starts,
also on loopback, with secrets it generates and hands over in each EngineConfig (stdin).

One loopback 1P1D server started without --engine-secret-file / --kv-secret-file:
- a local process without the KV secret that connects to the prefill instance's KV socket gets
  the challenge (authentication required) and, at its first message, a refusal and a closed
  connection: no Begin is ever answered;
- a local process without the engine link's key cannot talk to the frontend: its hello is never
  registered and it hears nothing back (not even a ResendHello);
- neither secret is on an engine's command line or in its environment, and serving works.
The link itself is tested in unit form too: a CurveZMQ frontend registers an engine holding the
key and never hears one without it.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import psutil
import pytest
import zmq

from serve_disagg_support import DisaggServer
from serve_support import wait_until
from splitserve.link_security import EngineLinkSecurity
from splitserve.kv_transfer.messages import Begin, Challenge, Hello, Reply
from splitserve.kv_transfer.transport import PeerClosed, TransferError
from splitserve.kv_transfer.wire import Connection
from splitserve.protocol import Codec, EngineHello, Heartbeat, socket_identity
from test_dispatch_faults import started_client, until
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("secrets")
    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    srv = DisaggServer(str(model), "--prefill", "1", "--decode", "1", "--kv-transport", "shm",
                       log_path=root / "server.log").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def instances(server) -> dict[str, dict]:
    return {i["id"]: i for i in httpx.get(server.base_url + "/admin/instances", timeout=10).json()["instances"]}


def kv_address(server) -> tuple[str, int]:
    """The prefill engine's one listening TCP socket is its KV socket."""
    pid = instances(server)["prefill-0"]["pid"]
    [listening] = [c.laddr for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    return listening.ip, listening.port


def test_serve_answers_with_secured_links(server):
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   json={"prompt": [5, 6, 7, 8] * 8, "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    assert r.json()["splitserve"]["kv_transfer"]["outcome"] == "ok"  # the decode instance proved the KV secret
    assert "secrets generated for these engines" in server.log_path.read_text(errors="replace")


def test_no_secret_is_on_an_engine_command_line_or_in_its_environment(server):
    for inst in instances(server).values():
        proc = psutil.Process(inst["pid"])
        cmdline = " ".join(proc.cmdline())
        assert "--config-stdin" in cmdline and "secret" not in cmdline, cmdline
        assert not any("SECRET" in k.upper() for k in proc.environ()), sorted(proc.environ())


def test_a_local_peer_without_the_kv_secret_is_refused_at_its_first_message(server):
    host, port = kv_address(server)
    assert host == "127.0.0.1"
    with socket.create_connection((host, port), timeout=10) as sock:
        conn = Connection(sock, 10)
        challenge = conn.recv()
        assert isinstance(challenge, Challenge) and challenge.auth_required  # loopback, no flag: still required
        conn.send(Hello(client_nonce=os.urandom(16), mac=b""))  # what a client without the secret can send
        answer = conn.recv()
        assert isinstance(answer, Reply) and not answer.ok and "authentication failed" in answer.error, answer
        with pytest.raises((PeerClosed, TransferError, OSError)):
            conn.send(Begin(request_id="anything"))
            conn.recv()  # closed: no Begin is answered
    with socket.create_connection((host, port), timeout=10) as sock:  # skipping the handshake: closed too
        conn = Connection(sock, 10)
        assert isinstance(conn.recv(), Challenge)
        conn.send(Begin(request_id="anything"))
        with pytest.raises((PeerClosed, TransferError, OSError)):
            conn.recv()


class PlainEngine:
    """Speaks the engine side of the link without CurveZMQ (or with it, given the keys)."""

    def __init__(self, address: str, engine_id: str, link: EngineLinkSecurity | None = None) -> None:
        self.engine_id, self.codec, self.ctx, self.socks = engine_id, Codec(), zmq.Context(), {}
        for direction in ("in", "out"):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, socket_identity(engine_id, direction))
            sock.setsockopt(zmq.LINGER, 0)
            if link is not None:
                link.secure_client(sock)
            sock.connect(address)
            self.socks[direction] = sock

    def hello(self) -> None:
        hello = EngineHello(self.engine_id, "colocated", "tiny", 512, 300, 64, 16, 2, os.getpid())
        self.socks["in"].send(self.codec.encode(hello), zmq.NOBLOCK)

    def heartbeat(self) -> None:
        try:
            self.socks["out"].send(self.codec.encode(Heartbeat(self.engine_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (a refused handshake): nothing can be sent

    def heard_anything(self) -> bool:
        return any(s.poll(0) for s in self.socks.values())

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.ctx.term()


def test_a_local_peer_without_the_link_key_cannot_talk_to_the_frontend(server):
    address = httpx.get(server.base_url + "/admin/instances", timeout=10).json()["engine_address"]
    intruder = PlainEngine(address, "intruder")
    try:
        try:
            intruder.hello()
        except zmq.Again:
            pass  # no connection completes without the key
        deadline = time.monotonic() + 4  # past the hello grace and a ResendHello interval
        while time.monotonic() < deadline:
            intruder.heartbeat()
            time.sleep(0.25)
        assert not intruder.heard_anything()
        assert "intruder" not in instances(server)
        assert "intruder" not in server.log_path.read_text(errors="replace")
    finally:
        intruder.close()


def test_a_curve_frontend_registers_an_engine_with_the_key_and_never_hears_one_without():
    async def go():
        link = EngineLinkSecurity(b"a shared secret of 32 bytes, ok!")
        client = await started_client(heartbeat_timeout_s=5.0, link=link)
        keyed = PlainEngine(client.address, "keyed", EngineLinkSecurity(b"a shared secret of 32 bytes, ok!"))
        plain = PlainEngine(client.address, "plain")
        wrong = PlainEngine(client.address, "wrong", EngineLinkSecurity(b"another secret, 32 bytes long!!!"))
        try:
            for engine in (keyed, plain, wrong):
                try:
                    engine.hello()
                except zmq.Again:
                    pass
            assert await until(lambda: "keyed" in client.instances)
            for _ in range(30):  # 3 s: past the hello grace
                for engine in (plain, wrong):
                    engine.heartbeat()
                await asyncio.sleep(0.1)
            assert set(client.instances) == {"keyed"}
            assert "plain" not in client.link._last_heard and "wrong" not in client.link._last_heard
            assert not plain.heard_anything() and not wrong.heard_anything()
        finally:
            await client.shutdown()
            for engine in (keyed, plain, wrong):
                engine.close()
    asyncio.run(go())


def test_engine_config_carries_the_link_secret_but_never_shows_it():
    from splitserve.config import EngineConfig
    from splitserve.protocol import decode_engine_config, encode_engine_config

    config = EngineConfig(link_secret=b"0123456789abcdef0123")
    assert decode_engine_config(encode_engine_config(config)).link_secret == b"0123456789abcdef0123"
    assert "0123456789abcdef" not in repr(config)  # a logged config does not leak it
