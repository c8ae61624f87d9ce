"""The prefill side's socket: answers decode instances about held blocks and streams them.

One listening socket per prefill instance (loopback unless configured otherwise), one
thread per connected peer, at most `max_peers` of them (more are closed on accept). Each
peer finishes the handshake within `handshake_timeout_s` (authenticating when a secret is
set; every later frame is then tagged, see wire.py), then sends requests, each answered
before the next. Every request carries the transfer's access token from its descriptor
(random, 16 bytes): without it a local process cannot touch another request's KV even
when no secret is set.

    Begin(request_id)   -> Reply(block_ids, num_tokens)  or Reply(ok=False, error)
    Fetch(request_id, first_block) -> per layer: LayerHeader + that layer's blocks
                           [first_block:] as raw bytes
                           (tcp transport; shm readers copy from the shared pool instead)
    Fetch(request_id, first_block, streamed=True) -> overlap mode: rounds of BlockRange + the
                           layers of the blocks the prefill finished since the last round (a
                           keepalive range of 0 blocks every KEEPALIVE_S), then StreamEnd(first token)
    Confirm(request_id) -> Reply: ok only if the blocks were held the whole time
    Abort(request_id)   -> Reply(ok=True): free now instead of at lease expiry

The ownership decisions are KVSender's; this module only moves messages and bytes.
"""
from __future__ import annotations

import logging
import socket
import threading

from splitserve.kv_transfer.block_bytes import has_byte_views, id_runs, layer_views, pool_bytes
from splitserve.kv_transfer.host_staging import byte_view, staging_buffer
from splitserve.kv_transfer.messages import (Abort, Begin, BlockRange, Confirm, Fetch, LayerHeader, Reply,
                                             StreamEnd)
from splitserve.kv_transfer.sender import KVSender
from splitserve.kv_transfer.transport import AuthError, PeerClosed, TransferError, block_index
from splitserve.kv_transfer.wire import Connection, server_handshake

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # well under the puller's io_timeout_s: a prompt queued behind others is not a dead peer


class KVServer:
    def __init__(self, sender: KVSender, advertise_host: str | None = None):
        self.sender = sender
        self.config = sender.config
        self._advertise_host = advertise_host
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._peers: set[Connection] = set()
        self._peers_lock = threading.Lock()
        self.num_refused_peers = 0

    def start(self) -> tuple[str, int]:
        if self.config.host in ("0.0.0.0", "::", "") and not self._advertise_host:
            raise ValueError(f"kv host {self.config.host!r} listens everywhere but is no address "
                             "a decode instance can dial; pass advertise_host (this machine's "
                             "address as the decode instances see it)")
        listener = socket.create_server((self.config.host, self.config.port), backlog=64)
        listener.settimeout(0.2)  # so the accept loop notices close()
        self._listener = listener
        host, port = listener.getsockname()[:2]
        advertised = self._advertise_host or host
        self.sender.set_address(advertised, port)
        accept = threading.Thread(target=self._accept_loop, name="kv-server-accept", daemon=True)
        accept.start()
        self._threads.append(accept)
        return advertised, port

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._peers_lock:
            for conn in self._peers:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> "KVServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed
            with self._peers_lock:
                full = len(self._peers) >= self.config.max_peers
            if full:
                self.num_refused_peers += 1
                sock.close()
                continue
            conn = Connection(sock, self.config.io_timeout_s)
            thread = threading.Thread(target=self._serve_peer, args=(conn,),
                                      name="kv-server-peer", daemon=True)
            with self._peers_lock:
                self._peers.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve_peer(self, conn: Connection) -> None:
        try:
            server_handshake(conn, self.config.secret, self.config.handshake_timeout_s)
            while not self._stop.is_set():
                self._answer(conn, conn.recv())
        except AuthError as exc:
            self.num_refused_peers += 1
            log.warning("kv peer refused: %s", exc)
        except PeerClosed:
            log.debug("kv peer hung up")  # every client does this when it is done
        except TransferError as exc:
            log.info("kv peer dropped: %s", exc)
        except (OSError, EOFError):
            pass  # peer went away; its holds expire or were confirmed
        finally:
            with self._peers_lock:
                self._peers.discard(conn)
            conn.close()

    def _answer(self, conn: Connection, message) -> None:
        sender = self.sender
        if isinstance(message, Begin):
            conn.send(sender.peer_begin(message.request_id, message.token))
        elif isinstance(message, Confirm):
            conn.send(sender.peer_confirm(message.request_id, message.token))
        elif isinstance(message, Abort):
            conn.send(sender.peer_abort(message.request_id, message.token))
        elif isinstance(message, Fetch) and message.streamed:
            self._stream_as_ready(conn, message.request_id, message.token, message.first_block)
        elif isinstance(message, Fetch):
            self._stream(conn, message.request_id, message.token, message.first_block)
        else:
            conn.send(Reply(ok=False, error=f"unexpected {type(message).__name__}"))

    def _stream(self, conn: Connection, request_id: str, token: bytes, first_block: int) -> None:
        reply = self.sender.peer_begin(request_id, token)
        if not reply.ok:
            conn.send(reply)
            return
        if not 0 <= first_block <= len(reply.block_ids):
            conn.send(Reply(ok=False, error=f"first_block {first_block} is outside the "
                                            f"{len(reply.block_ids)} blocks of {request_id!r}"))
            return
        self._send_blocks(conn, reply.block_ids[first_block:])

    def _stream_as_ready(self, conn: Connection, request_id: str, token: bytes, first_block: int) -> None:
        """Overlap mode: each round sends the blocks the prefill finished since the last one (a
        BlockRange, then every layer of them), a keepalive while none are new, and StreamEnd with
        the first token once the prompt is done."""
        reply = self.sender.peer_begin(request_id, token)
        if not reply.ok:
            conn.send(reply)
            return
        sent = first_block
        while not self._stop.is_set():
            state = self.sender.wait_ready(request_id, token, sent, KEEPALIVE_S)
            if state is None:
                conn.send(self.sender.peer_begin(request_id, token))  # the reason it is gone
                return
            ready, first_token_ids = state
            conn.send(BlockRange(sent, max(ready - sent, 0)))
            if ready > sent:
                self._send_blocks(conn, reply.block_ids[sent:ready])
                sent = ready
            if first_token_ids is not None and sent >= len(reply.block_ids):
                conn.send(StreamEnd(first_token_ids))
                return

    def _send_blocks(self, conn: Connection, block_ids: list[int]) -> None:
        kv = self.sender.kv  # [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]
        # Reading without the lock is safe: if the hold ends meanwhile, the peer's Confirm
        # fails and it discards what it read.
        if has_byte_views(kv):
            raw, runs = pool_bytes(kv), id_runs(block_ids)
            for layer in range(kv.shape[0]):
                views = layer_views(raw, tuple(kv.shape), kv.element_size(), layer, runs)
                conn.send(LayerHeader(layer=layer, num_bytes=sum(len(v) for v in views)))
                conn.send_views(views)
            return
        index = block_index(block_ids, kv.device)
        staging = staging_buffer(kv, len(block_ids))  # [2, kv_heads, n, block_size, head_dim], pinned for CUDA
        raw = byte_view(staging)
        for layer in range(kv.shape[0]):  # a GPU pool: gather each layer on the device, stage it on the host
            staging.copy_(kv[layer].index_select(2, index))  # returns once the bytes are on the host
            conn.send(LayerHeader(layer=layer, num_bytes=raw.nbytes))
            conn.send_raw(raw)
