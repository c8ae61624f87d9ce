"""Random-weight Hugging Face checkpoints of real shapes, written where the check runs.

A GPU machine here can fetch nothing and carries at most 64 MiB, so no real weights travel: the
check builds each model with the transformers class itself (so transformers and splitserve load
the same tensors), randomizes the norms as tests/tiny_models.py does, and saves it in bf16 (an
fp32 load widens bf16 exactly, so the fp32 comparison still starts from identical weights). The
tokenizer is the test suite's own small byte-level BPE: prompts are token ids, so a vocabulary
larger than the tokenizer's only means some ids have no text, as in Qwen's padded vocabulary.

    path = write_checkpoint(tmp / "qwen", "qwen2.5-0.5b", device="cuda")
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from tiny_models import ARCHITECTURES, perturb_norms_and_biases, tiny_tokenizer, write_tiny_checkpoint  # noqa: E402

# name -> (architecture, transformers config settings): the published models' shapes
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}
TINY = "tiny-qwen2"  # the suite's 2-layer model, for the CPU run of the same check


def write_checkpoint(path: Path, shape: str, device: str = "cpu", seed: int = 0) -> dict:
    """Write `shape` to `path`; returns what was written (parameters, bytes, seconds)."""
    started = time.perf_counter()
    if shape == TINY:
        # a vocabulary beyond the tokenizer's, as the real shapes have: ids without text must be served too
        write_tiny_checkpoint(path, arch="qwen2", seed=seed, max_position_embeddings=4096, vocab_size=2048)
    else:
        if shape not in SHAPES:
            raise ValueError(f"unknown checkpoint shape {shape!r}; known: {', '.join([*SHAPES, TINY])}")
        arch, settings = SHAPES[shape]
        tok = tiny_tokenizer()
        config_class, model_class = ARCHITECTURES[arch]
        config = config_class(**{k: dict(v) if isinstance(v, dict) else v for k, v in settings.items()},
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = model_class(config).to(torch.bfloat16).eval()
            perturb_norms_and_biases(model)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        del model
    files = list(Path(path).glob("*.safetensors"))
    return {"shape": shape, "path": str(path), "bytes": sum(f.stat().st_size for f in files),
            "seconds": time.perf_counter() - started}
