"""Reading an HF checkpoint directory: config.json, *.safetensors (sharded or not), tokenizer files.

Only what the Llama-family forward pass can run faithfully is accepted: a config that asks for
something it does not do (an o_proj bias, sliding-window layers, another activation) is refused
here, naming the field, rather than loaded and run slightly wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from splitserve.config import ModelConfig

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")
_IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older checkpoints saved


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def read_hf_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        ggufs = sorted(directory.glob("*.gguf"))
        hint = f"; to load the GGUF here, pass the file itself ({ggufs[0]})" if ggufs else ""
        raise FileNotFoundError(f"no config.json in {directory}; an HF checkpoint directory needs "
                                f"config.json, *.safetensors and tokenizer.json{hint}")
    raw = read_json(config_path)
    architectures = raw.get("architectures") or []
    supported = next((name for name in architectures if name in HF_ARCHITECTURES), None)
    if supported is None:
        raise ValueError(f"{config_path}: architecture {', '.join(map(repr, architectures)) or 'None'} "
                         f"is not supported; supported: {', '.join(HF_ARCHITECTURES)}")
    arch = HF_ARCHITECTURES[supported]
    _refuse_unsupported_features(raw, arch, config_path)

    def field(name: str, default=None):
        value = raw.get(name, default)
        if value is None:
            raise ValueError(f"{config_path}: field {name!r} is missing")
        return value

    num_heads = field("num_attention_heads")
    hidden_size = field("hidden_size")
    rope_theta, rope_scaling = rope_settings(raw, config_path)
    max_positions = field("max_position_embeddings")
    if arch == "mistral" and raw.get("sliding_window"):
        # Within the window, sliding-window attention is plain causal attention; beyond it
        # we would differ, so the window becomes the context limit.
        max_positions = min(max_positions, raw["sliding_window"])
    return ModelConfig(
        architecture=arch,
        vocab_size=field("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=field("intermediate_size"),
        num_layers=field("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",  # Qwen2 always biases q/k/v; its config has no flag
        qk_norm=arch == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(raw, directory),
    )


def _refuse_unsupported_features(raw: dict, arch: str, config_path: Path) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{config_path}: hidden_act {raw['hidden_act']!r} is not supported; "
                         "the MLP is SwiGLU (silu)")
    if raw.get("attention_bias") and arch != "qwen2":
        raise ValueError(f"{config_path}: attention_bias=true (a bias on every attention projection, "
                         f"o_proj included) is not supported for {arch}")
    if raw.get("mlp_bias"):
        raise ValueError(f"{config_path}: mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{config_path}: use_sliding_window=true is not supported; "
                         "splitserve attends to the whole context")


def rope_settings(raw: dict, config_path: Path) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either spelling of an HF config.

    transformers 4.x writes `rope_theta` and `rope_scaling`; 5.x writes both inside
    `rope_parameters` (with rope_type "default" when there is no scaling).
    """
    parameters = dict(raw.get("rope_parameters") or {})
    theta = float(parameters.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = dict(raw.get("rope_scaling") or parameters)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{config_path}: rope scaling type {kind!r} is not supported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    required = ("factor", "original_max_position_embeddings") if kind == "llama3" else ("factor",)
    for name in required:
        if name not in scaling:
            raise ValueError(f"{config_path}: {kind} rope scaling needs {name!r}")
    scaling.pop("type", None)
    scaling["rope_type"] = kind
    return theta, scaling


def _eos_token_ids(raw: dict, directory: Path) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (Llama 3 lists <|eot_id|> only there)."""
    ids: list[int] = []
    sources = [raw]
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        sources.append(read_json(generation_path))
    for source in sources:
        value = source.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(dict.fromkeys(ids))


def safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        names = sorted(set(read_json(index_path).get("weight_map", {}).values()))
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard(s) {missing} that are not in {directory}")
        if names:
            return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}; splitserve reads safetensors "
                                "weights only (convert .bin/.pt checkpoints with save_pretrained)")
    return files


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, on the CPU, in its stored dtype, under its stored name."""
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(directory):
        for name, tensor in load_file(file, device="cpu").items():
            if name.endswith(_IGNORED_TENSOR_SUFFIXES):
                continue
            if name in weights:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {directory}")
            weights[name] = tensor
    return weights


def read_hf_tokenizer(directory: Path) -> tuple[PreTrainedTokenizerFast, str | None]:
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {directory}; save the "
                                "model's tokenizer next to its config.json (tokenizer.save_pretrained)")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{directory}: transformers loaded a {type(tokenizer).__name__}, not a fast "
                         "tokenizer; add the model's tokenizer.json")
    chat_template = tokenizer.chat_template
    template_file = directory / "chat_template.jinja"
    if chat_template is None and template_file.is_file():
        chat_template = tokenizer.chat_template = template_file.read_text()
    if isinstance(chat_template, dict):  # several named templates: the unnamed one is "default"
        chat_template = chat_template.get("default")
    return tokenizer, chat_template
