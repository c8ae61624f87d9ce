"""A hand-started engine the frontend refuses (no engine-link secret, or another one) fails fast
with an error that says which secret is missing, instead of waiting forever while ZMQ retries
its handshake in silence. One holding the right secret is heard and keeps running."""
from __future__ import annotations

import threading
import time

import zmq

from splitserve.engine.process import EngineProcess
from splitserve.link_security import EngineLinkSecurity
from splitserve.protocol import Codec, Heartbeat

SECRET = b"a shared secret of 32 bytes, ok!"


class CurveFrontend:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.link = EngineLinkSecurity(SECRET)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.link.secure_server(self.sock, self.ctx)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def close(self) -> None:
        self.sock.close(0)
        self.link.close()
        self.ctx.term()


def start_engine(address: str, link: EngineLinkSecurity | None) -> tuple[EngineProcess, threading.Thread]:
    process = EngineProcess(core=None, engine_id="by-hand", connect=address, link=link)
    process.hello = lambda: Heartbeat("by-hand")  # the input thread's first message; no core needed
    thread = threading.Thread(target=process._input_thread, daemon=True)
    thread.start()
    return process, thread


def stop(process: EngineProcess, thread: threading.Thread) -> None:
    process.stopping.set()
    thread.join(timeout=10)
    process.ctx.term()


def refused_within(process: EngineProcess, seconds: float = 30.0) -> str | None:
    deadline = time.monotonic() + seconds
    while process.refused is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process.refused


def test_an_engine_without_the_secret_is_told_to_give_one_and_stops():
    frontend = CurveFrontend()
    try:
        process, thread = start_engine(frontend.address, None)
        why = refused_within(process)
        assert why is not None and "--engine-secret-file" in why and "has none" in why
        assert process.stopping.is_set()
        stop(process, thread)
        assert not thread.is_alive()
    finally:
        frontend.close()


def test_an_engine_with_another_secret_is_told_the_secrets_differ():
    frontend = CurveFrontend()
    try:
        process, thread = start_engine(frontend.address, EngineLinkSecurity(b"another secret, 32 bytes long!!!"))
        why = refused_within(process)
        assert why is not None and "not the frontend's" in why
        stop(process, thread)
    finally:
        frontend.close()


def test_an_engine_with_the_secret_is_heard_and_not_refused():
    frontend = CurveFrontend()
    try:
        process, thread = start_engine(frontend.address, EngineLinkSecurity(SECRET))
        assert frontend.sock.poll(30_000), "the frontend never heard the keyed engine"
        _, payload = frontend.sock.recv_multipart()
        assert isinstance(Codec().from_engine.decode(payload), Heartbeat)
        assert process.refused is None and not process.stopping.is_set()
        stop(process, thread)
    finally:
        frontend.close()
