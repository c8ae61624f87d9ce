"""Bounds on what one HTTP request may send: body size and content type.

An ASGI middleware in front of the API: a body larger than `--max-request-bytes` gets a 413
JSON error without being kept past the limit (the declared Content-Length is checked first,
then the bytes actually received, for chunked uploads; what the client still sends is read
and dropped, bounded, so it can read the 413), and a POST whose declared content
type is not JSON gets 415. The body is not buffered here: the app reads it through a counting
receive channel (buffering and replaying it once broke the noticing of a client that leaves
mid-stream).
"""
from __future__ import annotations

import argparse
import asyncio

import msgspec
from fastapi import HTTPException

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# before a 413 that closes the connection, drop at most this many times the limit, for at most this long
LINGER_BYTES_FACTOR = 4
LINGER_S = 2.0


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest accepted HTTP request body; more gets 413 (default: "
                        f"{DEFAULT_MAX_REQUEST_BYTES // (1024 * 1024)} MiB)")


def check_limit_args(args: argparse.Namespace) -> None:
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


async def _send_error(send, status: int, message: str, code: str) -> None:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error",
                                          "param": None, "code": code}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class RequestLimitsMiddleware:
    def __init__(self, app, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 body_timeout_s: float | None = None) -> None:
        self.app, self.max_request_bytes = app, max_request_bytes
        self.body_timeout_s = body_timeout_s  # longest wait for the next piece of a body (slow uploads)

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's limit of {self.max_request_bytes} bytes; "
                f"send a smaller request (or start the server with a larger --max-request-bytes)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type")
        if content_type is not None and not _is_json(content_type):
            return await _send_error(send, 415, f"content type {content_type.decode('latin-1')!r} is not "
                                                f"supported; send JSON with 'Content-Type: application/json'",
                                     "unsupported_media_type")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _send_error(send, 400, "the Content-Length header is not a number", "bad_request")
        if declared > self.max_request_bytes:
            # the answer closes the connection: what the client is still sending is read and dropped
            # first (bounded), or the kernel resets the connection and the client may see that
            # instead of the 413 (make test, session 22: 'connection reset by peer' once in ten runs)
            await self._linger(receive)
            return await _send_error(send, 413, self._too_large(), "request_too_large")
        size, body_done = 0, False

        async def counting_receive():
            # The body passes through untouched; only its size is counted. A raised HTTPException
            # reaches the app's handler (FastAPI re-raises it from body parsing) as a JSON 413.
            # Once the body is complete, receive() waits for a disconnect and must not time out.
            nonlocal size, body_done
            if body_done or self.body_timeout_s is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.body_timeout_s)
                except TimeoutError:
                    raise HTTPException(408, f"the request body stalled for {self.body_timeout_s:g} s; "
                                             "send it without pauses") from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                size += len(message.get("body", b""))
                if size > self.max_request_bytes:
                    raise HTTPException(413, self._too_large())
            elif message["type"] == "http.disconnect":
                body_done = True
            return message

        # A 413 raised in counting_receive is the app's JSON answer, which keeps the connection: uvicorn
        # reads and drops the rest of the body itself, so nothing lingers here
        await self.app(scope, counting_receive, send)

    async def _linger(self, receive) -> None:
        """Before a 413 that closes the connection, for a body still arriving: read and drop what the
        client goes on sending, for a bounded time and amount, so it gets to read the answer. Closing
        at once with its bytes unread makes the kernel reset the connection, and the client sees
        'connection reset' instead of the 413 (nginx's lingering close does the same). Only before
        the answer is complete: after it, uvicorn's receive() reads a disconnect at once."""
        budget = LINGER_BYTES_FACTOR * self.max_request_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_S
        while budget > 0 and loop.time() < deadline:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            budget -= len(message.get("body", b""))
