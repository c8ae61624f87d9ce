"""The elementwise steps between a layer's matmuls, each one call: the C++ kernel when it is built
(splitserve.kernels, one pass over each row) and the plain torch ops otherwise.

    add_rms_norm    x += delta in place, then RMSNorm(x) * weight      (the residual add + the next norm)
    rope_kv_write   rotary q and k in place inside the qkv rows, then k and v into their cache slots
    silu_mul        silu(gate) * up from the fused gate/up rows

The torch versions are the reference the kernels are tested against (tests/test_fused_ops.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve import kernels


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [n, hidden] residual stream, updated in place by delta (if given); returns the normed rows."""
    module = kernels.for_tensor(x)
    if module is not None and x.is_contiguous() and (delta is None or delta.is_contiguous()):
        return module.add_rms_norm(x, x.new_empty(0) if delta is None else delta, weight, eps)
    return add_rms_norm_torch(x, delta, weight, eps)


def add_rms_norm_torch(x, delta, weight, eps):
    if delta is not None:
        x.add_(delta)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  kv_layer: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """qkv: [n, (num_heads + 2 num_kv_heads) * head_dim], q and k rotated in place; cos/sin:
    [max_positions, head_dim / 2]; kv_layer: [2, num_kv_heads, num_blocks, block_size, head_dim]."""
    module = kernels.for_tensor(qkv)
    if module is not None and qkv.is_contiguous():
        module.rope_kv_write(qkv, cos, sin, positions, kv_layer, slot_mapping, num_heads, num_kv_heads)
    else:
        rope_kv_write_torch(qkv, cos, sin, positions, kv_layer, slot_mapping, num_heads, num_kv_heads)


def rope_kv_write_torch(qkv, cos, sin, positions, kv_layer, slot_mapping, num_heads, num_kv_heads):
    n, hd = qkv.shape[0], kv_layer.shape[-1]
    qk = qkv[:, :(num_heads + num_kv_heads) * hd].view(n, num_heads + num_kv_heads, hd)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [n, 1, hd / 2]
    x1, x2 = qk.chunk(2, dim=-1)  # HF's rotate_half layout
    qk.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    k = qk[:, num_heads:]
    v = qkv[:, (num_heads + num_kv_heads) * hd:].view(n, num_kv_heads, hd)
    # [2, nkv, num_blocks, block_size, hd] -> [nkv, slots, hd] per half; slots are block_id * block_size + offset
    kv_layer[0].flatten(1, 2).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_layer[1].flatten(1, 2).index_copy_(1, slot_mapping, v.transpose(0, 1))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [n, 2 * intermediate] -> [n, intermediate]."""
    module = kernels.for_tensor(gate_up)
    if module is not None and gate_up.is_contiguous():
        return module.silu_mul(gate_up)
    return silu_mul_torch(gate_up)


def silu_mul_torch(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
