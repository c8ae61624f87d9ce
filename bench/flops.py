"""How much work one forward pass of a Llama-family model is: FLOPs and weight bytes.

These turn measured times into fractions of the hardware limits in hardware.py:
prefill is compute-bound (FLOPs / matmul rate), batch-1 decode is bound by
reading every weight once per step (weight bytes / read bandwidth).
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.config import ModelConfig


@dataclass(slots=True, frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a splitserve ModelConfig or a transformers PretrainedConfig."""
        if isinstance(config, ModelConfig):
            return cls(config.hidden_size, config.intermediate_size, config.num_layers,
                       config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                   config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.vocab_size)

    @property
    def linear_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        gate_up_down = 3 * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + gate_up_down

    @property
    def linear_params(self) -> int:
        """Parameters every token multiplies through (all layers, without the LM head)."""
        return self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def attention_flops(self, num_new_tokens: int, num_past_tokens: int) -> float:
        """QK^T and PV for new tokens attending causally to past + earlier new tokens."""
        # Token i (0-based among the new ones) sees num_past_tokens + i + 1 keys.
        num_scores = num_new_tokens * num_past_tokens + num_new_tokens * (num_new_tokens + 1) / 2
        return self.num_layers * 2 * 2 * self.num_heads * self.head_dim * num_scores

    def prefill_flops(self, num_tokens: int) -> float:
        """Useful FLOPs of prefilling one prompt and sampling one token from its last position."""
        return (2.0 * self.linear_params * num_tokens + self.attention_flops(num_tokens, 0)
                + 2.0 * self.lm_head_params)

    def decode_step_flops(self, batch_size: int, context_len: int) -> float:
        """Useful FLOPs of one decode step: batch_size tokens, each with context_len past tokens."""
        per_token = (2.0 * (self.linear_params + self.lm_head_params)
                     + self.attention_flops(1, context_len))
        return batch_size * per_token

    def weight_bytes(self, bytes_per_param: int = 4) -> int:
        """Bytes a decode step must read at least: every matrix once (embeddings tied or not,
        the LM head reads a vocab x hidden matrix); norms and the one embedding row are noise."""
        return bytes_per_param * (self.linear_params + self.lm_head_params)
