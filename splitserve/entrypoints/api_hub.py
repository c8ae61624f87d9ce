"""The coordinator's side of `serve --api-server-count N`: N HTTP processes on one port.

    coordinator (the `serve` process): engines, router, dispatcher, /admin, /metrics, API process 0
    API process 1..N-1 (api_worker.py): HTTP, render, tokenize, detokenize, tool-call/JSON parsing
      --ApiSubmit(token ids)--> ApiHub --Coordinator.submit_tokens--> the dispatcher
      <--ApiEvents(token ids)-- the dispatcher's events (Outbound); a loop turn's leave in one frame
      --ApiAbort--> the request's stream closes: the engines abort it and free its blocks
      --ApiForward(/admin/..., /metrics)--> the coordinator's own app --> ApiForwardReply

Every process listens on the same port with SO_REUSEPORT, so the kernel spreads connections
over them. (vLLM's `--api-server-count` hands one listening socket to N processes, each with
its own engine-core client; here one coordinator keeps the router and the P/D orchestration, so
the engines keep one view of the load.) The link is a ZeroMQ ROUTER on an ipc:// path in a
private (0700) temporary directory: only this user's processes can connect. Every frame is a
tagged msgspec struct (protocol.py). An API process that exits has its requests aborted; API
processes watch our pid and leave when we are gone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec
import zmq
import zmq.asyncio

from splitserve.api.engine_client import EngineClient
from splitserve.api.listen import identity
from splitserve.api.serving import submit_error
from splitserve.coordinator.request_state import TokenEvent, TokenStream
from splitserve.coordinator.router import NoInstanceAvailable
from splitserve.protocol import (ApiAbort, ApiEvent, ApiEvents, ApiForward, ApiForwardReply, ApiHello, ApiInstance,
                                 ApiInstances, ApiProcessConfig, ApiSubmit, ApiSubmitted, ToCoordinator)
from splitserve.sampling import SamplingParams

log = logging.getLogger(__name__)
SNAPSHOT_INTERVAL_S = 0.25  # API processes see instances come, go and die this late at most


def plain_settings(args) -> dict:
    """serve's parsed flags an API process needs, as msgspec can carry them (paths as strings)."""
    settings = {}
    for name, value in vars(args).items():
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        if isinstance(value, (str, int, float, bool, list, type(None))):
            settings[name] = value
    return settings


def api_event(request_id: str, event: TokenEvent) -> ApiEvent:
    return ApiEvent(request_id=request_id, token_ids=event.token_ids, num_prompt_tokens=event.num_prompt_tokens,
                    num_completion_tokens=event.num_completion_tokens, finished=event.finished,
                    finish_reason=event.finish_reason, error=event.error, rejected=event.rejected,
                    kv_transfer=event.kv_transfer, num_retries=event.num_retries, logprobs=event.logprobs,
                    prompt_logprobs=event.prompt_logprobs, num_cached_tokens=event.num_cached_tokens,
                    placement=event.placement)


