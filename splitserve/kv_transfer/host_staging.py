"""Host buffers a device pool's KV passes through on its way to and from a socket.

A CPU pool needs none: its blocks are handed to the kernel as byte views (block_bytes.py). A CUDA
pool's layer is gathered on the device, copied into a staging buffer, sent, and on the other side
received into one and copied up. The buffer is page-locked (pinned) for a CUDA pool: a copy from
pageable memory goes through the driver's own pinned bounce buffer, one more pass over every byte
and a fraction of the copy engine's rate. It is allocated once per transfer and reused by every layer.
"""
from __future__ import annotations

import torch


def pins_for(device: torch.device | str) -> bool:
    """Whether staging for a pool on `device` is page-locked (CUDA only: pinning needs a CUDA runtime)."""
    return torch.device(device).type == "cuda"


def staging_buffer(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[2, kv_heads, num_blocks, block_size, head_dim] on the host, for one layer of `num_blocks`
    blocks of the pool kv [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]."""
    shape = (2, kv.shape[2], num_blocks) + tuple(kv.shape[4:])
    return torch.empty(shape, dtype=kv.dtype, pin_memory=pins_for(kv.device))


def byte_view(staging: torch.Tensor) -> memoryview:
    return memoryview(staging.view(-1).view(torch.uint8).numpy())
