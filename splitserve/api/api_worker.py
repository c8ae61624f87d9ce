"""An API process of `serve --api-server-count N` (N > 1): HTTP, render and derender, no engines.

    python -m splitserve.api.api_worker  (started by api_hub.ApiHub; ApiProcessConfig on stdin)
      ├─ bind the shared port (SO_REUSEPORT), load the tokenizer, connect to the coordinator
      ├─ ApiHello --> the coordinator answers with ApiInstances (and again a few times a second)
      └─ uvicorn: the same OpenAI routes as the coordinator (api_server.build_openai_app) over a
         RemoteEngineClient; /admin/... and /metrics are forwarded to the coordinator

A request is rendered and tokenized here, sent as token ids (ApiSubmit), and its events come
back as token ids (ApiEvents) through a RemoteTokenStream, which text_stream.TextStream
detokenizes and checks for stop strings, as in the coordinator's process: a stop string ends
the request here and tells the coordinator (ApiAbort "stop"), which aborts it on the engines. Everything runs on this process's event loop.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import time

import msgspec
import zmq
import zmq.asyncio
from fastapi import Request
from fastapi.responses import Response

from splitserve.api.listen import identity, listening_socket
from splitserve.api.openai_schema import ApiError
from splitserve.api.render import Renderer
from splitserve.api.text_stream import TextStream
from splitserve.coordinator.coordinator import ServedInstances
from splitserve.coordinator.dispatcher import wire_params
from splitserve.coordinator.request_state import Instance, TokenEvent
from splitserve.protocol import (ApiAbort, ApiEvent, ApiEvents, ApiForward, ApiForwardReply, ApiHello,
                                 ApiInstances, ApiProcessConfig, ApiSubmit, ApiSubmitted, FromCoordinator)
from splitserve.sampling import SamplingParams

log = logging.getLogger("splitserve.api")
PARENT_CHECK_INTERVAL_S = 0.5
FORWARDED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class RemoteTokenStream:
    """The coordinator's TokenStream, seen from an API process: its events come over ZeroMQ;
    close() tells the coordinator (ApiAbort), which aborts the request on the engines."""

    def __init__(self, client: RemoteEngineClient, request_id: str) -> None:
        self._client, self._request_id = client, request_id
        self.queue: asyncio.Queue[ApiEvent] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RemoteTokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        e = await self.queue.get()
        self._done = e.finished
        return TokenEvent(token_ids=e.token_ids, num_prompt_tokens=e.num_prompt_tokens,
                          num_completion_tokens=e.num_completion_tokens, finished=e.finished,
                          finish_reason=e.finish_reason, error=e.error, rejected=e.rejected,
                          kv_transfer=e.kv_transfer, num_retries=e.num_retries, logprobs=e.logprobs,
                          prompt_logprobs=e.prompt_logprobs, num_cached_tokens=e.num_cached_tokens,
                          placement=e.placement)

    def close(self, reason: str = "abort") -> None:
        """Safe to call from a cancelled task: it never awaits."""
        if not self._done:
            self._done = True
            self._client.abort(self._request_id, reason)


class RemoteEngineClient(ServedInstances):
    """What the HTTP layer asks of an EngineClient, answered by the coordinator over ZeroMQ."""

    def __init__(self, hub_address: str, index: int, renderer: Renderer) -> None:
        self.index, self.renderer = index, renderer
        self.instances: dict[str, Instance] = {}
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity(index))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(hub_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCoordinator)
        self._ids = itertools.count()
        self._streams: dict[str, RemoteTokenStream] = {}
        self._submitted: dict[str, asyncio.Future] = {}
        self._forwards: dict[int, asyncio.Future] = {}
        self._has_instances = asyncio.Event()
        self._receiver: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        """Says hello and waits for the first view of the instances."""
        self._receiver = asyncio.create_task(self._receive_loop())
        await self.socket.send(self._encoder.encode(ApiHello(self.index, os.getpid())))
        await asyncio.wait_for(self._has_instances.wait(), timeout_s)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.socket.close()
        self.ctx.term()

    async def generate(self, client_request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       stop: list[str], priority: int = 0, slo_class: str = "") -> TextStream:
        request_id = str(next(self._ids))
        try:
            payload = self._encoder.encode(ApiSubmit(request_id, client_request_id, prompt_token_ids,
                                                     wire_params(params), priority, slo_class))
        except (OverflowError, msgspec.EncodeError) as e:  # as the dispatcher words it
            raise ValueError(f"a sampling parameter is out of range: {e}") from None
        stream = RemoteTokenStream(self, request_id)
        output_text = self.renderer.new_output_text(stop)
        self._streams[request_id] = stream
        answer = self._submitted[request_id] = asyncio.get_running_loop().create_future()
        try:
            self.socket.send(payload)
            submitted: ApiSubmitted = await answer
        except asyncio.CancelledError:  # the client left while the coordinator was deciding
            stream.close()
            raise
        finally:
            self._submitted.pop(request_id, None)
        if submitted.status:
            self._streams.pop(request_id, None)
            raise ApiError(submitted.status, submitted.message, submitted.error_type, submitted.param, submitted.code,
                           submitted.retry_after_s)
        return TextStream(stream, output_text)

    def abort(self, request_id: str, reason: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.socket.send(self._encoder.encode(ApiAbort(request_id, reason)))

    async def forward(self, request: Request) -> Response:
        """A route the coordinator owns (/admin/..., /metrics): asked there, answered as it answers."""
        forward_id = next(self._ids)
        reply = self._forwards[forward_id] = asyncio.get_running_loop().create_future()
        message = ApiForward(forward_id, request.method, request.url.path, request.url.query.encode(),
                             list(request.scope["headers"]), await request.body())
        try:
            self.socket.send(self._encoder.encode(message))
            answer: ApiForwardReply = await reply
        finally:
            self._forwards.pop(forward_id, None)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in answer.headers
                   if k.lower() != b"content-length"}
        return Response(answer.body, status_code=answer.status, headers=headers)

    async def _receive_loop(self) -> None:
        while True:
            try:
                message = self._decoder.decode(await self.socket.recv())
            except msgspec.DecodeError as e:
                log.warning("dropped a malformed message from the coordinator: %s", e)
                continue
            if isinstance(message, ApiEvents):
                for event in message.events:
                    stream = self._streams.get(event.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(event)
                        if event.finished:
                            del self._streams[event.request_id]
            elif isinstance(message, ApiSubmitted):
                future = self._submitted.get(message.request_id)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, ApiForwardReply):
                future = self._forwards.get(message.forward_id)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, ApiInstances):
                now = time.monotonic()
                self.instances = {i.hello.engine_id: Instance(i.hello, now, i.alive) for i in message.instances}
                self._has_instances.set()


def build_worker_app(client: RemoteEngineClient, args: argparse.Namespace) -> tuple[object, dict]:
    from splitserve.api.api_server import ApiServerHeader, build_openai_app, guarded

    app = build_openai_app(client, client.renderer)

    @app.api_route("/metrics", methods=["GET"])
    async def metrics(request: Request):
        return await client.forward(request)

    @app.api_route("/admin/{path:path}", methods=FORWARDED_METHODS)
    async def admin(request: Request):
        return await client.forward(request)

    guarded_app, limits = guarded(app, args)
    return ApiServerHeader(guarded_app, client.index), limits


async def serve_api(config: ApiProcessConfig, args: argparse.Namespace) -> None:
    import uvicorn

    from splitserve.api.render import load_renderer

    sock = listening_socket(args.host, config.port)
    renderer = await asyncio.to_thread(load_renderer, args.model, args.tool_call_parser)
    client = RemoteEngineClient(config.hub_address, config.index, renderer)
    try:
        await client.start()
        app, http_limits = build_worker_app(client, args)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, lifespan="off", access_log=False,
                                               timeout_graceful_shutdown=5, **http_limits))

        async def watch_parent() -> None:
            while os.getppid() == config.parent_pid:
                await asyncio.sleep(PARENT_CHECK_INTERVAL_S)
            log.error("API process %d: the coordinator is gone; exiting", config.index)
            server.should_exit = True

        watcher = asyncio.create_task(watch_parent())
        await server.serve(sockets=[sock])
        watcher.cancel()
    finally:
        client.close()
        sock.close()


def main() -> int:
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ApiProcessConfig)
    args = argparse.Namespace(**config.settings)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve_api(config, args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