async def call_app(app, forward: ApiForward) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Runs one buffered HTTP request through an ASGI app; -> (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": forward.method,
             "scheme": "http", "path": forward.path, "raw_path": forward.path.encode(), "root_path": "",
             "query_string": forward.query, "headers": [tuple(h) for h in forward.headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent_body, never = False, asyncio.get_running_loop().create_future()
    status, headers, body = 500, [], []

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": forward.body, "more_body": False}
        return await never  # the client is still there for as long as the app runs

    async def send(message: dict) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(body)


class ApiHub:
    def __init__(self, client: EngineClient, app) -> None:
        self.client, self.app = client, app  # app: the coordinator's guarded app, for forwarded routes
        self._dir = tempfile.mkdtemp(prefix="splitserve-api-")  # mode 0700
        self.address = f"ipc://{self._dir}/hub"
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCoordinator)
        self.processes: dict[bytes, subprocess.Popen] = {}  # by the API process's socket identity
        self.ready: set[bytes] = set()
        self._streams: dict[tuple[bytes, str], TokenStream] = {}
        self._outbox: dict[bytes, list[ApiEvent]] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---- the API processes ---------------------------------------------------------------

    def start_processes(self, count: int, args, port: int) -> None:
        """Starts API processes 1..count-1; this process serves as API process 0."""
        settings = plain_settings(args)
        for index in range(1, count):
            config = ApiProcessConfig(index, self.address, os.getpid(), port, settings)
            proc = subprocess.Popen([sys.executable, "-m", "splitserve.api.api_worker"], stdin=subprocess.PIPE)
            try:
                proc.stdin.write(msgspec.msgpack.encode(config))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died at once; wait_ready reports its exit code
            self.processes[identity(index)] = proc

    async def wait_ready(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.ready) < len(self.processes):
            for ident, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"API process {ident.decode()} exited with code {proc.returncode} "
                                       "during startup")
            if loop.time() > deadline:
                raise TimeoutError(f"API processes not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_loop())]

    async def close(self) -> None:
        self._stopping = True
        await asyncio.to_thread(stop_processes, list(self.processes.values()))
        for task in self._tasks:
            task.cancel()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.close()
        self.socket.close()
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages in ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            ident = frames[0]
            if ident not in self.processes or len(frames) != 2:
                log.warning("dropped a message from %r: not one frame from a known API process", ident)
                continue
            payload = frames[1]
            try:
                message = self._decoder.decode(payload)
            except msgspec.DecodeError as e:
                log.warning("dropped a malformed message from API process %s: %s", ident.decode(), e)
                continue
            if isinstance(message, ApiSubmit):
                self._submit(ident, message)
            elif isinstance(message, ApiAbort):
                self._abort(ident, message.request_id, message.reason)
            elif isinstance(message, ApiForward):
                task = asyncio.create_task(self._forward(ident, message))
                task.add_done_callback(self._tasks_done)
                self._tasks.append(task)
            elif isinstance(message, ApiHello):
                self.ready.add(ident)
                self._send(ident, self._snapshot())
                log.info("API process %d (pid %d) is ready", message.index, message.pid)

    def _tasks_done(self, task: asyncio.Task) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    def _submit(self, ident: bytes, message: ApiSubmit) -> None:
        key = (ident, message.request_id)
        try:
            params = SamplingParams(**msgspec.structs.asdict(message.params))
            stream = self.client.submit_tokens(message.client_request_id, message.prompt_token_ids, params,
                                               message.priority, events=Outbound(self, key),
                                               slo_class=message.slo_class)
        except (NoInstanceAvailable, ValueError) as e:
            error = submit_error(e)
            self._send(ident, ApiSubmitted(message.request_id, error.status, error.message, error.type, error.param,
                                           error.code, error.retry_after_s))
            return
        self._send(ident, ApiSubmitted(message.request_id))
        self._streams[key] = stream

    def _abort(self, ident: bytes, request_id: str, reason: str) -> None:
        stream = self._streams.pop((ident, request_id), None)
        if stream is not None:
            stream.close("stop" if reason == "stop" else "abort")

    async def _forward(self, ident: bytes, message: ApiForward) -> None:
        try:
            status, headers, body = await call_app(self.app, message)
        except Exception:  # the app answers its own errors; this is a bug, and the caller must hear back
            log.exception("forwarded %s %s failed", message.method, message.path)
            status, headers, body = 500, [(b"content-type", b"application/json")], \
                b'{"error": {"message": "internal error", "type": "server_error", "param": null, "code": null}}'
        self._send(ident, ApiForwardReply(message.forward_id, status, headers, body))

    # ---- messages out --------------------------------------------------------------------

    def on_event(self, key: tuple[bytes, str], event: TokenEvent) -> None:
        """The dispatcher's event for a request of an API process; the loop turn's events leave together."""
        if key not in self._streams:
            return  # aborted by its API process: the abort's own event goes nowhere
        if event.finished:
            del self._streams[key]
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.setdefault(key[0], []).append(api_event(key[1], event))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for ident, events in outbox.items():
            self._send(ident, ApiEvents(events))

    def _send(self, ident: bytes, message) -> None:
        # a ROUTER drops frames for a peer that is gone; a live peer's pipe does not fill (no HWM hit
        # at this rate), so the send completes at once and its future needs no waiting
        self.socket.send_multipart([ident, self._encoder.encode(message)])

    def _snapshot(self) -> ApiInstances:
        return ApiInstances([ApiInstance(inst.hello, inst.alive) for inst in self.client.instances.values()
                             if not inst.removed])

    async def _watch_loop(self) -> None:
        """Instances to every API process a few times a second; an exited API process's requests end."""
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            snapshot = self._snapshot()
            for ident in self.ready:
                self._send(ident, snapshot)
            for ident, proc in self.processes.items():
                if proc.poll() is not None and ident in self.ready and not self._stopping:
                    self.ready.discard(ident)
                    lost = [key for key in self._streams if key[0] == ident]
                    log.error("API process %s exited with code %s; aborting its %d requests", ident.decode(),
                              proc.returncode, len(lost))
                    for _, request_id in lost:
                        self._abort(ident, request_id, "abort")
                    break  # self.ready changed


class Outbound:
    """A request's event sink (request_state.EventSink): its events go to its API process."""

    __slots__ = ("hub", "key")

    def __init__(self, hub: ApiHub, key: tuple[bytes, str]) -> None:
        self.hub, self.key = hub, key

    def put_nowait(self, event: TokenEvent) -> None:
        self.hub.on_event(self.key, event)


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 10.0, what: str = "API process") -> None:
    """SIGTERM every process, wait up to `grace_s` for each, then SIGKILL what is left."""
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s pid %d did not stop in %.0f s; killing it", what, proc.pid, grace_s)
            proc.kill()
            proc.wait()
