"""The fused elementwise kernels (residual add + RMSNorm, RoPE + paged K/V write, SiLU-and-multiply)
give the torch path's results on random and odd shapes, on every instruction set this CPU has, and
an engine generates the same tokens with the kernels as with the torch fallback."""
from __future__ import annotations

import pytest
import torch

from splitserve import kernels
from splitserve.models import fused
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from kernel_support import ISAS, isa, module  # noqa: F401  (fixtures)
from tiny_models import write_tiny_checkpoint


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch_and_updates_the_residual_in_place(module, isa, with_delta):
    g = torch.Generator().manual_seed(1)
    for n, hidden in [(1, 1), (3, 7), (17, 16), (5, 33), (32, 576)]:
        x = torch.randn(n, hidden, generator=g) * 3
        delta = torch.randn(n, hidden, generator=g) if with_delta else None
        weight = torch.randn(hidden, generator=g)
        x_want = x.clone()
        want = fused.add_rms_norm_torch(x_want, delta, weight, 1e-5)
        got = module.add_rms_norm(x, x.new_empty(0) if delta is None else delta, weight, 1e-5)
        assert torch.equal(x, x_want), f"{isa} residual {n}x{hidden}"  # one fp32 add either way
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{isa} {n}x{hidden}")


def test_rope_kv_write_matches_torch_across_block_boundaries(module, isa):
    """Slots scattered over blocks, including the last slot of a block and the first of the next."""
    g = torch.Generator().manual_seed(2)
    for nq, nkv, hd in [(4, 2, 16), (9, 3, 64), (6, 6, 24), (2, 1, 2)]:
        block_size, num_blocks, n = 16, 6, 7
        cos, sin = torch.randn(100, hd // 2, generator=g), torch.randn(100, hd // 2, generator=g)
        positions = torch.randint(0, 100, (n,), generator=g)
        slots = torch.tensor([15, 16, 0, 95, 31, 32, 47])
        qkv = torch.randn(n, (nq + 2 * nkv) * hd, generator=g)
        kv = torch.randn(2, nkv, num_blocks, block_size, hd, generator=g)
        qkv_want, kv_want = qkv.clone(), kv.clone()
        fused.rope_kv_write_torch(qkv_want, cos, sin, positions, kv_want, slots, nq, nkv)
        module.rope_kv_write(qkv, cos, sin, positions, kv, slots, nq, nkv)
        # x1 * cos - x2 * sin: the same two products and one subtraction in both, so equal bit for bit
        assert torch.equal(qkv, qkv_want), f"{isa} {nq}/{nkv}/{hd}"
        assert torch.equal(kv, kv_want), f"{isa} {nq}/{nkv}/{hd}"


def test_rope_kv_write_rejects_a_slot_outside_the_cache(module):
    qkv, kv = torch.randn(1, 4 * 8), torch.zeros(2, 1, 2, 4, 8)
    cos = sin = torch.ones(10, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        module.rope_kv_write(qkv, cos, sin, torch.tensor([0]), kv, torch.tensor([8]), 2, 1)


def test_silu_mul_matches_torch_including_saturated_gates(module, isa):
    g = torch.Generator().manual_seed(3)
    for n, inter in [(1, 1), (3, 7), (17, 33), (4, 1536)]:
        gate_up = torch.randn(n, 2 * inter, generator=g) * 4
        gate_up[0, 0] = -120.0  # exp(120) overflows fp32: silu must still be -0, not NaN
        gate_up[-1, inter - 1] = 95.0
        want = fused.silu_mul_torch(gate_up)
        got = module.silu_mul(gate_up)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6, msg=f"{isa} {n}x{inter}")


def test_silu_mul_gives_the_same_bits_on_every_instruction_set(module):
    """AVX2 runs 8 lanes at a time, AVX-512 and the baseline build 16: each lane computes the same
    operations, so widths and tails (sizes off both multiples) must not change a bit."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(5, 2 * 45, generator=g) * 6
    outs = {}
    for isa in ISAS:
        outs[module.set_isa(isa)] = module.silu_mul(gate_up)
    module.set_isa("avx512")
    first = next(iter(outs.values()))
    for used, out in outs.items():
        assert torch.equal(out, first), f"{used} differs"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms before the fused rotation
def test_engine_generates_the_same_tokens_with_the_kernels_and_the_torch_fallback(module, monkeypatch,
                                                                                 tmp_path, arch):
    """Prompts ending mid-block and on a block boundary, chunked prefill, then decode."""
    path = write_tiny_checkpoint(tmp_path / arch, arch=arch)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 16, 17, 45)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = {}
    for use_kernels in (True, False):
        if not use_kernels:
            monkeypatch.setattr(kernels, "load", lambda: None)
        engine = make_engine(path, policy="chunked", budget=24)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        tokens[use_kernels] = run_to_end(engine)
    assert tokens[True] == tokens[False]
