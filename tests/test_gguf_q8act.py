"""weight_format 'gguf-q8act': rows of up to INT8_ROWS tokens multiply 8-bit-quantized activations
with the GGUF blocks in integers (llama.cpp's method). The kernels equal the torch reference of the
same arithmetic on odd shapes and every instruction set, the result stays close to the fp32 path
(x rounded to 8 bits per block), larger batches keep the fp32 path, and an engine runs on it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.models import gguf_blocks
from splitserve.models.gguf_blocks import INT8_ROWS, GGUFBlocks, linear_q8_torch, quantize_q8_torch
from splitserve.models.loader import load_model
from splitserve.sampling import SamplingParams
from engine_support import run_to_end
from test_gguf_blocks import module, quantized_gguf, random_blocks  # noqa: F401  (fixtures)


def test_quantize_q8_matches_llama_cpps_definition():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.25] * 29])
    q, d, s = quantize_q8_torch(x)
    assert d[0, 0] == 0 and s[0, 0] == 0 and torch.all(q[0, 0] == 0)  # an all-zero block
    assert d[0, 1] == pytest.approx(2.0 / 127)
    assert q[0, 1, :3].tolist() == [64, -127, 32]  # 63.5 rounds half to even: 64; 31.75 -> 32
    assert s[0, 1] == pytest.approx(d[0, 1].item() * q[0, 1].sum().item())


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_kernel_equals_the_torch_reference_on_odd_shapes(module, isa, fmt):  # noqa: F811
    used = module.set_isa(isa)
    try:
        # 1-3 rows (pairs and a single), matrices around the 4-row tile, one and three blocks
        for m, n, k in [(1, 1, 32), (2, 3, 96), (1, 4, 64), (3, 9, 96), (2, 17, 32), (1, 130, 576)]:
            blocks, _ = random_blocks(fmt, n, k, seed=m * n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + n)) * 3
            got = module.linear_q8(x, blocks.qs, blocks.d, blocks._m(), gguf_blocks.FORMATS[fmt][0])
            want = linear_q8_torch(x, blocks)
            # the integer sums are exact in both; the per-block terms are summed in fp32 here and
            # in fp64 there: cancellation leaves ~1e-6 of the largest output (a wrong nibble order,
            # a lost offset or scale would be off by whole units)
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale, msg=f"{used} {fmt} {m}x{n}x{k}")
    finally:
        module.set_isa("avx512")


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_eight_bit_activations_stay_close_to_the_fp32_path(fmt):
    blocks, reference = random_blocks(fmt, 64, 576, seed=3)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(3))
    exact = F.linear(x, torch.from_numpy(reference))
    err = (linear_q8_torch(x, blocks) - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.02, err  # not the fp32 result, but within 8-bit rounding of x


def test_linear_takes_eight_bit_activations_only_up_to_int8_rows(module, monkeypatch):  # noqa: F811
    blocks, reference = random_blocks("q4_1", 16, 64, seed=4)
    fp32 = torch.from_numpy(reference)
    calls = []
    real = module.linear_q8
    monkeypatch.setattr(kernels, "load", lambda: type("M", (), {
        "linear_q8": staticmethod(lambda *a: calls.append(a[0].shape[0]) or real(*a)),
        "linear": module.linear, "dequantize": module.dequantize})())
    x = torch.randn(INT8_ROWS + 1, 64)
    torch.testing.assert_close(gguf_blocks.linear(x, blocks), F.linear(x, fp32))  # default: never
    q8 = GGUFBlocks(blocks.fmt, blocks.qs, blocks.d, blocks.m, INT8_ROWS)
    torch.testing.assert_close(gguf_blocks.linear(x, q8), F.linear(x, fp32), rtol=1e-5, atol=1e-5)
    assert calls == []  # more rows than INT8_ROWS: the fp32 path, same results
    gguf_blocks.linear(x[:INT8_ROWS], q8)
    assert calls == [INT8_ROWS]


def test_weight_format_gguf_q8act_loads_blocks_marked_for_eight_bit_rows(quantized_gguf):  # noqa: F811
    weights = load_model(quantized_gguf, weight_format="gguf-q8act").weights
    kept = [w for w in weights.values() if isinstance(w, GGUFBlocks)]
    assert kept and all(w.int8_rows == INT8_ROWS for w in kept)
    assert all(w.int8_rows == 0 for w in load_model(quantized_gguf, weight_format="gguf").weights.values()
               if isinstance(w, GGUFBlocks))
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(quantized_gguf.parent / "hf", weight_format="gguf-q8act")


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch-fallback"])
def test_engine_on_gguf_q8act_generates_mostly_the_fp32_engines_tokens(quantized_gguf, module, monkeypatch,  # noqa: F811
                                                                       use_kernels):
    """Batch-1 decode on 8-bit activations: a random tiny model's logits are flat, so a token may
    flip where two are close; most must agree, and the run must finish every request."""
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore

    if not use_kernels:
        monkeypatch.setattr(kernels, "load", lambda: None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for weight_format in ("fp32", "gguf-q8act"):
        outs = []
        for p in prompts:  # one at a time: every decode step is a batch of one
            engine = EngineCore(EngineConfig(cache=CacheConfig(kv_cache_memory="2MiB")),
                                load_model(quantized_gguf, weight_format=weight_format))
            engine.add_request("r", p, params)
            outs.append(run_to_end(engine)["r"])
        tokens[weight_format] = outs
    same = sum(a == b for x, y in zip(tokens["fp32"], tokens["gguf-q8act"]) for a, b in zip(x, y))
    assert all(len(t) == 12 for t in tokens["gguf-q8act"])
    assert same >= 0.75 * 36, (same, tokens)
