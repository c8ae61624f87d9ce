"""The frontend's link to its engines: one ROUTER socket, owned by one I/O thread, and liveness.

    loop thread:  send(engine_id, message) --encode--> outbox --wake--> I/O thread --> engine <id>/in
    I/O thread:   engine <id>/out, <id>/in --decode--> last_heard[id] = now --call_soon_threadsafe-->
                  loop thread: _deliver --> the listener (the dispatcher)

Liveness is measured by the I/O thread, which stamps each engine's messages as they arrive: an
event loop held up by a burst of work (seconds of tokenizing) cannot make a live engine look
silent. An instance is marked dead when its process exits or after `heartbeat_timeout_s` of
silence (engines send a heartbeat every 0.25 s). A dead instance that speaks again was wrongly
declared dead: it is admitted back (told to drop the requests it held, which were retried or
resumed elsewhere). One still silent `orphan_grace_s` after it was declared dead is told to stop
(and a process we started is terminated), as is an instance removed on purpose (drained): no
orphans keep a KV cache and cores. If an id removed for its silence speaks again, a supervisor
(Ray) restarted it or a partition healed: it is asked for its hello and rejoins as a fresh
instance. A drained one that speaks is told to stop again.

A supervisor's restart may speak before its hello (its stats and hello leave on two sockets) while
its predecessor is only dead, not yet removed: it is admitted back as if it were the old process,
and its hello a moment later, from another pid, replaces the old hello instead of being refused.

A hello is checked field by field, and a second hello for a live engine id is refused: another
local process cannot take over an engine's identity or shrink every engine's context limit.

A message from an engine id we never heard a hello from comes from an engine that outlived the
frontend it joined (we restarted on the same address and ZeroMQ reconnected it): it is asked for
its hello again (ResendHello, at most every `RESEND_HELLO_INTERVAL_S` per id) and rejoins. At a
normal start an engine's first stats (output socket) can overtake its hello (input socket): an id
is asked only once it has stayed unknown `HELLO_GRACE_S`, so a start is not taken for a restart.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import re
import subprocess
import threading
import time
from typing import Protocol

import msgspec
import zmq

from splitserve.config import ROLES
from splitserve.coordinator.request_state import Instance
from splitserve.link_security import EngineLinkSecurity
from splitserve.protocol import (PROTOCOL_VERSION, AbortRequests, Codec, EngineHello, Heartbeat, ResendHello,
                                 Shutdown, ToEngine, socket_identity)

log = logging.getLogger(__name__)

ENGINE_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_CONTEXT_TOKENS = 1 << 24  # no model has a 16M-token context; a hello claiming more is bogus
MAX_VOCAB = 1 << 24
WATCHDOG_INTERVAL_S = 0.2
RESEND_HELLO_INTERVAL_S = 2.0  # an engine whose hello we refuse is asked again this often, no more
HELLO_GRACE_S = 1.0  # 4 heartbeats: a hello sent at the same time as the first stats has arrived by then
MAX_HELLO_ASKS = 256  # unknown ids remembered for the rate limit; a flood of made-up ids stays bounded


class LinkListener(Protocol):
    def on_ready(self, engine_id: str, rejoined: bool) -> None: ...
    def on_message(self, engine_id: str, message) -> None: ...
    def on_dead(self, engine_id: str, why: str) -> None: ...
    def on_tick(self) -> None: ...


def check_hello(hello: EngineHello) -> str | None:
    """Why a hello cannot be accepted, or None."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return f"it speaks protocol {hello.protocol_version}, we speak {PROTOCOL_VERSION}"
    if not ENGINE_ID_RE.fullmatch(hello.engine_id):
        return "its engine id is not 1-64 letters, digits, '.', '_' or '-'"
    if hello.role not in ROLES:
        return f"unknown role {hello.role!r}"
    if not 0 < len(hello.model_name) <= 256:
        return "its model name is empty or too long"
    checks = (("max_model_len", hello.max_model_len, MAX_CONTEXT_TOKENS), ("vocab_size", hello.vocab_size, MAX_VOCAB),
              ("num_blocks_total", hello.num_blocks_total, 1 << 31), ("block_size", hello.block_size, 1 << 16),
              ("max_num_seqs", hello.max_num_seqs, 1 << 20), ("pid", hello.pid, 1 << 31))
    for name, value, limit in checks:
        if not 0 < value <= limit:
            return f"{name} {value} is outside 1..{limit}"
    return None


