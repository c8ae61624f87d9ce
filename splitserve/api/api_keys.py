"""Who may call the HTTP API: API keys (`--api-key KEY` / `--api-key-file FILE`, as in vLLM).

Every route needs `Authorization: Bearer KEY` except the ones monitoring scrapes without
credentials, `GET /health` and `GET /metrics` (they reveal liveness and counters, never text).
A missing or wrong key gets OpenAI's 401 JSON error. Keys are compared in constant time.
"""
from __future__ import annotations

import argparse
import hmac
from pathlib import Path

import msgspec

OPEN_ROUTES = frozenset({("GET", "/health"), ("GET", "/metrics")})


def add_api_key_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but GET /health and "
                        "GET /metrics (repeatable: several keys)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="like --api-key, one key per line, kept out of `ps`")


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """Raises ValueError naming the flag when a key is unusable."""
    keys = list(args.api_key or [])
    if args.api_key_file is not None:
        try:
            text = Path(args.api_key_file).read_text()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip()]
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key; write one key per line")
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ValueError("--api-key: a key must be non-empty and contain no whitespace")
    return keys


def _unauthorized(message: str) -> tuple[dict, bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}
    headers = {"content-type": "application/json", "www-authenticate": 'Bearer realm="splitserve"'}
    return headers, msgspec.json.encode(body)


class ApiKeyMiddleware:
    """ASGI middleware: 401 unless the request carries one of the keys (open routes excepted)."""

    def __init__(self, app, keys: list[str], exempt_prefix: str | None = None) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self._keys = [k.encode() for k in keys]
        self._exempt_prefix = exempt_prefix  # routes guarded by another credential (the admin key)

    def _authorized(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # check every key (no early exit) so the time taken says nothing about which one matched
        return sum(hmac.compare_digest(token, k) for k in self._keys) > 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_ROUTES or (
                self._exempt_prefix and scope["path"].startswith(self._exempt_prefix)):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization")
        if self._authorized(header):
            return await self.app(scope, receive, send)
        why = "no API key given" if header is None else "the API key is not valid"
        headers, body = _unauthorized(f"{why}: send 'Authorization: Bearer <key>' with the key the "
                                      "server was started with (--api-key)")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        await send({"type": "http.response.body", "body": body})
