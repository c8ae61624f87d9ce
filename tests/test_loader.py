"""Model loading: HF directories and GGUF files come out as the weights transformers holds."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.models.gguf_loader import hf_tensor_name, metadata_value, open_gguf, unpermute_rotary_rows
from splitserve.models.gguf_blocks import GGUFBlocks
from splitserve.models.loader import bundled_model_path, load_model, load_tokenizer
from tiny_models import (ARCHITECTURES, CHATML_TEMPLATE, LLAMA3_ROPE_SCALING, llama_cpp_permute,
                         write_tiny_checkpoint, write_tiny_gguf)

CHATS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "What's the capital of Italy?  Tabs\tand\nnewlines."},
     {"role": "assistant", "content": "C'est Rome."},
     {"role": "user", "content": "Ünïcödé, emoji 🦙 and <b>markup</b> too"}],
]


def hf_state_dict(path: Path, arch: str) -> dict[str, torch.Tensor]:
    return ARCHITECTURES[arch][1].from_pretrained(path, dtype=torch.float32).state_dict()


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_loads_exactly_the_weights_transformers_holds(tmp_path, arch, tied):
    path = write_tiny_checkpoint(tmp_path / arch, arch=arch, tie_word_embeddings=tied)
    loaded = load_model(path)
    expected = hf_state_dict(path, arch)
    if tied:  # transformers lists the shared matrix under both names; the contract drops lm_head
        assert expected.pop("lm_head.weight").data_ptr() == expected["model.embed_tokens.weight"].data_ptr()
    assert sorted(loaded.weights) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], tensor), name
    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == \
        (arch, len(loaded.tokenizer), 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 32 if arch == "qwen3" else 16)
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (1e-6, 10000.0, None, 512)
    assert (c.tie_word_embeddings, c.attention_bias, c.qk_norm) == (tied, arch == "qwen2", arch == "qwen3")
    assert c.eos_token_ids == (loaded.tokenizer.eos_token_id,)
    assert loaded.name == arch


def test_hf_tokenizer_and_chat_template_come_from_the_directory(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    tokenizer, chat_template = load_tokenizer(path)
    assert chat_template == CHATML_TEMPLATE
    text = tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou answer in French.<|im_end|>\n")
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    assert tokenizer.decode(ids) == text
    assert max(ids) < load_model(path).config.vocab_size


def test_llama3_rope_scaling_reaches_the_config_in_both_config_spellings(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", rope_scaling=LLAMA3_ROPE_SCALING, rope_theta=500000.0)
    assert "rope_parameters" in json.loads((path / "config.json").read_text())  # transformers 5 spelling
    config = load_model(path).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA3_ROPE_SCALING

    # transformers 4.x spelling: rope_theta and rope_scaling at the top level
    edit_config(path, rope_parameters=None, rope_theta=250000.0,
                rope_scaling={**LLAMA3_ROPE_SCALING, "factor": 4.0})
    config = load_model(path).config
    assert config.rope_theta == 250000.0
    assert config.rope_scaling == {**LLAMA3_ROPE_SCALING, "factor": 4.0}


def test_sharded_checkpoint_loads_with_and_without_its_index(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", arch="qwen2", max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    expected = hf_state_dict(path, "qwen2")
    for name, tensor in load_model(path).weights.items():
        assert torch.equal(tensor, expected[name]), name
    (path / "model.safetensors.index.json").unlink()
    assert sorted(load_model(path).weights) == sorted(expected)


def test_weights_come_in_the_requested_dtype(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    weights = load_model(path, dtype=torch.bfloat16).weights
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype=torch.int8)


def test_eos_ids_include_those_only_generation_config_lists(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(path).config.eos_token_ids == (2, 7)


def test_mistral_sliding_window_caps_the_context(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", arch="mistral", sliding_window=256)
    assert load_model(path).config.max_position_embeddings == 256


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        load_model(path)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope scaling type 'yarn'"),
])
def test_features_the_forward_pass_lacks_are_refused(tmp_path, change, message):
    path = write_tiny_checkpoint(tmp_path / "m")
    edit_config(path, **change)
    with pytest.raises(ValueError, match=message):
        load_model(path)


@pytest.mark.parametrize("missing, error, message", [
    ("config.json", FileNotFoundError, "no config.json in"),
    ("model.safetensors", FileNotFoundError, r"no \*.safetensors in"),
    ("tokenizer", FileNotFoundError, "no tokenizer.json or tokenizer_config.json in"),
])
def test_missing_file_is_named(tmp_path, missing, error, message):
    path = write_tiny_checkpoint(tmp_path / "m")
    doomed = ["tokenizer.json", "tokenizer_config.json"] if missing == "tokenizer" else [missing]
    for name in doomed:
        (path / name).unlink()
    with pytest.raises(error, match=message):
        load_model(path)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(3, 3\)"):
        load_model(path)


def test_bad_model_paths_say_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass a .gguf file"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tmp_path / "fake.gguf")
    with pytest.raises(FileNotFoundError, match=r"no config.json in .*pass the file itself \(.*fake.gguf\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("shape, num_heads", [((48, 10), 3), ((48,), 3), ((64, 8), 1)])
def test_unpermute_undoes_llama_cpp_rotary_permutation(shape, num_heads):
    weight = torch.randn(shape)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads), weight)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_file_loads_like_the_checkpoint_it_was_converted_from(tmp_path, arch):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", arch=arch, tie_word_embeddings=arch == "qwen3")
    from_gguf = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir))
    from_hf = load_model(hf_dir)
    assert sorted(from_gguf.weights) == sorted(from_hf.weights)
    for name, tensor in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps)  # GGUF holds f32
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=0.0) == \
        dataclasses.replace(from_hf.config, rms_norm_eps=0.0)
    assert from_gguf.name == "tiny" and from_gguf.chat_template == from_hf.chat_template
    for chat in CHATS:
        text = from_hf.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert from_gguf.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
        ids = from_hf.tokenizer.encode(text)
        assert from_gguf.tokenizer.encode(text) == ids
        assert from_gguf.tokenizer.decode(ids, skip_special_tokens=True) == \
            from_hf.tokenizer.decode(ids, skip_special_tokens=True)


def test_gguf_tokenizer_prepends_bos_when_the_file_says_so(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    tokenizer, _ = load_tokenizer(write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, add_bos_token=True))
    plain, _ = load_tokenizer(hf_dir)
    assert tokenizer.encode("hello world") == [plain.bos_token_id] + plain.encode("hello world")


def test_gguf_tokenizer_with_an_unfamiliar_pre_tokenizer_goes_through_transformers(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    tokenizer, chat_template = load_tokenizer(
        write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, pre_tokenizer="llama-bpe"))
    assert chat_template == CHATML_TEMPLATE
    text = tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode(ids) == text


def test_faster_gguf_reader_reads_what_the_plain_reader_reads(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", write_tiny_checkpoint(tmp_path / "hf"))
    fast, plain = open_gguf(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(plain.fields)
    for key in plain.fields:
        assert metadata_value(fast, key) == metadata_value(plain, key), key
    assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
    for ours, theirs in zip(fast.tensors, plain.tensors):
        assert np.array_equal(ours.data, theirs.data) and ours.tensor_type == theirs.tensor_type


def test_gguf_tensor_names_map_to_hf_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no counterpart"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_bundled_model_is_found_without_importing_its_package():
    path = bundled_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


@pytest.fixture(scope="module")
def bundled_gguf() -> Path:
    return bundled_model_path()


@pytest.mark.real_model
def test_bundled_gguf_loads_the_weights_transformers_dequantizes(bundled_gguf):
    """transformers' GGUF loader is the oracle: it also dequantizes and undoes the q/k permutation.
    The Q4_1/Q8_0 blocks the engine keeps by default dequantize to exactly the same weights."""
    loaded = load_model(None, weight_format="fp32")
    blocks = load_model(None, weight_format="gguf").weights
    kept = [name for name, w in blocks.items() if isinstance(w, GGUFBlocks)]
    assert len(kept) == 1 + 7 * loaded.config.num_layers  # embedding (Q8_0) + every layer matrix (Q4_1)
    for name in kept:
        assert torch.equal(blocks[name].dequantize(), loaded.weights[name]), name
    reference = AutoModelForCausalLM.from_pretrained(
        bundled_gguf.parent, gguf_file=bundled_gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    expected.pop("lm_head.weight")  # tied to the embedding: the GGUF has no output.weight
    assert sorted(loaded.weights) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded.weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    c, hf = loaded.config, reference.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == \
        (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
         hf.num_attention_heads, hf.num_key_value_heads)
    assert (c.head_dim, c.max_position_embeddings, c.tie_word_embeddings) == (64, 8192, True)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert loaded.tokenizer.eos_token == "<|im_end|>" and loaded.chat_template.startswith("{% for message")


@pytest.mark.real_model
def test_bundled_gguf_tokenizer_encodes_like_transformers(bundled_gguf):
    tokenizer, chat_template = load_tokenizer(None)
    reference = AutoTokenizer.from_pretrained(bundled_gguf.parent, gguf_file=bundled_gguf.name)
    assert chat_template == reference.chat_template
    assert len(tokenizer) == len(reference) == 49152
    for chat in CHATS:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.encode("<repo_name> and <|endoftext|>")[0] == reference.convert_tokens_to_ids("<repo_name>")
    # llama.cpp's "smollm" pre-tokenizer isolates digits before GPT-2's split; transformers'
    # conversion does not, which only shows on whitespace before a digit.
    assert tokenizer.tokenize("a  2") == ["a", "\u0120\u0120", "2"]
    assert reference.tokenize("a  2") == ["a", "\u0120", "\u0120", "2"]
