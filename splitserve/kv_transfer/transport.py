"""The worker side: how a decode instance moves one request's blocks into its pool.

A transport knows how to reach a source (a prefill instance) and copy
`src_kv[:, :, src_block_ids]` into `dst_kv[:, :, dst_block_ids]`. It does not decide
which blocks move or when: that is the connector's job (sender.py, receiver.py).

    pull(descriptor, dst_kv, dst_block_ids, on_layer) -> bytes moved
        begin (the source names its blocks and checks the lease), copy layer by layer
        calling on_layer(layer) before each (it raises to cancel or to inject a fault),
        then confirm receipt so the source can free its blocks. Any failure raises
        TransferError with a message a person can act on.
    release(descriptor)
        best effort: tell the source it can free the blocks now (abort, failure).
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Callable

import torch

from splitserve.kv_transfer.messages import TransferDescriptor

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
             dst_block_ids: list[int], on_layer: LayerHook) -> int: ...

    @abstractmethod
    def release(self, descriptor: TransferDescriptor) -> None: ...

    def close(self) -> None:
        pass


def check_layout(descriptor: TransferDescriptor, dst_kv: torch.Tensor,
                 num_src_blocks: int, dst_block_ids: list[int]) -> None:
    """Both pools must agree on everything but the number of blocks."""
    src_shape = tuple(descriptor.source.kv_shape)
    if len(src_shape) != 6 or dst_kv.dim() != 6:
        raise TransferError(f"kv pools must be [layers, 2, blocks, block_size, kv_heads, head_dim]; "
                            f"source is {src_shape}, destination {tuple(dst_kv.shape)}")
    src_layout = src_shape[:2] + src_shape[3:]
    dst_layout = tuple(dst_kv.shape[:2]) + tuple(dst_kv.shape[3:])
    if src_layout != dst_layout:
        raise TransferError(f"prefill and decode instances disagree on the KV layout (layers, 2, "
                            f"block_size, kv_heads, head_dim): {src_layout} vs {dst_layout}; "
                            "run both with the same model and block size")
    if descriptor.source.dtype != str(dst_kv.dtype).removeprefix("torch."):
        raise TransferError(f"kv dtype differs: source {descriptor.source.dtype}, "
                            f"destination {dst_kv.dtype}")
    if num_src_blocks != len(dst_block_ids):
        raise TransferError(f"source holds {num_src_blocks} blocks for {descriptor.request_id!r} "
                            f"but {len(dst_block_ids)} destination blocks were allocated")


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def copy_layer_blocks(dst_layer: torch.Tensor, dst_index: torch.Tensor,
                      src_layer: torch.Tensor, src_index: torch.Tensor) -> None:
    """dst_layer[:, dst_ids] = src_layer[:, src_ids] for one layer.

    dst_layer, src_layer: [2, num_blocks, block_size, kv_heads, head_dim]
    """
    # Gathering one layer at a time keeps the temporary small enough to stay in cache.
    gathered = src_layer.index_select(1, src_index)  # [2, n, block_size, kv_heads, head_dim]
    dst_layer.index_copy_(1, dst_index, gathered.to(dst_layer.device))


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


def copy_blocks_by_layer(src_kv: torch.Tensor, src_block_ids: list[int], dst_kv: torch.Tensor,
                         dst_block_ids: list[int], on_layer: LayerHook) -> int:
    """dst_kv[:, :, dst_ids] = src_kv[:, :, src_ids], one layer at a time; returns bytes moved."""
    src_index = block_index(src_block_ids, src_kv.device)
    dst_index = block_index(dst_block_ids, dst_kv.device)
    num_bytes = 0
    for layer in range(src_kv.shape[0]):
        on_layer(layer)
        copy_layer_blocks(dst_kv[layer], dst_index, src_kv[layer], src_index)
        num_bytes += src_kv[layer, :, 0].numel() * len(src_block_ids) * src_kv.element_size()
    return num_bytes
