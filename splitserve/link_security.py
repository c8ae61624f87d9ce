"""Who may talk on an engine link: a shared secret on off-host links. Both sides import this
(the coordinator's engine link, engine/process.py, cluster/); it sits beside the wire structs
(protocol.py). API keys on HTTP are the API's: api/api_keys.py.

Engine links (`--engine-secret-file FILE`): the frontend's ROUTER socket becomes a CurveZMQ
server and engines CurveZMQ clients. Both key pairs are derived from the shared secret, so a
peer that does not hold it cannot even complete the handshake (it does not know the server's
public key), and the ZAP handler additionally admits only the secret's client key. An engine
address reachable from other machines without a secret is refused at startup, on both sides:
otherwise anyone there could submit work, read answers, or shut engines down.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth.thread

from splitserve.kv_transfer.config import is_loopback

log = logging.getLogger("splitserve.security")

MIN_SECRET_BYTES = 16


# ---- engine links: CurveZMQ keys from a shared secret ----------------------------------------

def add_engine_link_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-secret-file", type=Path, default=None,
                   help="shared secret of the frontend<->engine link (CurveZMQ); required when the "
                        "engine address is not loopback. Create one with `openssl rand -hex 32 > FILE`")


def endpoint_host(address: str) -> str | None:
    """The host of a ZeroMQ tcp:// endpoint; None for local-only transports (ipc://, inproc://)."""
    parts = urlsplit(address)
    if parts.scheme != "tcp":
        return None
    host = parts.netloc.rsplit(":", 1)[0].strip("[]")
    return host


def engine_address_is_local(address: str) -> bool:
    host = endpoint_host(address)
    return host is None or is_loopback(host)


class EngineLinkSecurity:
    """CurveZMQ for the frontend<->engine sockets; one shared secret yields both key pairs."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"--engine-secret-file: the secret has {len(secret)} bytes; use at least "
                             f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > FILE`)")
        if not zmq.has("curve"):
            raise ValueError("--engine-secret-file: this libzmq has no CURVE support")
        self.server_secret, self.server_public = self._key_pair(secret, b"server")
        self.client_secret, self.client_public = self._key_pair(secret, b"client")
        self._authenticator: zmq.auth.thread.ThreadAuthenticator | None = None

    @staticmethod
    def _key_pair(secret: bytes, who: bytes) -> tuple[bytes, bytes]:
        raw = hmac.new(secret, b"splitserve engine link " + who, hashlib.sha256).digest()  # 32 bytes
        secret_z85 = zmq.utils.z85.encode(raw)
        return secret_z85, zmq.curve_public(secret_z85)

    def secure_server(self, socket: zmq.Socket, context: zmq.Context) -> None:
        """Before bind: only peers holding the secret's client key get through."""
        # A shadow shares the underlying context (and so its ZAP endpoint) even when `context`
        # is an asyncio context, whose sockets the authenticator thread could not use.
        auth = zmq.auth.thread.ThreadAuthenticator(zmq.Context.shadow(context.underlying))
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=self)
        self._authenticator = auth
        socket.curve_server = True
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP credentials provider (called by the authenticator thread)."""
        ok = hmac.compare_digest(client_key, self.client_public)  # both z85
        if not ok:
            log.warning("refused an engine connection with an unknown CURVE key")
        return ok

    def secure_client(self, socket: zmq.Socket) -> None:
        """Before connect."""
        socket.curve_serverkey = self.server_public
        socket.curve_secretkey = self.client_secret
        socket.curve_publickey = self.client_public

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def engine_link_from_args(args: argparse.Namespace, address: str, flag: str) -> EngineLinkSecurity | None:
    """The link security for `address` (given as `flag`); ValueError when off-host without a secret."""
    if args.engine_secret_file is None:
        if not engine_address_is_local(address):
            raise ValueError(f"{flag} {address} is reachable from other machines: without a shared secret "
                             "anyone there could submit requests, read answers or stop engines; give "
                             "--engine-secret-file FILE (same file on every side) or use a 127.0.0.1 address")
        return None
    try:
        secret = Path(args.engine_secret_file).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"--engine-secret-file: cannot read {args.engine_secret_file}: {e.strerror}") from None
    return EngineLinkSecurity(secret)