class EngineLink:
    def __init__(self, bind: str = "tcp://127.0.0.1:0", link: EngineLinkSecurity | None = None,
                 heartbeat_timeout_s: float = 1.5, orphan_grace_s: float = 10.0) -> None:
        self.heartbeat_timeout_s, self.orphan_grace_s = heartbeat_timeout_s, orphan_grace_s
        self.instances: dict[str, Instance] = {}
        self.listener: LinkListener | None = None
        self._codec = Codec()  # loop thread: encode
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)  # used by the I/O thread only, once started
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a silent drop
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 1000)
        self.link = link
        if link is not None:  # CurveZMQ: only engines holding the shared secret get through
            link.secure_server(self.socket, self.ctx)
        self.socket.bind(bind)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://splitserve-link-wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = self.ctx.socket(zmq.PAIR)  # loop thread
        self._wake_tx.connect(wake)
        self._outbox: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._last_heard: dict[str, float] = {}  # written by the I/O thread only
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: asyncio.Task | None = None
        self._processes: dict[str, subprocess.Popen] = {}
        self._hello_asked: dict[str, float] = {}  # unknown engine id -> when we last sent it ResendHello
        self._unknown_since: dict[str, float] = {}  # unknown engine id -> when it first spoke without a hello
        self._orphaned: set[str] = set()  # removed because silent, not drained: may come back
        self._rejoined_without_hello: set[str] = set()  # admitted back on a message that was not a hello

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self, listener: LinkListener) -> None:
        self.listener = listener
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._io_thread, args=(loop,), name="engine-link", daemon=True)
        self._thread.start()
        self._watchdog = asyncio.create_task(self._watchdog_loop())

    def attach_process(self, engine_id: str, process: subprocess.Popen) -> None:
        """Launch tells us which child runs an engine, so an exit is noticed at once."""
        self._processes[engine_id] = process

    def process_exited(self, engine_id: str) -> subprocess.Popen | None:
        proc = self._processes.get(engine_id)
        return proc if proc is not None and proc.poll() is not None else None

    async def close(self, shutdown_engines: bool = True) -> None:
        """shutdown_engines=False: the coordinator restarts in place (entrypoints/coordinator_restart.py);
        the engines keep running and rejoin the new process on this address."""
        for engine_id, inst in self.instances.items():
            if inst.alive and shutdown_engines:
                self.send(engine_id, Shutdown("frontend stopping"))
        await asyncio.sleep(0.1)  # let the I/O thread flush the shutdowns (or the last aborts)
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for sock in (self.socket, self._wake_rx, self._wake_tx):
            sock.close(linger=0)
        if self.link is not None:
            self.link.close()
        self.ctx.term()

    # ---- sending (loop thread) ---------------------------------------------------------

    def encode(self, message: ToEngine) -> bytes:
        """May raise (a number the wire cannot carry): call before registering anything."""
        return self._codec.encode(message)

    def send_encoded(self, engine_id: str, payload: bytes) -> None:
        self._outbox.append((socket_identity(engine_id, "in"), payload))
        self._wake()

    def send(self, engine_id: str, message: ToEngine) -> None:
        self.send_encoded(engine_id, self.encode(message))

    def _wake(self) -> None:
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending

    # ---- the I/O thread ------------------------------------------------------------------

    def _io_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        codec, poller = Codec(), zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stopping.is_set():
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            while self._outbox:
                identity, payload = self._outbox.popleft()
                try:
                    self.socket.send_multipart([identity, payload])
                except zmq.ZMQError as e:  # the peer is gone; the watchdog ends its requests
                    log.warning("cannot send to %s: %s", identity.decode(errors="replace"), e)
            if self.socket in events:
                batch = self._receive_all(codec)
                if batch:
                    loop.call_soon_threadsafe(self._deliver, batch)

    def _receive_all(self, codec: Codec) -> list[tuple[str, object]]:
        batch = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return batch
            if len(frames) != 2:
                log.warning("dropping a message with %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                message = codec.from_engine.decode(payload)
            except msgspec.DecodeError as e:
                log.warning("dropping an undecodable message from %r: %s", identity[:64], e)
                continue
            engine_id = identity.decode(errors="replace").rsplit("/", 1)[0]
            if message.engine_id != engine_id:
                log.warning("dropping a message claiming engine %r from socket %r", message.engine_id, identity)
                continue
            self._last_heard[engine_id] = time.monotonic()
            batch.append((engine_id, message))

    # ---- the loop thread: registration, delivery, liveness ------------------------------

    def _deliver(self, batch: list[tuple[str, object]]) -> None:
        for engine_id, message in batch:
            if isinstance(message, EngineHello):
                self._on_hello(message)
                continue
            inst = self.instances.get(engine_id)
            if inst is None:
                self._on_unknown(engine_id)  # no hello yet: nothing to route
                continue
            if not inst.alive:
                if self.process_exited(engine_id) is not None:
                    continue  # its last words, sent before it exited
                if inst.removed and engine_id in self._orphaned:
                    self._ask_hello(engine_id)
                    continue
                if inst.removed:
                    self.send(engine_id, Shutdown("removed from rotation"))
                    continue
                self._rejoin(engine_id, inst)
            if isinstance(message, Heartbeat):
                continue
            try:
                self.listener.on_message(engine_id, message)
            except Exception:  # noqa: BLE001 - one bad message must not lose the rest of the batch
                log.exception("handling a %s from engine %s failed", type(message).__name__, engine_id)

    def _on_unknown(self, engine_id: str) -> None:
        """Its hello may be a moment behind (another socket): ask only if it stays unknown."""
        now = time.monotonic()
        if len(self._unknown_since) >= MAX_HELLO_ASKS and engine_id not in self._unknown_since:
            self._unknown_since = {i: t for i, t in self._unknown_since.items() if now - t < HELLO_GRACE_S}
            if len(self._unknown_since) >= MAX_HELLO_ASKS:
                return
        if now - self._unknown_since.setdefault(engine_id, now) >= HELLO_GRACE_S:
            self._ask_hello(engine_id)

    def _ask_hello(self, engine_id: str) -> None:
        now = time.monotonic()
        if not ENGINE_ID_RE.fullmatch(engine_id):
            return  # no engine could say hello under this id
        if now - self._hello_asked.get(engine_id, float("-inf")) < RESEND_HELLO_INTERVAL_S:
            return
        if len(self._hello_asked) >= MAX_HELLO_ASKS:
            self._hello_asked = {i: t for i, t in self._hello_asked.items() if now - t < RESEND_HELLO_INTERVAL_S}
            if len(self._hello_asked) >= MAX_HELLO_ASKS:
                return
        self._hello_asked[engine_id] = now
        log.info("engine %r speaks without a hello (it outlived a frontend?): asking it for one", engine_id[:64])
        self.send(engine_id, ResendHello())

    def _on_hello(self, hello: EngineHello) -> None:
        why = check_hello(hello)
        current = self.instances.get(hello.engine_id)
        restarted = (current is not None and hello.engine_id in self._rejoined_without_hello
                     and hello.pid != current.hello.pid)
        if why is None and current is not None and current.alive and not restarted:
            if hello.pid == current.hello.pid and hello.role == current.hello.role:
                # the same process twice: its first stats left (output socket) before its hello
                # (input socket), so it was asked for another, and the first arrived after all
                log.debug("engine %s said hello twice (pid %d); already registered", hello.engine_id, hello.pid)
                return
            why = f"engine id {hello.engine_id!r} is already taken by a live engine (pid {current.hello.pid})"
        others = [i for i in self.instances.values() if i.alive and i.hello.engine_id != hello.engine_id]
        if why is None and others and hello.model_name != others[0].hello.model_name:
            why = f"it serves {hello.model_name!r}, the others {others[0].hello.model_name!r}"
        if why is not None:
            log.error("refusing the hello of engine %r: %s", hello.engine_id[:64], why)
            return
        process = self._processes.get(hello.engine_id)
        if process is not None and process.poll() is not None:  # an engine restarted by hand under this id
            del self._processes[hello.engine_id]
            process = None
        self._hello_asked.pop(hello.engine_id, None)
        self._unknown_since.pop(hello.engine_id, None)
        self._orphaned.discard(hello.engine_id)
        self._rejoined_without_hello.discard(hello.engine_id)
        if restarted:  # the router already counts it live; a role other than its predecessor's re-adds it
            log.warning("engine %s restarted (pid %d -> %d)", hello.engine_id, current.hello.pid, hello.pid)
            old_role, current.hello = current.hello.role, hello
            if hello.role != old_role:
                self.listener.on_ready(hello.engine_id, rejoined=True)
            return
        self.instances[hello.engine_id] = Instance(hello, time.monotonic(), process=process)
        log.info("engine %s ready (%s, pid %d, %d KV blocks)", hello.engine_id, hello.role, hello.pid,
                 hello.num_blocks_total)
        self.listener.on_ready(hello.engine_id, rejoined=False)

    def _rejoin(self, engine_id: str, inst: Instance) -> None:
        inst.alive, inst.dead_since = True, None
        self._rejoined_without_hello.add(engine_id)
        log.warning("engine %s speaks again: it was alive after all (or restarted); admitted back", engine_id)
        if inst.lost_request_ids:  # retried or resumed elsewhere meanwhile: it must drop them
            self.send(engine_id, AbortRequests(sorted(inst.lost_request_ids)))
            inst.lost_request_ids.clear()
        self.listener.on_ready(engine_id, rejoined=True)

    def mark_dead(self, engine_id: str, why: str) -> None:
        inst = self.instances[engine_id]
        if not inst.alive:
            return
        inst.alive, inst.dead_since = False, time.monotonic()
        log.error("engine %s is dead (%s)", engine_id, why)
        self.listener.on_dead(engine_id, why)

    def remove(self, engine_id: str, why: str) -> None:
        """Out of rotation for good: tell it to stop."""
        inst = self.instances[engine_id]
        was_alive = inst.alive
        inst.alive, inst.removed = False, True
        self.send(engine_id, Shutdown(why))
        if inst.process is not None and inst.process.poll() is None and not was_alive:
            inst.process.terminate()  # silent too long: it may not hear the Shutdown
        log.warning("engine %s removed from rotation (%s) and told to stop", engine_id, why)
        if was_alive:
            self.listener.on_dead(engine_id, why)

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.check_liveness(time.monotonic())
            self.listener.on_tick()

    def check_liveness(self, now: float) -> None:
        for engine_id, inst in list(self.instances.items()):
            heard = max(self._last_heard.get(engine_id, 0.0), inst.last_seen)
            if inst.alive:
                exited = inst.process is not None and inst.process.poll() is not None
                if exited:
                    self.mark_dead(engine_id, f"exited with code {inst.process.returncode}")
                elif now - heard > self.heartbeat_timeout_s:
                    self.mark_dead(engine_id, f"sent nothing for {self.heartbeat_timeout_s:g} s")
            elif (not inst.removed and inst.dead_since is not None and self.process_exited(engine_id) is None
                  and now - max(heard, inst.dead_since) > self.orphan_grace_s):
                self.remove(engine_id, f"silent for {self.orphan_grace_s:g} s after it was declared dead")
                self._orphaned.add(engine_id)
