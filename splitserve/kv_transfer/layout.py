"""The engine's KV pool layout, the one fact every part of kv_transfer shares.

    kv: [num_layers, 2 (k, v), num_kv_heads, num_blocks, block_size, head_dim]

Head-major (docs/internals.md, engine core): a request's blocks are slices along
BLOCK_DIM, and `kv.index_select(BLOCK_DIM, ids)` is its KV.
"""
from __future__ import annotations

import math

BLOCK_DIM = 3
NUM_DIMS = 6


def num_blocks(kv_shape: tuple[int, ...]) -> int:
    return kv_shape[BLOCK_DIM]


def block_size(kv_shape: tuple[int, ...]) -> int:
    return kv_shape[BLOCK_DIM + 1]


def block_numel(kv_shape: tuple[int, ...]) -> int:
    """Elements of one block across all layers, K and V and heads."""
    return math.prod(kv_shape) // kv_shape[BLOCK_DIM]


def without_blocks(kv_shape: tuple[int, ...]) -> tuple[int, ...]:
    """What two pools must agree on to exchange blocks."""
    return tuple(kv_shape[:BLOCK_DIM]) + tuple(kv_shape[BLOCK_DIM + 1:])
