"""The worker side: how a decode instance moves one request's blocks into its pool.

A transport knows how to reach a source (a prefill instance) and copy
`src_kv[:, :, src_block_ids]` into `dst_kv[:, :, dst_block_ids]`. It does not decide
which blocks move or when: that is the connector's job (sender.py, receiver.py).

    pull(descriptor, dst_kv, dst_block_ids, on_layer, first_block) -> bytes moved
        begin (the source names its blocks and checks the lease), copy blocks
        [first_block:] layer by layer calling on_layer(layer) before each (it raises to
        cancel or to inject a fault), then confirm receipt so the source can free its
        blocks. Any failure raises TransferError with a message a person can act on.
    release(descriptor)
        best effort: tell the source it can free the blocks now (abort, failure).
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Callable

import torch

from splitserve.kv_transfer import layout
from splitserve.kv_transfer.messages import TransferDescriptor
from splitserve.kv_transfer.shm_pool import segment_owner

LayerHook = Callable[[int], None]


class TransferError(RuntimeError):
    """A transfer failed; the message says why (shown to operators), `kind` is what
    metrics count it under."""

    kind = "transfer"


class TransferCancelled(TransferError):
    """The request was aborted while its blocks were moving."""

    kind = "cancelled"


class AuthError(TransferError):
    """A peer could not prove it knows the shared secret (or we could not)."""

    kind = "auth"


class NetworkError(TransferError):
    """The prefill instance could not be reached, or the connection broke."""

    kind = "network"


class PeerClosed(NetworkError):
    """The peer closed the connection between two messages: how a client that is done hangs up."""


class SourceGone(TransferError):
    """The prefill instance no longer holds the blocks (lease expired, aborted)."""

    kind = "source_gone"


class InjectedFault(TransferError):
    """Failed on purpose (--kv-fault-rate)."""

    kind = "injected"


class KVTransport(ABC):
    name: str

    @abstractmethod
    def pull(self, descriptor: TransferDescriptor, dst_kv: torch.Tensor,
             dst_block_ids: list[int], on_layer: LayerHook, first_block: int = 0) -> int: ...

    @abstractmethod
    def release(self, descriptor: TransferDescriptor) -> None: ...

    def close(self) -> None:
        pass


def check_layout(descriptor: TransferDescriptor, dst_kv: torch.Tensor,
                 num_src_blocks: int, dst_block_ids: list[int]) -> None:
    """Both pools must agree on everything but the number of blocks."""
    src_shape = tuple(descriptor.source.kv_shape)
    if len(src_shape) != layout.NUM_DIMS or dst_kv.dim() != layout.NUM_DIMS:
        raise TransferError(f"kv pools must be [layers, 2, kv_heads, blocks, block_size, head_dim]; "
                            f"source is {src_shape}, destination {tuple(dst_kv.shape)}")
    src_layout = layout.without_blocks(src_shape)
    dst_layout = layout.without_blocks(tuple(dst_kv.shape))
    if src_layout != dst_layout:
        raise TransferError(f"prefill and decode instances disagree on the KV layout (layers, 2, "
                            f"kv_heads, block_size, head_dim): {src_layout} vs {dst_layout}; "
                            "run both with the same model and block size")
    if descriptor.source.dtype != str(dst_kv.dtype).removeprefix("torch."):
        raise TransferError(f"kv dtype differs: source {descriptor.source.dtype}, "
                            f"destination {dst_kv.dtype}")
    if num_src_blocks != len(dst_block_ids):
        raise TransferError(f"source holds {num_src_blocks} blocks for {descriptor.request_id!r} "
                            f"but {len(dst_block_ids)} destination blocks were allocated")


def descriptor_problem(descriptor: TransferDescriptor, dst_kv: torch.Tensor, transport: str) -> str | None:
    """Why a descriptor cannot be acted on, or None. It crossed two processes and the frontend:
    checked before any block is allocated or any socket or segment is opened."""
    source = descriptor.source
    shape = tuple(source.kv_shape)
    if source.transport != transport:
        return f"the descriptor is for the {source.transport!r} transport; this instance uses {transport!r}"
    if len(shape) != layout.NUM_DIMS or any(not 0 < int(d) < 2**31 for d in shape):
        return f"the descriptor's kv_shape {shape} is not a valid pool shape"
    if layout.without_blocks(shape) != layout.without_blocks(tuple(dst_kv.shape)):
        return (f"prefill and decode instances disagree on the KV layout: {shape} vs {tuple(dst_kv.shape)}; "
                "run both with the same model and block size")
    if source.dtype != str(dst_kv.dtype).removeprefix("torch."):
        return f"kv dtype differs: source {source.dtype}, destination {dst_kv.dtype}"
    block_size = layout.block_size(shape)
    # (more blocks than this instance's whole pool is not malformed: allocate refuses it as no_space)
    if not (0 < descriptor.num_tokens and descriptor.num_blocks == -(-descriptor.num_tokens // block_size)
            and descriptor.num_blocks <= shape[layout.BLOCK_DIM]):
        return (f"the descriptor's {descriptor.num_blocks} blocks for {descriptor.num_tokens} tokens do not fit "
                f"blocks of {block_size} in the source's pool of {shape[layout.BLOCK_DIM]} blocks")
    if transport != "fake" and (not source.host or not 0 < source.port < 65536):
        return f"the descriptor's address {source.host!r}:{source.port} cannot be dialled"
    if transport == "shm" and segment_owner(source.shm_name) is None:
        return f"the descriptor's segment name {source.shm_name!r} is not a splitserve segment name"
    if descriptor.streamed and transport != "tcp":
        return f"a streamed descriptor (kv send mode overlap) needs the tcp transport; this instance uses {transport!r}"
    if len(descriptor.access_token) > 64:
        return "the descriptor's access token is longer than any this version issues"
    return None


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long, device=device)


class FaultInjector:
    """--kv-fault-rate / --kv-delay-ms: slow transfers down or fail them on purpose.

    A failing transfer fails at a random layer, after moving part of the data, as a real
    network failure would.
    """

    def __init__(self, fault_rate: float, delay_ms: float, seed: int = 0):
        self.fault_rate = fault_rate
        self.delay_ms = delay_ms
        self._rng = random.Random(seed)

    def plan(self, num_layers: int) -> int | None:
        """Decide when a transfer starts; returns the layer to fail at, or None."""
        if self.fault_rate > 0 and self._rng.random() < self.fault_rate:
            return self._rng.randrange(num_layers)
        return None

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0


def contiguous_runs(src_block_ids: list[int], dst_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """[(src_start, dst_start, length)] covering the pairs where both sides count up by one."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def copy_blocks_by_layer(src_kv: torch.Tensor, src_block_ids: list[int], dst_kv: torch.Tensor,
                         dst_block_ids: list[int], on_layer: LayerHook) -> int:
    """dst_kv[:, :, dst_ids] = src_kv[:, :, src_ids]; returns bytes moved.

    Copies run by run straight from pool to pool: one pass over the data, where a
    gather into a temporary and a scatter out of it would be two (measured: ~45% of
    memcpy instead of ~70%). Layers go in groups so that each copy call still moves
    several blocks when the ids are scattered; on_layer(layer) is called for every
    layer before its group is copied.
    """
    runs = contiguous_runs(src_block_ids, dst_block_ids)
    num_layers = src_kv.shape[0]
    assert layout.BLOCK_DIM == 3, "the slicing below is written for the head-major layout"
    layers_per_step = max(1, min(num_layers, len(runs) // 8))
    for first in range(0, num_layers, layers_per_step):
        last = min(num_layers, first + layers_per_step)
        for layer in range(first, last):
            on_layer(layer)
        for src, dst, length in runs:
            # [layers, 2, kv_heads, length, block_size, head_dim]; device moves happen here
            dst_kv[first:last, :, :, dst:dst + length].copy_(
                src_kv[first:last, :, :, src:src + length])
    return layout.block_numel(tuple(src_kv.shape)) * len(src_block_ids) * src_kv.element_size()
