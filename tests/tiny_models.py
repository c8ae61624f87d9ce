"""Tiny random-weight HF checkpoints for fast tests.

    path = write_tiny_checkpoint(tmp_path / "m", arch="qwen2")   # config.json, model.safetensors,
                                                                # tokenizer.json, chat template

Each is built with the transformers model class itself, so loading it with splitserve and with
transformers gives the oracle the same weights. Norm weights and biases are randomized too
(transformers initializes them to 1 and 0), so a loader or forward pass that skips one fails.

The tokenizer is a small byte-level BPE (256 bytes, three ChatML specials and a few hundred
merges of common English words) with SmolLM2's ChatML template, so the model's vocabulary
stays in the hundreds and a checkpoint is written in well under a second. Pass
tokenizer="smollm" for the bundled model's real 49k-token tokenizer instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# Llama 3.1's rope scaling, with the original context shrunk to fit a 512-position model so
# that all three frequency bands (kept, divided, blended) occur.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML with tools in the Hermes form Qwen2/Qwen3 use (written for these tests): the tools as JSON
# lines in the system turn, calls as <tool_call> blocks, results in a user turn as <tool_response>
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{% if message.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_COMMON_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "hello world assistant user system question answer model token").split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: ids 0-2 ChatML specials, 3-258 the bytes, then word-building merges."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(byte_symbols))}
    merges: list[tuple[str, str]] = []
    for word in _COMMON_WORDS:
        for spelled in (word, "\u0120" + word):  # \u0120 "Ġ" is byte-level's spelling of a space
            for end in range(2, len(spelled) + 1):
                left, right, whole = spelled[:end - 1], spelled[end - 1], spelled[:end]
                if whole not in vocab:
                    vocab[whole] = len(vocab)
                    merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS))
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def smollm_tokenizer() -> PreTrainedTokenizerFast:
    from splitserve.models.loader import load_tokenizer

    tokenizer, _ = load_tokenizer(None)
    return tokenizer


def perturb_norms_and_biases(model) -> None:
    """Random weights leave norms at 1 and biases at 0, so bugs in them would not change a token:
    nudge them (from the caller's seeded generator)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn_like(parameter))


def write_tiny_checkpoint(path: str | Path, arch: str = "llama", tie_word_embeddings: bool = False,
                          seed: int = 0, tokenizer: str = "bytes", max_shard_size: str | None = None,
                          chat_template: str | None = None, **overrides) -> Path:
    """Write a 2-layer random-weight `arch` checkpoint (fp32 safetensors + tokenizer) to `path`.

    overrides go to the transformers config class (e.g. num_hidden_layers=3,
    rope_scaling=LLAMA3_ROPE_SCALING). max_shard_size="40KB" writes sharded safetensors
    with model.safetensors.index.json.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if tokenizer not in ("bytes", "smollm"):
        raise ValueError(f"tokenizer must be 'bytes' or 'smollm', got {tokenizer!r}")
    path = Path(path)
    tok = tiny_tokenizer() if tokenizer == "bytes" else smollm_tokenizer()
    config_class, model_class = ARCHITECTURES[arch]
    settings = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        # transformers' 0.02 leaves attention near uniform in a 64-wide model, so rope and
        # attention bugs would not change its tokens; 0.2 gives sharp attention and varied text.
        initializer_range=0.2)
    if arch == "qwen3":
        settings["head_dim"] = 32  # Qwen3 sets head_dim apart from hidden_size / heads
    # transformers edits dict settings in place (it adds rope_theta to rope_scaling): pass copies
    settings.update({k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()})
    config = config_class(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
        perturb_norms_and_biases(model)
    if chat_template is not None:
        tok.chat_template = chat_template
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tok.save_pretrained(path)
    return path


# HF name -> llama.cpp name, written out here independently of splitserve's loader
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)  # model.layers.N.<module>
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute of q/k rows (interleaves each head's halves)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: str | Path, hf_dir: str | Path, add_bos_token: bool = False,
                    pre_tokenizer: str = "gpt-2", quantize: bool = False) -> Path:
    """Convert a write_tiny_checkpoint directory (llama, qwen2 or qwen3) to an fp32 GGUF file,
    the way llama.cpp's convert_hf_to_gguf.py lays it out (q/k rows permuted for llama).
    quantize: store the matrices as the bundled model does (Q4_1; the embedding Q8_0)."""
    import gguf
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"write_tiny_gguf converts llama, qwen2 or qwen3 checkpoints, not {arch!r}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)  # llama.cpp's name for the split regex
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    merges = backend["model"]["merges"]  # ["a b", ...] or [["a", "b"], ...] by tokenizers version
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(add_bos_token)
    writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        if arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, kv_heads)
        values = tensor.to(torch.float32).numpy()
        if quantize and values.ndim == 2 and values.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0 if "embed_tokens" in name else gguf.GGMLQuantizationType.Q4_1
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
