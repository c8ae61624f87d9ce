"""Zero-copy byte views of a CPU pool's blocks, for scatter/gather socket I/O.

On the wire one layer is `kv[layer].index_select(2, block_ids)` laid out contiguously,
[2, kv_heads, n, block_size, head_dim]: for K then V, for each head, the blocks in list
order. Instead of gathering that into a temporary
(sender) and scattering it out of one (receiver), both sides hand the kernel a list of
views of the pool itself (sendmsg / recvmsg_into): the bytes are copied once per side,
by the kernel.
"""
from __future__ import annotations

import math

import torch

from splitserve.kv_transfer import layout


def has_byte_views(kv: torch.Tensor) -> bool:
    return kv.device.type == "cpu" and kv.is_contiguous()


def pool_bytes(kv: torch.Tensor) -> memoryview:
    """The whole pool as one flat byte view (CPU, contiguous pools only)."""
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def id_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[(first_block, length)] for stretches of consecutive ids, in list order."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def layer_views(raw: memoryview, kv_shape: tuple[int, ...], element_size: int, layer: int,
                runs: list[tuple[int, int]]) -> list[memoryview]:
    """Views that, concatenated, are kv[layer].index_select(2, block_ids).

    kv_shape: [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]
    """
    assert layout.BLOCK_DIM == 3, "the offsets below are written for the head-major layout"
    num_heads, num_blocks = kv_shape[2], kv_shape[3]
    block_bytes = math.prod(kv_shape[4:]) * element_size  # one head of one block
    views = []
    for half_and_head in range(2 * num_heads):  # K heads, then V heads
        base = (layer * 2 * num_heads + half_and_head) * num_blocks * block_bytes
        for first, length in runs:
            start = base + first * block_bytes
            views.append(raw[start:start + length * block_bytes])
    return views
