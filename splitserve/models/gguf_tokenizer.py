"""The tokenizer and chat template a GGUF file describes in its metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, the merges, each token's type and
the special token ids under tokenizer.ggml.*, plus the chat template under
tokenizer.chat_template. For byte-level BPE vocabularies whose pre-tokenizer we know (the
bundled SmolLM2 is one) the tokenizer is built here straight from the metadata already read,
which saves transformers' second pass over the file. Anything else goes through transformers'
own GGUF tokenizer conversion.
"""
from __future__ import annotations

from pathlib import Path

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from splitserve.models.gguf_loader import metadata_value

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def byte_level_pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer | None:
    """The split llama.cpp applies for `tokenizer.ggml.pre`, or None for one we do not know."""
    gpt2_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type == "gpt-2":
        return gpt2_split
    if pre_type == "smollm":
        # llama.cpp (and SmolLM's own tokenizer.json) isolate every digit before GPT-2's split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_split])
    return None


def read_gguf_tokenizer(reader: gguf.GGUFReader, path: Path) -> tuple[PreTrainedTokenizerFast, str | None]:
    chat_template = metadata_value(reader, "tokenizer.chat_template")
    tokenizer_model = metadata_value(reader, "tokenizer.ggml.model")
    if tokenizer_model is None:
        raise ValueError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    pre_tokenizer = byte_level_pre_tokenizer(metadata_value(reader, "tokenizer.ggml.pre"))
    if tokenizer_model == "gpt2" and pre_tokenizer is not None:
        tokenizer = _byte_level_bpe(reader, pre_tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ValueError(f"{path}: transformers built a {type(tokenizer).__name__} from this "
                             "GGUF, not a fast tokenizer; splitserve needs a fast tokenizer")
    tokenizer.chat_template = chat_template
    return tokenizer, chat_template


def _byte_level_bpe(reader: gguf.GGUFReader, pre_tokenizer) -> PreTrainedTokenizerFast:
    tokens: list[str] = metadata_value(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata_value(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole in text and be skippable on decode;
    # user-defined ones match whole but are ordinary text.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in zip(tokens, token_types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED])

    def token(key: str) -> str | None:
        token_id = metadata_value(reader, f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos = token("bos_token_id")
    if metadata_value(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = metadata_value(reader, "tokenizer.ggml.bos_token_id")
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"))
