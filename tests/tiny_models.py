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


def write_tiny_checkpoint(path: str | Path, arch: str = "llama", tie_word_embeddings: bool = False,
                          seed: int = 0, tokenizer: str = "bytes", max_shard_size: str | None = None,
                          **overrides) -> Path:
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
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if arch == "qwen3":
        settings["head_dim"] = 32  # Qwen3 sets head_dim apart from hidden_size / heads
    # transformers edits dict settings in place (it adds rope_theta to rope_scaling): pass copies
    settings.update({k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()})
    config = config_class(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.add_(0.1 * torch.randn_like(parameter))
                elif name.endswith(".bias"):
                    parameter.copy_(0.1 * torch.randn_like(parameter))
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tok.save_pretrained(path)
    return path
