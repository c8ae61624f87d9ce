"""Zero-copy byte views of a CPU pool's blocks, for scatter/gather socket I/O.

On the wire one layer is `kv[layer, :, block_ids]` laid out contiguously: the K half of
every block in list order, then the V half. Instead of gathering that into a temporary
(sender) and scattering it out of one (receiver), both sides hand the kernel a list of
views of the pool itself (sendmsg / recvmsg_into): the bytes are copied once per side,
by the kernel.
"""
from __future__ import annotations

import math

import torch


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
    """Views that, concatenated, are kv[layer, :, block_ids] (K blocks, then V blocks).

    kv_shape: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    """
    num_blocks = kv_shape[2]
    block_bytes = math.prod(kv_shape[3:]) * element_size
    views = []
    for half in (0, 1):  # K, then V
        base = (layer * 2 + half) * num_blocks * block_bytes
        for first, length in runs:
            start = base + first * block_bytes
            views.append(raw[start:start + length * block_bytes])
    return views
