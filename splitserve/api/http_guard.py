"""Who may reach which HTTP route, and how long a connection may idle: the server's front door.

    client --Host check--> admin gate (/admin/*) --API key (security.py)--> body limits --> app

- Host checking (DNS rebinding): a page on evil.example whose name is re-pointed at 127.0.0.1
  makes the victim's browser talk to a loopback server with `Host: evil.example`. A server bound
  to loopback therefore accepts only Host localhost, 127.0.0.1 or [::1] (any port) plus the
  names given with `--allowed-hosts`; a server bound elsewhere checks Host only when
  `--allowed-hosts` is given. A request without a Host header (HTTP/1.0 tools) passes:
  browsers always send one.
- The admin API (`/admin/*` starts and drains engines) has its own credential:
  `--admin-key-file FILE`, sent as `Authorization: Bearer <admin key>`; the API key does not
  open it. Without an admin key the admin API is served only by a server that is open anyway
  (no API key) and bound to loopback; otherwise it answers 403 and says how to enable it
  (like vLLM's development-only endpoints: off unless asked for on an exposed server).
- Connections: uvicorn's `--limit-concurrency` (503 beyond it), keep-alive timeout, and a
  header timeout uvicorn lacks (a connection that never finishes its request headers was
  held open forever; a few thousand exhaust the process's file descriptors), plus a cap on
  open connections (more are closed at once).
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import resource
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve.kv_transfer.config import is_loopback

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ADMIN_PREFIX = "/admin/"


def add_http_guard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-key-file", type=Path, default=None,
                   help="file holding the admin key: /admin/* then needs 'Authorization: Bearer <admin key>' "
                        "(the API key does not open it). Without it, /admin/* is refused whenever --api-key "
                        "is set or --host is not loopback")
    p.add_argument("--allowed-hosts", action="append", default=None,
                   help="Host header names accepted besides localhost/127.0.0.1/[::1] (comma-separated, "
                        "repeatable); a loopback server refuses any other Host (DNS rebinding)")
    p.add_argument("--max-instances", type=int, default=8,
                   help="most engine instances alive or starting; POST /admin/instances beyond it gets 409 "
                        "(it is also refused with 503 when the new engine would not fit in free memory)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="most HTTP connections and in-flight requests; more get 503 (default: half the "
                        "file-descriptor limit, at most 2048)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--timeout-request-headers", type=float, default=15.0,
                   help="seconds a connection may take to send a request's headers (and each piece of "
                        "its body); slower ones are closed")


@dataclass(slots=True)
class HttpGuard:
    host: str = "127.0.0.1"  # the address the server binds
    api_keys: list[str] = field(default_factory=list)
    admin_keys: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    max_instances: int = 8
    limit_concurrency: int = 1024
    timeout_keep_alive: float = 5.0
    timeout_request_headers: float = 15.0

    def __post_init__(self) -> None:
        if self.max_instances < 1:
            raise ValueError(f"--max-instances must be >= 1, got {self.max_instances}")
        if self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")
        for name in ("timeout_keep_alive", "timeout_request_headers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        self.allowed_hosts = [h.strip().lower().strip("[]") for h in self.allowed_hosts if h.strip()]

    @property
    def checks_host(self) -> bool:
        return is_loopback(self.host) or bool(self.allowed_hosts)

    def host_allowed(self, header: bytes | None) -> bool:
        if header is None or not self.checks_host:
            return True
        name = header.decode("latin-1").strip().lower()
        if name.startswith("["):  # [::1]:8000
            name = name[1:].split("]", 1)[0]
        elif name.count(":") == 1:
            name = name.split(":", 1)[0]
        return name in LOOPBACK_NAMES or name in self.allowed_hosts

    @property
    def admin_open_without_key(self) -> bool:
        return not self.admin_keys and not self.api_keys and is_loopback(self.host)


def default_limit_concurrency() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(2048, soft // 2))


def http_guard_from_args(args: argparse.Namespace, api_keys: list[str]) -> HttpGuard:
    """Raises ValueError naming the flag when a setting cannot work."""
    admin_keys = []
    if args.admin_key_file is not None:
        try:
            text = Path(args.admin_key_file).read_text()
        except OSError as e:
            raise ValueError(f"--admin-key-file: cannot read {args.admin_key_file}: {e.strerror}") from None
        admin_keys = [line.strip() for line in text.splitlines() if line.strip()]
        if not admin_keys or any(any(c.isspace() for c in k) or len(k) < 16 for k in admin_keys):
            raise ValueError(f"--admin-key-file {args.admin_key_file}: write one key per line, each at least "
                             "16 characters without spaces (e.g. `openssl rand -hex 32`)")
        if set(admin_keys) & set(api_keys):
            raise ValueError("--admin-key-file: an admin key must differ from every --api-key")
    hosts = [h for value in (args.allowed_hosts or []) for h in value.split(",")]
    return HttpGuard(host=args.host, api_keys=list(api_keys), admin_keys=admin_keys, allowed_hosts=hosts,
                     max_instances=args.max_instances,
                     limit_concurrency=args.limit_concurrency or default_limit_concurrency(),
                     timeout_keep_alive=args.timeout_keep_alive,
                     timeout_request_headers=args.timeout_request_headers)


async def send_json_error(send, status: int, message: str, code: str, type_: str = "invalid_request_error",
                          headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": body})


class HttpGuardMiddleware:
    """ASGI: the Host check on every route, then the admin gate on /admin/*."""

    def __init__(self, app, guard: HttpGuard) -> None:
        self.app, self.guard = app, guard
        self._admin_keys = [k.encode() for k in guard.admin_keys]

    def _admin_key_ok(self, header: bytes | None) -> bool:
        scheme, _, token = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return sum(hmac.compare_digest(token.strip(), k) for k in self._admin_keys) > 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self.guard.host_allowed(headers.get(b"host")):
            return await send_json_error(
                send, 400, f"Host {headers[b'host'].decode('latin-1')!r} is not served here; use localhost or "
                           "127.0.0.1, or start the server with --allowed-hosts NAME", "invalid_host")
        if not scope["path"].startswith(ADMIN_PREFIX):
            return await self.app(scope, receive, send)
        if self._admin_keys:
            if self._admin_key_ok(headers.get(b"authorization")):
                return await self.app(scope, receive, send)
            return await send_json_error(send, 401, "the admin API needs 'Authorization: Bearer <admin key>' "
                                                    "with a key from the server's --admin-key-file",
                                         "invalid_admin_key", headers=[(b"www-authenticate", b'Bearer realm="admin"')])
        if self.guard.admin_open_without_key:
            return await self.app(scope, receive, send)
        return await send_json_error(send, 403, "the admin API is off on a server with an API key or a "
                                                "non-loopback --host; start it with --admin-key-file FILE and "
                                                "send 'Authorization: Bearer <admin key>'", "admin_disabled")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request headers and a cap on connections."""

    timeout_request_headers = 15.0
    max_connections = 2048

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            transport.close()  # the kernel already accepted it; closing is all that is left
            return
        self._arm_headers_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        in_request = self.cycle is not None and not self.cycle.response_complete
        if in_request:
            self._cancel_headers_timer()
        elif self._headers_timer is None:  # a next request's headers began after a keep-alive pause
            self._arm_headers_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_headers_timer()  # the keep-alive timeout takes over

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_headers_timer()
        super().connection_lost(exc)

    def _arm_headers_timer(self) -> None:
        self._headers_timer = self.loop.call_later(self.timeout_request_headers, self._headers_too_slow)

    def _cancel_headers_timer(self) -> None:
        if getattr(self, "_headers_timer", None) is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_too_slow(self) -> None:
        self._headers_timer = None
        if not (self.cycle is not None and not self.cycle.response_complete):
            self.transport.close()


def uvicorn_limits(guard: HttpGuard) -> dict:
    """Keyword arguments for uvicorn.Config."""
    protocol = type("GuardedH11", (GuardedH11Protocol,), {
        "timeout_request_headers": guard.timeout_request_headers,
        "max_connections": guard.limit_concurrency + 64})  # room to answer the excess with a 503
    return {"http": protocol, "limit_concurrency": guard.limit_concurrency,
            "timeout_keep_alive": guard.timeout_keep_alive}
