"""The prefill side of the connector: who owns a finished prompt's blocks, and until when.

A request's path on a prefill instance, once its prefill ends:

    register(request_id, block_ids, num_tokens)   engine thread -> a TransferDescriptor for
        the frontend to hand to a decode instance; the blocks are now HELD under a lease.
    open / advance / complete                       overlap mode, engine thread: a hold made
        after the prompt's first chunk (a `streamed` descriptor), its ready tokens advanced
        after every chunk, completed with the first token; the server streams blocks as they
        become ready (wait_ready) and the first token last.
    peer_begin / peer_confirm / peer_abort          server thread (or the fake transport):
        the decode side asks for the block ids, confirms receipt, or gives up.
    poll()                                          engine thread, once per step: returns the
        holds that ended (confirmed, lease expired) so the block manager frees them.
    abort(request_id)                               engine thread: the client went away; the
        blocks are returned at once.

Only the engine thread touches the block manager: everything here hands block ids back
to it instead of freeing them itself.
"""
from __future__ import annotations

import enum
import hmac
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import torch

from splitserve.kv_transfer import layout
from splitserve.kv_transfer.config import KVTransferConfig
from splitserve.kv_transfer.messages import Reply, SourceInfo, TransferDescriptor
from splitserve.kv_transfer.shm_pool import dtype_name


class ReleaseReason(str, enum.Enum):
    CONFIRMED = "confirmed"  # the decode side has its copy
    EXPIRED = "expired"  # nobody pulled in time
    ABORTED = "aborted"  # the client, the frontend or the decode side gave up


@dataclass(slots=True)
class Release:
    """Blocks the engine may free now."""

    request_id: str
    block_ids: list[int]
    reason: ReleaseReason


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    num_tokens: int
    deadline: float
    token: bytes = b""
    confirmed: bool = False
    aborted_by_peer: bool = False
    num_begins: int = 0
    ready_tokens: int = -1  # streamed: tokens whose KV is final so far; -1: all (a complete hold)
    first_token_ids: list[int] | None = None  # streamed: set by complete()


@dataclass(slots=True)
class SenderStats:
    num_registered: int = 0
    num_confirmed: int = 0
    num_lease_expiries: int = 0
    num_aborted: int = 0
    num_held: int = 0  # requests whose blocks wait for a decode instance right now
    num_held_blocks: int = 0


