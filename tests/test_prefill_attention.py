"""The fused causal prefill attention kernel reads a chunk's keys and values in place from scattered
cache blocks and gives float64 SDPA's result, with and without cached context before the chunk, on
every instruction set this CPU has; and an engine using it generates transformers' greedy tokens,
for whole prompts and for chunked prefill."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from splitserve.sampling import SamplingParams
from engine_support import hf_greedy, make_engine, run_to_end
from kernel_support import ISAS, isa, module  # noqa: F401  (fixtures)
from tiny_models import write_tiny_checkpoint


def scattered_cache(g, nkv, hd, ctx, block_size):
    """A layer's cache with the sequence's blocks shuffled among unused ones, which hold NaN, so
    a read past the context or from another block shows up."""
    num_needed = -(-ctx // block_size)
    num_blocks = 2 * num_needed + 3
    kv = torch.full((2, nkv, num_blocks, block_size, hd), float("nan"))
    block_ids = torch.randperm(num_blocks, generator=g)[:num_needed]
    keys = torch.randn(nkv, ctx, hd, generator=g) * 2
    values = torch.randn(nkv, ctx, hd, generator=g)
    for pos in range(ctx):
        kv[0, :, block_ids[pos // block_size], pos % block_size] = keys[:, pos]
        kv[1, :, block_ids[pos // block_size], pos % block_size] = values[:, pos]
    return kv, block_ids, keys, values


def reference(q, keys, values, ctx, scale):
    # q: [t, nq, hd]; keys, values: [nkv, ctx, hd]; query i sits at position ctx - t + i
    t, nq, _ = q.shape
    group = nq // keys.shape[0]
    visible = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - t, ctx).unsqueeze(1)  # [t, ctx]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), keys.double().repeat_interleave(group, 0),
        values.double().repeat_interleave(group, 0), attn_mask=visible, scale=scale)  # [nq, t, hd]
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("nq,nkv,hd", [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 12)])
def test_prefill_kernel_matches_float64_sdpa_over_scattered_blocks(module, isa, nq, nkv, hd):
    g = torch.Generator().manual_seed(nq * 100 + hd)
    for t, cached in [(1, 0), (7, 0), (16, 0), (17, 0), (300, 0), (1, 37), (7, 21), (16, 16), (17, 100),
                      (300, 93)]:
        ctx = t + cached
        kv, block_ids, keys, values = scattered_cache(g, nkv, hd, ctx, block_size=16)
        q = torch.randn(t, nq, hd, generator=g) * 2
        got = module.paged_prefill_attention(q, kv, block_ids, ctx, hd ** -0.5)
        want = reference(q, keys, values, ctx, hd ** -0.5)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{isa} t={t} ctx={ctx} {nq}/{nkv}/{hd}")


@pytest.mark.parametrize("block_size", [4, 32])
def test_prefill_kernel_handles_blocks_smaller_and_larger_than_its_key_tile(module, isa, block_size):
    g = torch.Generator().manual_seed(block_size)
    for t, cached in [(5, 0), (40, 0), (23, 50)]:
        ctx = t + cached
        kv, block_ids, keys, values = scattered_cache(g, 2, 64, ctx, block_size)
        q = torch.randn(t, 6, 64, generator=g)
        got = module.paged_prefill_attention(q, kv, block_ids, ctx, 0.125)
        torch.testing.assert_close(got, reference(q, keys, values, ctx, 0.125), rtol=0, atol=1e-5,
                                   msg=f"{isa} block {block_size} t={t} ctx={ctx}")


def test_prefill_kernel_reads_queries_from_strided_qkv_rows(module):
    """The engine hands over q as a view of its fused qkv rows: token stride (nq + 2 nkv) * hd."""
    g = torch.Generator().manual_seed(7)
    nq, nkv, hd, t = 9, 3, 64, 33
    kv, block_ids, keys, values = scattered_cache(g, nkv, hd, t, 16)
    qkv = torch.randn(t, (nq + 2 * nkv) * hd, generator=g)
    q = qkv[:, :nq * hd].view(t, nq, hd)
    got = module.paged_prefill_attention(q, kv, block_ids, t, hd ** -0.5)
    torch.testing.assert_close(got, reference(q, keys, values, t, hd ** -0.5), rtol=0, atol=1e-5)


def test_prefill_kernel_gives_the_same_result_on_every_thread_count(module):
    g = torch.Generator().manual_seed(8)
    kv, block_ids, _, _ = scattered_cache(g, 3, 64, 200, 16)
    q = torch.randn(150, 9, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(module.paged_prefill_attention(q, kv, block_ids, 200, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs)  # each row is computed whole by one task


def test_prefill_kernel_rejects_blocks_that_do_not_cover_the_context(module):
    kv = torch.zeros(2, 1, 4, 16, 8)
    with pytest.raises(RuntimeError, match="do not cover"):
        module.paged_prefill_attention(torch.zeros(3, 1, 8), kv, torch.tensor([0, 1]), 33, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        module.paged_prefill_attention(torch.zeros(3, 1, 8), kv, torch.tensor([0, 4]), 20, 1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # head_dim 16 with group 2; qwen3: head_dim 32
@pytest.mark.parametrize("policy,budget", [("whole", 256), ("chunked", 7), ("chunked", 24)])
def test_engine_prefill_with_the_kernel_generates_transformers_greedy_tokens(module, tmp_path, monkeypatch,
                                                                             arch, policy, budget):
    path = write_tiny_checkpoint(tmp_path / arch, arch=arch)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (1, 16, 17, 45, 130)]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    calls = []
    original = module.paged_prefill_attention
    monkeypatch.setattr(module, "paged_prefill_attention", lambda *a: calls.append(a[3]) or original(*a),
                        raising=False)
    engine = make_engine(path, policy=policy, budget=budget)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got = run_to_end(engine)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert max(calls) == 130  # the kernel ran the prefills, up to the longest prompt's last chunk
