"""Every struct the KV transfer layer puts on a wire or hands to another part.

Two groups:
- what crosses the frontend/engine boundary (belongs in splitserve/protocol.py once
  that module exists): `SourceInfo`, `TransferDescriptor`, `TransferRecord`;
- the prefill side's control socket (private to kv_transfer/): a handshake
  (`Challenge` -> `Hello` -> `Welcome`) and requests answered with `Reply`, or for
  `Fetch` with one `LayerHeader` + raw bytes per layer.
"""
from __future__ import annotations

import enum
from typing import Union

import msgspec


class SourceInfo(msgspec.Struct, frozen=True):
    """Where a prefill instance's KV blocks can be read from."""

    instance_id: str
    transport: str  # "fake" | "shm" | "tcp"
    kv_shape: tuple[int, ...]  # [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    host: str = ""  # control socket (shm, tcp)
    port: int = 0
    shm_name: str = ""  # the pool's segment (shm)


class TransferDescriptor(msgspec.Struct, frozen=True):
    """What a decode instance needs to pull one request's KV: made by the prefill side."""

    source: SourceInfo
    request_id: str
    num_tokens: int  # tokens whose KV is in the blocks
    num_blocks: int
    access_token: bytes = b""  # random per hold; every request about these blocks must carry it
    # overlap mode: handed over while the prompt is still being prefilled; the blocks stream as
    # chunks finish and the first token comes at the end of the stream (tcp only)
    streamed: bool = False


class TransferOutcome(str, enum.Enum):
    PENDING = "pending"  # waiting for destination blocks
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in (TransferOutcome.DONE, TransferOutcome.FAILED, TransferOutcome.ABORTED)


class TransferRecord(msgspec.Struct):
    """One transfer as the decode side saw it; what metrics and trials count."""

    request_id: str
    source_instance: str
    transport: str
    outcome: TransferOutcome = TransferOutcome.PENDING
    num_bytes: int = 0
    queued_at: float = 0.0  # time.time() when the descriptor arrived
    start: float = 0.0  # when bytes started to move
    end: float = 0.0
    error: str = ""
    error_kind: str = ""  # injected | network | source_gone | auth | no_space | cancelled | ...
    dst_block_ids: list[int] = []
    num_cached_blocks: int = 0  # leading dst blocks the decode side already had (not moved)
    first_token_ids: list[int] = []  # a streamed transfer: the prefill's first token, sent last

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start) if self.start else 0.0


# --- control socket -------------------------------------------------------------------

class Challenge(msgspec.Struct, tag="challenge"):
    nonce: bytes
    auth_required: bool


class Hello(msgspec.Struct, tag="hello"):
    client_nonce: bytes
    mac: bytes = b""  # HMAC(secret, "client" + server nonce); empty without a secret


class Welcome(msgspec.Struct, tag="welcome"):
    mac: bytes = b""  # HMAC(secret, "server" + client nonce): the server knows it too


class Begin(msgspec.Struct, tag="begin"):
    request_id: str
    token: bytes = b""  # the descriptor's access_token


class Fetch(msgspec.Struct, tag="fetch"):
    request_id: str
    first_block: int = 0  # skip blocks the puller already has
    token: bytes = b""  # the descriptor's access_token
    streamed: bool = False  # answer with BlockRange rounds as the prefill advances, then StreamEnd


class Confirm(msgspec.Struct, tag="confirm"):
    request_id: str
    token: bytes = b""  # the descriptor's access_token


class Abort(msgspec.Struct, tag="abort"):
    request_id: str
    token: bytes = b""  # the descriptor's access_token


class Reply(msgspec.Struct, tag="reply"):
    ok: bool
    error: str = ""
    block_ids: list[int] = []  # Begin: the source blocks, in order
    num_tokens: int = 0


class LayerHeader(msgspec.Struct, tag="layer"):
    layer: int
    num_bytes: int  # raw bytes that follow: kv[layer].index_select(2, block_ids), contiguous


class BlockRange(msgspec.Struct, tag="range"):
    """Streamed fetch: one LayerHeader + bytes per layer follow for blocks [first_block,
    first_block + num_blocks); num_blocks 0 is a keepalive while the prefill has no new block."""
    first_block: int
    num_blocks: int


class StreamEnd(msgspec.Struct, tag="end"):
    """Streamed fetch: every block was sent; the prefill's first token, for the decode side."""
    first_token_ids: list[int]


ControlMessage = Union[Challenge, Hello, Welcome, Begin, Fetch, Confirm, Abort, Reply, LayerHeader, BlockRange,
                       StreamEnd]