class KVSender:
    def __init__(self, config: KVTransferConfig, kv: torch.Tensor, instance_id: str,
                 shm_name: str = "", clock: Callable[[], float] = time.monotonic):
        """kv: this instance's pool [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]."""
        if config.transport == "shm" and kv.device.type != "cpu":
            raise ValueError(f"kv transport 'shm' hands over a pool in host shared memory, and this one is on "
                             f"{kv.device}; use --kv-transport tcp (a device pool is staged through pinned "
                             "host buffers)")
        if config.transport == "shm" and not shm_name:
            raise ValueError("kv transport 'shm' needs the pool in shared memory: allocate it "
                             "with allocate_kv_pool and pass its name as shm_name")
        self.config = config
        self.kv = kv
        self.instance_id = instance_id
        self.block_size = layout.block_size(tuple(kv.shape))
        self._shm_name = shm_name
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a streamed hold advanced or ended
        self._holds: dict[str, _Hold] = {}
        self._stats = SenderStats()
        self._address = (config.host, config.port)

    def set_address(self, host: str, port: int) -> None:
        """Called by KVServer once it is bound (port 0 means 'pick one')."""
        self._address = (host, port)

    @property
    def source_info(self) -> SourceInfo:
        host, port = self._address
        return SourceInfo(instance_id=self.instance_id, transport=self.config.transport,
                          kv_shape=tuple(self.kv.shape), dtype=dtype_name(self.kv.dtype),
                          host=host, port=port, shm_name=self._shm_name)

    # --- engine thread -------------------------------------------------------------------

    def register(self, request_id: str, block_ids: list[int], num_tokens: int) -> TransferDescriptor:
        num_blocks = math.ceil(num_tokens / self.block_size)
        if num_tokens <= 0 or len(block_ids) < num_blocks:
            raise ValueError(f"request {request_id!r}: {num_tokens} tokens need {num_blocks} "
                             f"blocks of {self.block_size}, got {len(block_ids)} block ids")
        with self._lock:
            if request_id in self._holds:
                raise ValueError(f"request {request_id!r} already has blocks held for transfer")
            token = secrets.token_bytes(16)
            self._holds[request_id] = _Hold(list(block_ids[:num_blocks]), num_tokens,
                                            self._clock() + self.config.lease_s, token)
            self._stats.num_registered += 1
        return TransferDescriptor(self.source_info, request_id, num_tokens, num_blocks, token)

    def open(self, request_id: str, block_ids: list[int], num_tokens: int) -> TransferDescriptor:
        """A streamed hold: the prompt's blocks are allocated, their KV not all computed yet."""
        descriptor = self.register(request_id, block_ids, num_tokens)
        with self._lock:
            self._holds[request_id].ready_tokens = 0
        return msgspec.structs.replace(descriptor, streamed=True)

    def advance(self, request_id: str, ready_tokens: int) -> bool:
        """The KV of the first `ready_tokens` tokens is final; False if the hold is gone."""
        with self._changed:
            hold = self._holds.get(request_id)
            if hold is None or hold.ready_tokens < 0:
                return False
            hold.ready_tokens = max(hold.ready_tokens, min(ready_tokens, hold.num_tokens))
            hold.deadline = self._clock() + self.config.lease_s  # alive while the prompt advances
            self._changed.notify_all()
            return True

    def complete(self, request_id: str, first_token_ids: list[int]) -> bool:
        """The prompt is done: every block is final and the first token known."""
        with self._changed:
            hold = self._holds.get(request_id)
            if hold is None or hold.ready_tokens < 0 or hold.aborted_by_peer or self._clock() >= hold.deadline:
                return False  # the decode side gave up (or never came): hand over afresh
            hold.ready_tokens, hold.first_token_ids = hold.num_tokens, list(first_token_ids)
            hold.deadline = self._clock() + self.config.lease_s
            self._changed.notify_all()
            return True

    def wait_ready(self, request_id: str, token: bytes, num_sent_blocks: int,
                   timeout_s: float) -> tuple[int, list[int] | None] | None:
        """Server thread, streamed hold: (blocks ready, first token or None) once more than
        `num_sent_blocks` are ready, the hold is complete, or `timeout_s` passed; None if the
        hold is gone. A partly filled last block is ready only when the hold is complete."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                hold = self._live_hold(request_id, token)
                if hold is None:
                    return None
                complete = hold.first_token_ids is not None
                ready = len(hold.block_ids) if complete else hold.ready_tokens // self.block_size
                left = deadline - time.monotonic()
                if ready > num_sent_blocks or complete or left <= 0:
                    return ready, hold.first_token_ids
                self._changed.wait(left)

    def abort(self, request_id: str) -> Release | None:
        with self._changed:
            hold = self._holds.pop(request_id, None)
            if hold is None:
                return None
            self._stats.num_aborted += 1
            self._changed.notify_all()  # a server thread streaming it stops now
        return Release(request_id, hold.block_ids, ReleaseReason.ABORTED)

    def poll(self) -> list[Release]:
        now = self._clock()
        released = []
        with self._lock:
            for request_id, hold in list(self._holds.items()):
                if hold.confirmed:
                    reason = ReleaseReason.CONFIRMED
                elif hold.aborted_by_peer:
                    reason = ReleaseReason.ABORTED
                elif now >= hold.deadline:
                    reason = ReleaseReason.EXPIRED
                    self._stats.num_lease_expiries += 1
                else:
                    continue
                del self._holds[request_id]
                released.append(Release(request_id, hold.block_ids, reason))
        return released

    def has_unfinished(self) -> bool:
        """True while some hold is waiting: keep calling poll() even when otherwise idle."""
        with self._lock:
            return bool(self._holds)

    def stats(self) -> SenderStats:
        with self._lock:
            # a streamed hold still prefilling holds nothing yet: its request owns the blocks
            live = [h for h in self._holds.values() if not (h.confirmed or h.aborted_by_peer)
                    and (h.ready_tokens < 0 or h.first_token_ids is not None)]
            self._stats.num_held = len(live)
            self._stats.num_held_blocks = sum(len(h.block_ids) for h in live)
            return SenderStats(**{k: getattr(self._stats, k) for k in SenderStats.__slots__})

    # --- peer side: server thread or fake transport --------------------------------------

    def _live_hold(self, request_id: str, token: bytes) -> _Hold | None:
        """The hold, if it is live and `token` is its access token (a wrong token looks exactly
        like a missing hold, so a prober learns nothing)."""
        hold = self._holds.get(request_id)
        if (hold is None or hold.confirmed or hold.aborted_by_peer
                or self._clock() >= hold.deadline or not hmac.compare_digest(token, hold.token)):
            return None  # an expired hold stays until poll() counts it
        return hold

    def _gone(self, request_id: str) -> Reply:
        return Reply(ok=False, error=f"prefill instance {self.instance_id} no longer holds the "
                                     f"KV of {request_id!r} (lease expired, aborted or already "
                                     "transferred)")

    def peer_begin(self, request_id: str, token: bytes) -> Reply:
        with self._lock:
            hold = self._live_hold(request_id, token)
            if hold is None:
                return self._gone(request_id)
            hold.num_begins += 1
            return Reply(ok=True, block_ids=list(hold.block_ids), num_tokens=hold.num_tokens)

    def peer_confirm(self, request_id: str, token: bytes) -> Reply:
        """Succeeds only if the blocks were never released, so what the peer read was intact."""
        with self._lock:
            hold = self._live_hold(request_id, token)
            if hold is None:
                return self._gone(request_id)
            hold.confirmed = True
            self._stats.num_confirmed += 1
            return Reply(ok=True)

    def peer_abort(self, request_id: str, token: bytes) -> Reply:
        """The decode side gave up: free now rather than at lease expiry."""
        with self._lock:
            hold = self._live_hold(request_id, token)
            if hold is None:
                return Reply(ok=True)  # nothing left to release
            hold.aborted_by_peer = True  # poll() hands the blocks back
            self._stats.num_aborted += 1
            self._changed.notify_all()
        return Reply(ok=True)
