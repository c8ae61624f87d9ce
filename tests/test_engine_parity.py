"""The engine's greedy tokens equal transformers' on tiny random-weight checkpoints of every
supported architecture, whatever the batching policy, chunk size or prefix-cache state."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from splitserve.sampling import SamplingParams
from engine_support import hf_greedy, make_engine, run_to_end
from tiny_models import LLAMA3_ROPE_SCALING, write_tiny_checkpoint

NEW_TOKENS = 12


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 16, 17, 40, 97, 130)]
    out.append(out[5][:48] + [7, 8, 9])  # shares three full blocks with prompt 5
    return out


CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE_SCALING}),
    ("mistral", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] + ("-" + "-".join(c[1]) if c[1] else ""))
def checkpoint(request, tmp_path_factory):
    arch, overrides = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(arch) / "m", arch=arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    return path, ps, [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


@pytest.mark.parametrize("policy,budget", [("chunked", 32), ("chunked", 7), ("whole", 64)])
def test_greedy_tokens_match_transformers(checkpoint, policy, budget):
    path, ps, expected = checkpoint
    engine = make_engine(path, policy=policy, budget=budget)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    got = run_to_end(engine)
    assert [got[str(i)] for i in range(len(ps))] == expected
    # A second pass over the same prompts is served largely from the prefix cache.
    hits_before = engine.stats().prefix_cache_hits
    for i, p in enumerate(ps):
        engine.add_request(f"again-{i}", p, params)
    again = run_to_end(engine)
    assert engine.stats().prefix_cache_hits - hits_before >= 16 * 8
    assert [again[f"again-{i}"] for i in range(len(ps))] == expected
    assert engine.stats().num_free_blocks == engine.stats().num_blocks_total


def test_decode_groups_split_by_length():
    from splitserve.engine.model_runner import group_by_length
    assert group_by_length([]) == []
    assert group_by_length([5, 9, 40], slack=128) == [(0, 3)]
    # a 2k context among short chats gets its own group; lengths stay in order
    assert group_by_length([30, 33, 40, 2049], slack=128) == [(0, 3), (3, 1)]
    assert group_by_length([1, 2, 3, 7, 15], slack=0) == [(0, 2), (2, 1), (3, 1), (4, 1)]


def test_greedy_tokens_match_transformers_with_many_decode_groups(checkpoint, monkeypatch):
    """Zero slack splits the tiny prompts' decodes into several attention groups (one per
    doubling of context length); the tokens must not change."""
    from splitserve.engine import model_runner
    monkeypatch.setattr(model_runner, "DECODE_GROUP_SLACK", 0)
    path, ps, expected = checkpoint
    engine = make_engine(path, policy="chunked", budget=32)
    seen = []
    original = model_runner.ModelRunner.build_batch

    def spy(self, batch):
        forward_batch, samplers = original(self, batch)
        seen.append(len(forward_batch.decode_groups))
        return forward_batch, samplers

    monkeypatch.setattr(model_runner.ModelRunner, "build_batch", spy)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    got = run_to_end(engine)
    assert max(seen) >= 3
    assert [got[str(i)] for i in range(len(ps))] == expected
