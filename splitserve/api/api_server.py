"""The OpenAI-compatible HTTP API (FastAPI): routes, request ids and error bodies.

Every error leaves as OpenAI's `{"error": {"message", "type", "param", "code"}}`: pydantic
validation failures and malformed JSON become 400, unknown routes keep their 404/405, and a
catch-all turns anything unexpected into a logged JSON 500 — but validation comes first, so
user input never gets that far.
"""
from __future__ import annotations

import argparse
import logging
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.coordinator.adaptive import AdaptiveMix
from splitserve.api.admin import SpawnEngine, add_admin_routes, add_mix_routes
from splitserve.api.api_keys import ApiKeyMiddleware, api_keys_from_args
from splitserve.api.engine_client import EngineClient
from splitserve.api.http_guard import (ADMIN_PREFIX, HttpGuardMiddleware, http_guard_from_args,
                                            uvicorn_limits)
from splitserve.api.instance_budget import InstanceBudget
from splitserve.api.limits import RequestLimitsMiddleware
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.api.openai_schema import (ApiError, ChatCompletionRequest, CompletionRequest,
                                               DetokenizeRequest, TokenizeRequest)
from splitserve.api.render import Renderer, RenderError
from splitserve.api.serving import OpenAIServing

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    param = ".".join(loc) or None
    where = f"{param}: " if param else "body: "
    return ApiError(400, f"{where}{first.get('msg', 'invalid value')}", param=param)


def build_server_app(client: EngineClient, metrics: FrontendMetrics, spawn_engine: SpawnEngine | None,
                     args: argparse.Namespace, mix: AdaptiveMix | None = None,
                     coordinator_restart=None, restart_engines=None) -> tuple[object, dict]:
    """The app `serve` runs, inside its guards (outermost first: Host + admin gate, API key, body
    limits), and the uvicorn.Config keywords for connection limits. ValueError on a bad flag.
    restart_engines: how a rolling restart ends an old engine (coordinator/rolling_restart.py)."""
    if spawn_engine is not None:
        guard = http_guard_from_args(args, api_keys_from_args(args))
        spawn_engine = InstanceBudget(spawn_engine, client, guard.max_instances,
                                      startup_timeout_s=args.startup_timeout)
    return guarded(build_app(client, client.renderer, metrics, spawn_engine, mix, coordinator_restart,
                             restart_engines), args)


def guarded(app, args: argparse.Namespace) -> tuple[object, dict]:
    api_keys = api_keys_from_args(args)
    guard = http_guard_from_args(args, api_keys)
    app = RequestLimitsMiddleware(app, args.max_request_bytes, body_timeout_s=guard.timeout_request_headers)
    if api_keys:
        app = ApiKeyMiddleware(app, api_keys, exempt_prefix=ADMIN_PREFIX if guard.admin_keys else None)
    return HttpGuardMiddleware(app, guard), uvicorn_limits(guard)


def build_app(client: EngineClient, renderer: Renderer, metrics: FrontendMetrics,
              spawn_engine: SpawnEngine | None = None, mix: AdaptiveMix | None = None,
              coordinator_restart=None, restart_engines=None) -> FastAPI:
    app = build_openai_app(client, renderer)
    add_admin_routes(app, client, spawn_engine, coordinator_restart, restart_engines)
    add_mix_routes(app, mix)

    @app.get("/metrics")
    async def metrics_endpoint():
        for inst_id, load in client.router.instances.items():
            metrics.outstanding.labels(inst_id, load.role).set(load.outstanding_tokens)
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def build_openai_app(client, renderer: Renderer) -> FastAPI:
    """The routes every API process serves; client is an EngineClient or, in an API process of
    `serve --api-server-count N`, an api_worker.RemoteEngineClient."""
    app = FastAPI(title="splitserve", version="0.1.0")
    serving = OpenAIServing(client, renderer)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return exc.response(request.headers.get("x-request-id"))

    @app.exception_handler(RenderError)
    async def on_render_error(request: Request, exc: RenderError):
        return ApiError(400, str(exc), param=exc.param).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}", "server_error").body(),
                            status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request_id_of(request), request.receive)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completion(body, request_id_of(request), request.receive)

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest):
        serving.check_model(body.model)
        text, token_ids = await serving.render_chat(body)
        return {"prompt": text, "prompt_token_ids": token_ids, "count": len(token_ids)}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            _, tokens = await serving.render_chat(body)
        else:
            tokens = await serving.tokenize(body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": client.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        serving.check_token_ids(body.tokens, "tokens")
        return {"prompt": await serving.detokenize(body.tokens)}

    @app.get("/v1/models")
    async def models():
        serving.check_model(None)
        return {"object": "list", "data": [{
            "id": client.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "splitserve", "root": client.model_name, "max_model_len": client.max_model_len}]}

    @app.get("/health")
    async def health():
        live = client.live_instances()
        body = {"status": "ok" if live else "no_engine", "instances_alive": len(live),
                "instances": [{"id": engine_id, "role": inst.hello.role, "alive": inst.alive,
                               "pid": inst.hello.pid} for engine_id, inst in client.instances.items()]}
        return JSONResponse(body, status_code=200 if live else 503)

    return app


class ApiServerHeader:
    """ASGI: `X-Splitserve-Api-Server: <index>` on every answer of a server with several API
    processes, so a client (and the tests) can see which process served it."""

    def __init__(self, app, index: int) -> None:
        self.app, self._header = app, (b"x-splitserve-api-server", str(index).encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
