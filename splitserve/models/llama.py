"""The Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3), written for a paged KV cache.

One call runs a mixed batch: decode tokens (one per sequence) first, then prefill chunks.
Linear layers see every token of the step at once; attention is split by kind, because a
decode token attends to its sequence's whole cached context and a prefill chunk attends
causally to its own tokens plus whatever prefix is already cached.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.config import ModelConfig
from splitserve.models.fused import add_rms_norm, rope_kv_write, silu_mul
from splitserve.models.gguf_blocks import GGUFBlocks, linear


@dataclass(slots=True)
class PrefillChunk:
    start: int  # index of the chunk's first token in the step's flat token list
    num_tokens: int
    num_context_tokens: int  # cached prefix + this chunk
    block_ids: torch.Tensor  # [ceil(num_context_tokens / block_size)] blocks holding that context


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended together; each is padded to the group's longest."""

    start: int  # index of the group's first decode token
    count: int
    block_tables: torch.Tensor  # [count, max_blocks] (padded with block 0)
    context_lens: torch.Tensor  # [count] tokens each decode attends to


@dataclass(slots=True)
class ForwardBatch:
    """Everything one step's forward pass needs; built by the model runner, read-only here."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot (block_id * block_size + offset)
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode_groups: list[DecodeGroup]  # cover the decode tokens in order
    prefills: list[PrefillChunk]
    sample_indices: torch.Tensor  # [num_samples] token indices whose logits are wanted


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend between.
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


def fuse_rows(parts: list) -> torch.Tensor | GGUFBlocks:
    """One matrix from several stacked by rows; blocks stay blocks when all share a format."""
    if all(isinstance(p, GGUFBlocks) for p in parts) and len({p.fmt for p in parts}) == 1:
        return GGUFBlocks.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p for p in parts]).contiguous()


class LlamaModel:
    """Weights as plain tensors or GGUF blocks (matrices only); q/k/v and gate/up are fused so
    each is one matmul."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | GGUFBlocks],
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor | GGUFBlocks:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            if isinstance(weights[name], GGUFBlocks):
                return weights[name]
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        c = config
        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden] (or its blocks)
        self.lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in weights \
            else w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            layer = {
                "input_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
                "qkv": fuse_rows([w(attn + "q_proj.weight"), w(attn + "k_proj.weight"),
                                  w(attn + "v_proj.weight")]),
                "qkv_bias": torch.cat([w(attn + "q_proj.bias"), w(attn + "k_proj.bias"),
                                       w(attn + "v_proj.bias")]) if c.attention_bias else None,
                "o": w(attn + "o_proj.weight"),
                # [2 * intermediate, hidden]
                "gate_up": fuse_rows([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down": w(p + "mlp.down_proj.weight"),
                "q_norm": w(attn + "q_norm.weight") if c.qk_norm else None,
                "k_norm": w(attn + "k_norm.weight") if c.qk_norm else None,
            }
            self.layers.append(layer)
        inv_freq = rope_inv_freq(c)
        t = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim / 2]
        self.rope_cos = freqs.cos().to(device=self.device, dtype=dtype)
        self.rope_sin = freqs.sin().to(device=self.device, dtype=dtype)
        self.scale = c.head_dim ** -0.5

    def block_matrices(self) -> list[GGUFBlocks]:
        """The matrices kept in GGUF blocks that go through gguf_blocks.linear (the embedding's
        lookup does not; as the tied lm_head it does)."""
        mats = [layer[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down")] + [self.lm_head]
        return list({id(m): m for m in mats if isinstance(m, GGUFBlocks)}.values())
        self.block_size = 0  # set by the runner, which owns the cache layout

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]. Returns
        logits [num_samples, vocab] for batch.sample_indices."""
        c = self.config
        nq, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        n = batch.input_ids.shape[0]
        x = self.embed.rows(batch.input_ids).dequantize() if isinstance(self.embed, GGUFBlocks) \
            else self.embed[batch.input_ids]  # [n, hidden]
        # The C++ kernels (fp32 CPU tensors only) read each sequence's own blocks in place; the torch
        # path (any device) gathers them and masks the padding: True where a decode may look.
        paged = kernels.for_tensor(x)
        decode_masks = []
        for group in ([] if paged else batch.decode_groups):
            width = group.block_tables.shape[1] * self.block_size
            decode_masks.append(torch.arange(width, device=x.device).unsqueeze(0) < group.context_lens.unsqueeze(1))
        eps = c.rms_norm_eps
        delta = None  # the previous layer's MLP output, added to x by the next norm
        for li, layer in enumerate(self.layers):
            h = add_rms_norm(x, delta, layer["input_norm"], eps)
            qkv = linear(h, layer["qkv"], layer["qkv_bias"])  # [n, (nq + 2 nkv) * hd]
            if layer["q_norm"] is not None:  # Qwen3 norms q and k per head before the rotation
                q = qkv[:, :nq * hd].view(n, nq, hd)
                k = qkv[:, nq * hd:(nq + nkv) * hd].view(n, nkv, hd)
                q.copy_(self._rms_norm(q, layer["q_norm"]))
                k.copy_(self._rms_norm(k, layer["k_norm"]))
            # [2, num_kv_heads, num_blocks, block_size, head_dim]: head-major, so gathered blocks
            # form [heads, tokens, head_dim] for attention without a further copy
            kv_layer = kv_cache[li]
            rope_kv_write(qkv, self.rope_cos, self.rope_sin, batch.positions, kv_layer, batch.slot_mapping, nq, nkv)
            q = qkv[:, :nq * hd].view(n, nq, hd)
            k = qkv[:, nq * hd:(nq + nkv) * hd].view(n, nkv, hd)
            v = qkv[:, (nq + nkv) * hd:].view(n, nkv, hd)
            attn = torch.empty(n, nq, hd, device=x.device, dtype=x.dtype)
            for gi, group in enumerate(batch.decode_groups):
                s = slice(group.start, group.start + group.count)
                attn[s] = paged.paged_decode_attention(q[s], kv_layer, group.block_tables, group.context_lens,
                                                       self.scale) if paged else \
                    self._decode_attention(q[s], kv_layer, group.block_tables, decode_masks[gi])
            for chunk in batch.prefills:  # the chunk's own K/V are in the cache already (rope_kv_write)
                s = slice(chunk.start, chunk.start + chunk.num_tokens)
                attn[s] = paged.paged_prefill_attention(q[s], kv_layer, chunk.block_ids, chunk.num_context_tokens,
                                                        self.scale) if paged else \
                    self._prefill_attention(q[s], k[s], v[s], kv_layer, chunk)
            h = add_rms_norm(x, linear(attn.view(n, nq * hd), layer["o"]), layer["post_norm"], eps)
            delta = linear(silu_mul(linear(h, layer["gate_up"])), layer["down"])
        x = x[batch.sample_indices] + delta[batch.sample_indices]
        x = self._rms_norm(x, self.final_norm)
        return linear(x, self.lm_head)  # [num_samples, vocab]

    @staticmethod
    def _gather(kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        # kv_layer: [2, nkv, num_blocks, block_size, hd] -> [2, nkv, len(block_ids) * block_size, hd]
        return kv_layer.index_select(2, block_ids.flatten()).flatten(2, 3)

    def _prefill_attention(self, q, k, v, kv_layer, chunk: PrefillChunk) -> torch.Tensor:
        # The torch path of the C++ paged_prefill_attention. q: [t, nq, hd]; k, v: [t, nkv, hd] (this chunk only)
        t, ctx = chunk.num_tokens, chunk.num_context_tokens
        if ctx == t:  # nothing cached before this chunk: attend to the chunk itself, causally
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            gathered = self._gather(kv_layer, chunk.block_ids)[:, :, :ctx]  # [2, nkv, ctx, hd]
            keys, values = gathered[0], gathered[1]
            # query i sits at position ctx - t + i and may see keys 0..ctx - t + i
            qpos = torch.arange(ctx - t, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [t, ctx]
            causal = False
        return grouped_attention(q.transpose(0, 1), keys, values, mask, causal, self.scale).transpose(0, 1)

    def _decode_attention(self, q, kv_layer, block_tables, mask) -> torch.Tensor:
        # q: [b, nq, hd]; one query per sequence over its own cached context; mask: [b, max_ctx] (True: look)
        b = q.shape[0]
        nkv, hd = self.config.num_kv_heads, self.config.head_dim
        group = self.config.num_heads // nkv
        gathered = self._gather(kv_layer, block_tables)  # [2, nkv, b * max_ctx, hd]
        kv = gathered.view(2, nkv, b, -1, hd).transpose(1, 2)  # [2, b, nkv, max_ctx, hd]
        # A kv head's `group` query heads ride as that head's query rows, so plain (non-GQA) fused
        # attention serves every layout on every backend, with one mask row per sequence.
        qg = q.view(b, nkv, group, hd)
        out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask[:, None, None, :],
                                             scale=self.scale)  # [b, nkv, group, hd]
        return out.reshape(b, nkv * group, hd)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool, scale: float, repeat_heads: bool | None = None) -> torch.Tensor:
    """Fused attention of q [nq, t, hd] over keys/values [nkv, ctx, hd] (nq a multiple of nkv),
    mask [t, ctx] (True: look) or causal; returns [nq, t, hd].

    On the CPU, torch's flash kernel reads the shared kv heads itself (enable_gqa, 4-D inputs: 3-D
    ones fall back to the slow math path). Elsewhere (repeat_heads, by default off the CPU) each kv
    head is repeated for its query heads first: CUDA's flash and memory-efficient kernels do not all
    take enable_gqa, and one that does not sends the call to the math kernel, whose [nq, t, ctx]
    scores an 8k-token prompt cannot afford.
    """
    if repeat_heads is None:
        repeat_heads = q.device.type != "cpu"
    if repeat_heads:
        keys, values = repeat_kv_heads(keys, q.shape[0]), repeat_kv_heads(values, q.shape[0])
    return F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                          is_causal=causal, scale=scale, enable_gqa=not repeat_heads)[0]


def repeat_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[nkv, ctx, hd] -> [num_heads, ctx, hd], kv head j serving query heads j*g .. j*g + g - 1."""
    nkv = x.shape[0]
    return x.unsqueeze(1).expand(nkv, num_heads // nkv, *x.shape[1:]).reshape(num_heads, *x.shape[1:])
