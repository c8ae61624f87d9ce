"""Framing and authentication on the prefill side's control/data socket.

A frame is a 4-byte big-endian length and a msgpack-encoded `ControlMessage`; raw KV
bytes follow a `LayerHeader` unframed (the header says how many). Only msgspec structs and raw tensor bytes.

Handshake (mutual when a secret is configured), finished within a deadline (a peer sending a
byte every few seconds cannot hold a server thread):
    server -> Challenge(nonce, auth_required)
    client -> Hello(client_nonce, HMAC(secret, b"client" + nonce))
    server -> Welcome(HMAC(secret, b"server" + client_nonce))   or Reply(ok=False) and close

With a secret, every later frame and every run of raw KV bytes carries a 32-byte tag:
HMAC-SHA256 under a session key derived from the secret and both nonces, over the direction,
a per-direction sequence number and the bytes. A man in the middle can neither alter KV on
its way between hosts, nor replay, reorder or inject messages (it is not encrypted: KV
contents are visible on the path; use a private network or a tunnel where that matters).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

import msgspec

from splitserve.kv_transfer.config import is_loopback
from splitserve.kv_transfer.messages import Challenge, ControlMessage, Hello, Reply, Welcome
from splitserve.kv_transfer.transport import AuthError, NetworkError, PeerClosed, TransferError

MAX_FRAME_BYTES = 1 << 20  # headers are small; a bigger frame is a confused or hostile peer
_LENGTH = struct.Struct("!I")
_IOV_MAX = 512  # buffers per sendmsg/recvmsg_into (Linux allows 1024)
_TAG_BYTES = 32  # HMAC-SHA256


class Connection:
    """A blocking socket speaking framed messages; one per transfer or per peer."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout_s = timeout_s
        self._deadline: float | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self._key: bytes | None = None  # session key: every frame is tagged once it is set
        self._labels = (b"", b"")  # (what we send, what we receive)
        self._seq = [0, 0]

    def set_deadline(self, deadline: float | None) -> None:
        """Until `deadline` (time.monotonic()) every receive must be done; None: per-call timeout."""
        self._deadline = deadline
        if deadline is None:
            self.sock.settimeout(self.timeout_s)

    def start_session(self, key: bytes, is_server: bool) -> None:
        self._key = key
        self._labels = (b"s2c", b"c2s") if is_server else (b"c2s", b"s2c")

    def _tag(self, direction: int, parts) -> bytes:
        mac = hmac.new(self._key, self._labels[direction] + self._seq[direction].to_bytes(8, "big"),
                       hashlib.sha256)
        for part in parts:
            mac.update(part)
        self._seq[direction] += 1
        return mac.digest()

    def _send_tag(self, parts) -> None:
        if self._key is not None:
            self.sock.sendall(self._tag(0, parts))

    def _check_tag(self, parts) -> None:
        if self._key is None:
            return
        expected = self._tag(1, parts)
        tag = bytearray(_TAG_BYTES)
        self._fill(memoryview(tag))
        if not hmac.compare_digest(bytes(tag), expected):
            raise AuthError("a frame from the peer failed authentication (altered, replayed or "
                            "injected on the way); dropping the connection")

    def send(self, message: ControlMessage) -> None:
        payload = self._encoder.encode(message)
        tag = self._tag(0, (payload,)) if self._key is not None else b""
        self.sock.sendall(_LENGTH.pack(len(payload)) + payload + tag)

    def recv(self) -> ControlMessage:
        (length,) = _LENGTH.unpack(self._recv_exact(_LENGTH.size, at_boundary=True))
        if length > MAX_FRAME_BYTES:
            raise TransferError(f"peer sent a {length}-byte header (limit {MAX_FRAME_BYTES}); "
                                "is something other than splitserve on this port?")
        payload = self._recv_exact(length)
        self._check_tag((payload,))
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise TransferError(f"peer sent a malformed message: {exc}") from None

    def send_raw(self, data: memoryview) -> None:
        self.sock.sendall(data)
        self._send_tag((data,))

    def recv_raw_into(self, view: memoryview) -> None:
        self._fill(view)
        self._check_tag((view,))

    def _fill(self, view: memoryview, at_boundary: bool = False) -> None:
        received, total = 0, len(view)
        while received < total:
            if self._deadline is not None:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise NetworkError("the peer did not finish the handshake in time")
                self.sock.settimeout(min(remaining, self.timeout_s))
            n = self.sock.recv_into(view[received:], total - received)
            if n == 0:
                if at_boundary and received == 0:
                    raise PeerClosed("peer closed the connection")
                raise NetworkError("peer closed the connection in the middle of a message")
            received += n

    def send_views(self, views: list[memoryview]) -> None:
        """Send the views back to back in as few syscalls as the kernel allows."""
        pending, first = list(views), 0
        while first < len(pending):
            sent = self.sock.sendmsg(pending[first:first + _IOV_MAX])
            first = _advance(pending, first, sent)
        self._send_tag(views)

    def recv_into_views(self, views: list[memoryview]) -> None:
        """Fill the views in order (recvmsg_into scatters one read over many buffers)."""
        pending, first = list(views), 0
        while first < len(pending):
            received = self.sock.recvmsg_into(pending[first:first + _IOV_MAX])[0]
            if received == 0:
                raise NetworkError("peer closed the connection in the middle of a layer")
            first = _advance(pending, first, received)
        self._check_tag(views)

    def _recv_exact(self, n: int, at_boundary: bool = False) -> bytes:
        buf = bytearray(n)
        self._fill(memoryview(buf), at_boundary)
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _advance(views: list[memoryview], first: int, num_bytes: int) -> int:
    """Drop `num_bytes` from the front of views[first:]; returns the new first index."""
    while num_bytes:
        if num_bytes >= len(views[first]):
            num_bytes -= len(views[first])
            first += 1
        else:
            views[first] = views[first][num_bytes:]
            num_bytes = 0
    while first < len(views) and len(views[first]) == 0:
        first += 1
    return first


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _session_key(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_handshake(conn: Connection, secret: bytes | None, timeout_s: float) -> None:
    """Raises AuthError (after telling the peer why) if the peer cannot prove the secret, and
    NetworkError if it does not finish within timeout_s."""
    conn.set_deadline(time.monotonic() + timeout_s)
    nonce = os.urandom(16)
    conn.send(Challenge(nonce=nonce, auth_required=secret is not None))
    hello = conn.recv()
    if not isinstance(hello, Hello):
        raise AuthError(f"peer skipped the handshake (sent {type(hello).__name__})")
    if secret is not None and not hmac.compare_digest(hello.mac, _mac(secret, b"client", nonce)):
        conn.send(Reply(ok=False, error="authentication failed: wrong or missing kv secret"))
        raise AuthError("refused a peer that does not know the kv secret")
    conn.send(Welcome(mac=_mac(secret, b"server", hello.client_nonce) if secret else b""))
    conn.set_deadline(None)
    if secret is not None:
        conn.start_session(_session_key(secret, nonce, hello.client_nonce), is_server=True)


def client_handshake(conn: Connection, secret: bytes | None, timeout_s: float) -> None:
    conn.set_deadline(time.monotonic() + timeout_s)
    challenge = conn.recv()
    if not isinstance(challenge, Challenge):
        raise AuthError(f"peer did not start a handshake (sent {type(challenge).__name__})")
    if challenge.auth_required and secret is None:
        raise AuthError("the prefill instance requires a kv secret; start this instance with "
                        "the same --kv-secret-file")
    if secret is not None and not challenge.auth_required:
        raise AuthError("a kv secret is configured here but the prefill instance does not "
                        "authenticate; refusing to talk to it (configure the secret on both)")
    client_nonce = os.urandom(16)
    conn.send(Hello(client_nonce=client_nonce,
                    mac=_mac(secret, b"client", challenge.nonce) if secret else b""))
    answer = conn.recv()
    if isinstance(answer, Reply) and not answer.ok:
        raise AuthError(f"prefill instance refused us: {answer.error}")
    if not isinstance(answer, Welcome):
        raise AuthError(f"unexpected {type(answer).__name__} during the handshake")
    if secret is not None and not hmac.compare_digest(answer.mac,
                                                      _mac(secret, b"server", client_nonce)):
        raise AuthError("the prefill instance could not prove it knows the kv secret")
    conn.set_deadline(None)
    if secret is not None:
        conn.start_session(_session_key(secret, challenge.nonce, client_nonce), is_server=False)


def connect(host: str, port: int, secret: bytes | None, connect_timeout_s: float,
            io_timeout_s: float, handshake_timeout_s: float | None = None) -> Connection:
    if secret is None and not is_loopback(host):
        raise AuthError(f"the prefill instance at {host} is not on this host and no kv secret is "
                        "configured: KV would cross the network unauthenticated; give both sides "
                        "--kv-secret-file")
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as exc:
        raise NetworkError(f"cannot reach the prefill instance at {host}:{port}: {exc}") from None
    conn = Connection(sock, io_timeout_s)
    try:
        client_handshake(conn, secret, handshake_timeout_s or connect_timeout_s)
    except OSError as exc:
        conn.close()
        raise NetworkError(f"handshake with {host}:{port} failed: {exc}") from None
    except BaseException:
        conn.close()
        raise
    return conn
