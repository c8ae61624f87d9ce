"""Reading a GGUF file (llama.cpp's format) as HF-named tensors and a ModelConfig.

A GGUF stores every tensor under llama.cpp's names, possibly quantized, and for the llama
architecture with the rows of q_proj/k_proj permuted for llama.cpp's rotary layout. Here we
dequantize each tensor, rename it to the HF name the forward pass expects, and undo that
permutation, so that a GGUF and the HF checkpoint it came from load to the same weights.
On request, Q4_1/Q8_0 matrices stay in their blocks (gguf_blocks.py) with the same row order.
The tokenizer lives in gguf_tokenizer.py.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from splitserve.config import ModelConfig
from splitserve.models.gguf_blocks import FORMATS, GGUFBlocks

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# llama.cpp name -> HF name, for tensors outside the layers ...
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# ... and for those of layer N ("blk.N.<key>" -> "model.layers.N.<value>")
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFMetadataReader(gguf.GGUFReader):
    """gguf.GGUFReader, about 2x faster to open on files with a large vocabulary.

    The reader slices its np.memmap once per metadata value (about 250k times for a 49k-token
    vocabulary and its merges), and every slice of a memmap pays for the subclass's
    __array_finalize__. Slicing a plain ndarray view of the same mapping gives the same bytes
    without that cost. If a future gguf stops calling `_get`, this override is simply unused.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self._plain_data = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        array = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return array.view(array.dtype.newbyteorder(order))


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return GGUFMetadataReader(path)
    except ValueError as error:  # bad magic or an unknown version
        raise ValueError(f"{path} is not a GGUF file the gguf package can read: {error}") from error


def metadata_value(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value as a Python scalar, str or list; `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def read_gguf_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    arch = metadata_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    tensor_names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: this GGUF stores per-frequency rope factors (rope_freqs, as "
                         "llama.cpp writes Llama 3.1+); splitserve does not read those from GGUF. "
                         "Load the model's HF directory instead (its config.json rope_scaling works)")

    def key(name: str, default=None):
        value = metadata_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return value

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    rotary_dim = key("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{path}: rotary dimension {rotary_dim} differs from head_dim {head_dim} "
                         "(partial rotary embeddings); splitserve rotates the whole head")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    eos_ids = [metadata_value(reader, f"tokenizer.ggml.{name}")
               for name in ("eos_token_id", "eot_token_id")]
    return ModelConfig(
        architecture=arch,
        vocab_size=int(embed.shape[1]),  # GGUF shapes list the innermost dimension first
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, path),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
    )


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: Path) -> dict | None:
    kind = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"{path}: rope scaling {kind!r} in GGUF is not supported; supported: "
                         "none, linear (load the HF directory for llama3 scaling)")
    return {"rope_type": "linear", "factor": float(metadata_value(reader, f"{arch}.rope.scaling.factor"))}


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family model; "
                     "the file is not a plain llama/qwen2/qwen3 decoder")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute() of q_proj/k_proj rows (weights or biases).

    HF keeps each head's rotary pairs as (first half, second half) of the head; llama.cpp
    interleaves them. Per head the GGUF rows are [half, 2] where HF's are [2, half].
    """
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def read_gguf_weights(reader: gguf.GGUFReader, config: ModelConfig,
                      keep_blocks: bool = False) -> dict[str, torch.Tensor | GGUFBlocks]:
    """Every tensor under its HF name, in HF row order: dequantized to fp32 on the CPU, or, with
    keep_blocks, left in its block format where a kernel reads that format (Q4_1, Q8_0)."""
    weights: dict[str, torch.Tensor | GGUFBlocks] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        fmt = tensor.tensor_type.name.lower()
        if keep_blocks and fmt in FORMATS:
            shape = tuple(reversed(tensor.shape.tolist()))  # [out_features, in_features]
            weights[name] = _hf_row_order(GGUFBlocks.from_gguf(fmt, tensor.data, shape), name, config)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # numpy order is the reverse of GGUF's (innermost first) listing: [out_features, in_features]
        values = values.reshape(tuple(reversed(tensor.shape.tolist())))
        if values.dtype != np.float32 or not values.flags.writeable:
            values = values.astype(np.float32)  # unquantized tensors are views into the file
        weights[name] = _hf_row_order(torch.from_numpy(values), name, config)
    return weights


def _hf_row_order(weight, name: str, config: ModelConfig):
    if config.architecture != "llama":
        return weight
    heads = config.num_heads if ".self_attn.q_proj." in name else \
        config.num_kv_heads if ".self_attn.k_proj." in name else None
    if heads is None:
        return weight
    if isinstance(weight, GGUFBlocks):  # rows are whole blocks: move them, as for fp32 rows
        order = unpermute_rotary_rows(torch.arange(weight.shape[0]).unsqueeze(1), heads).squeeze(1)
        return weight.rows(order)
    return unpermute_rotary_rows(weight, heads)
