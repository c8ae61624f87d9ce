"""GGUF block-format weights (Q4_1, Q8_0): the C++ kernels and their pure-torch fallback give
the fp32 path's results (the same weights bit for bit, sums in another order), on every
instruction set this CPU has, and an engine on a quantized GGUF generates the fp32 engine's
greedy tokens."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.models import gguf_blocks
from splitserve.models.gguf_blocks import GGUFBlocks, dequantize_torch
from splitserve.models.loader import load_model
from splitserve.sampling import SamplingParams
from engine_support import run_to_end
from kernel_support import module  # noqa: F401  (fixture)
from tiny_models import write_tiny_checkpoint, write_tiny_gguf

QTYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[GGUFBlocks, np.ndarray]:
    """Blocks as llama.cpp's quantizer writes them, and gguf-py's fp32 dequantization of them."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(values, QTYPES[fmt])
    return GGUFBlocks.from_gguf(fmt, raw, (n, k)), gguf.quants.dequantize(raw, QTYPES[fmt]).reshape(n, k)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_blocks_dequantize_to_gguf_py_values_bit_for_bit(module, fmt):
    blocks, reference = random_blocks(fmt, 7, 96)
    assert torch.equal(dequantize_torch(blocks), torch.from_numpy(reference))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_kernel_matches_fp32_linear_on_odd_shapes(module, isa, fmt):
    used = module.set_isa(isa)  # a CPU without AVX-512 runs the best set it has instead
    try:
        # rows of x around the 8-row tile, matrices around the 2-row tile, one and three blocks
        for m, n, k in [(1, 1, 32), (7, 3, 96), (8, 2, 32), (9, 17, 64), (17, 5, 96), (64, 33, 32)]:
            blocks, reference = random_blocks(fmt, n, k, seed=m * n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            bias = torch.randn(n)
            want = F.linear(x, torch.from_numpy(reference), bias)
            got = gguf_blocks.linear(x, blocks, bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{used} {m}x{n}x{k}")
    finally:
        module.set_isa("avx512")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_batches_past_one_tile_give_the_same_bits_from_the_fp32_panel(module, isa, fmt):
    """Above 8 rows of x each weight row is dequantized once into an fp32 panel; the first 8 rows
    must come out exactly as a batch of 8 computes them, dequantizing in registers."""
    used = module.set_isa(isa)
    try:
        blocks, _ = random_blocks(fmt, 7, 96)  # 3 full 2-row tiles and a 1-row tail
        x = torch.randn(17, 96, generator=torch.Generator().manual_seed(5))
        args = (blocks.qs, blocks.d, blocks._m(), gguf_blocks.FORMATS[fmt][0])
        assert torch.equal(module.linear(x, *args)[:8], module.linear(x[:8], *args)), used
    finally:
        module.set_isa("avx512")


def test_large_batches_take_fp32_gemm_on_the_dequantized_matrix(module, monkeypatch):
    blocks, reference = random_blocks("q4_1", 5, 64)
    x = torch.randn(gguf_blocks.MAX_KERNEL_ROWS + 1, 64)

    class DequantizeOnly:
        dequantize = staticmethod(module.dequantize)

        @staticmethod
        def linear(*args):
            raise AssertionError("a prefill-sized batch reached the block kernel")

    monkeypatch.setattr(kernels, "load", DequantizeOnly)
    assert torch.equal(gguf_blocks.linear(x, blocks), F.linear(x, torch.from_numpy(reference)))


def test_fallback_without_kernels_gives_the_same_results(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda: None)
    for fmt in ("q4_1", "q8_0"):
        blocks, reference = random_blocks(fmt, 9, 64)
        x = torch.randn(3, 64)
        assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))
        torch.testing.assert_close(gguf_blocks.linear(x, blocks), F.linear(x, torch.from_numpy(reference)))


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    return write_tiny_gguf(root / "tiny-q4.gguf", write_tiny_checkpoint(root / "hf", arch="llama"),
                           quantize=True)


def test_gguf_blocks_load_in_hf_row_order(quantized_gguf):
    fp32 = load_model(quantized_gguf, weight_format="fp32").weights
    blocks = load_model(quantized_gguf, weight_format="gguf").weights
    assert sorted(fp32) == sorted(blocks)
    kept = [name for name, w in blocks.items() if isinstance(w, GGUFBlocks)]
    assert "model.layers.0.self_attn.q_proj.weight" in kept and "model.embed_tokens.weight" in kept
    for name in kept:  # q/k rows were permuted by the writer and must come back unpermuted
        assert torch.equal(blocks[name].dequantize(), fp32[name]), name


def test_weight_format_choices(quantized_gguf, monkeypatch):
    hf_dir = quantized_gguf.parent / "hf"
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(hf_dir, weight_format="gguf")
    with pytest.raises(ValueError, match="weight_format must be one of"):
        load_model(quantized_gguf, weight_format="int3")
    monkeypatch.setattr(kernels, "load", lambda: None)  # no kernels built: auto keeps fp32
    assert isinstance(load_model(quantized_gguf).weights["model.layers.0.mlp.up_proj.weight"], torch.Tensor)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch-fallback"])
def test_engine_on_quantized_gguf_generates_the_fp32_engines_tokens(quantized_gguf, module, monkeypatch,
                                                                     use_kernels):
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore

    if not use_kernels:
        monkeypatch.setattr(kernels, "load", lambda: None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 97)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for weight_format in ("fp32", "gguf"):
        config = EngineConfig(cache=CacheConfig(kv_cache_memory="2MiB"),
                              scheduler=SchedulerConfig(prefill_policy="chunked", max_num_batched_tokens=32))
        engine = EngineCore(config, load_model(quantized_gguf, weight_format=weight_format))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        tokens[weight_format] = run_to_end(engine)
    assert tokens["gguf"] == tokens["fp32"]


def decode_attention_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, lens: list[int],
                          g: torch.Generator):
    """q, a layer's cache, scattered block tables and the torch path's output (the engine's fallback)."""
    from splitserve.config import ModelConfig
    from splitserve.models.llama import LlamaModel

    b, max_blocks = len(lens), -(-max(lens) // block_size)
    num_blocks = b * max_blocks + 3
    kv_layer = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:b * max_blocks].view(b, max_blocks)
    q = torch.randn(b, num_heads, head_dim, generator=g)
    model = LlamaModel.__new__(LlamaModel)
    model.config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=num_heads * head_dim,
                               intermediate_size=8, num_layers=1, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim)
    model.scale, model.block_size = head_dim ** -0.5, block_size
    lens = torch.tensor(lens)
    visible = torch.arange(max_blocks * block_size).unsqueeze(0) < lens.unsqueeze(1)
    return q, kv_layer, tables, lens, model.scale, model._decode_attention(q, kv_layer, tables, visible)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_paged_decode_attention_matches_the_gathering_torch_path(module, isa):
    """Contexts that end mid-block, exactly on a block boundary, and at one token; blocks scattered."""
    used = module.set_isa(isa)
    try:
        g = torch.Generator().manual_seed(3)
        for num_heads, num_kv_heads, head_dim in [(4, 2, 16), (9, 3, 64), (6, 6, 24)]:
            q, kv_layer, tables, lens, scale, want = decode_attention_case(
                num_heads, num_kv_heads, head_dim, 16, [1, 16, 17, 33, 80], g)
            got = module.paged_decode_attention(q, kv_layer, tables, lens, scale)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{used} {head_dim}")
    finally:
        module.set_isa("avx512")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_paged_decode_attention_on_random_shapes_around_its_tiles(module, isa):
    """The AVX2 kernel scores 8 keys at a time and sums values 64 lanes at a time: contexts one
    short of, at and one past a tile or a block, blocks smaller than a tile, head dims with a
    partial value tile (72, 40), one not a multiple of 8 (the generic loops), and GQA groups 1-7."""
    used = module.set_isa(isa)
    try:
        g = torch.Generator().manual_seed(11)
        for block_size in (4, 8, 16, 32):
            for head_dim in (8, 12, 40, 64, 72, 128):
                group, num_kv_heads = [(1, 2), (3, 3), (7, 1)][(block_size + head_dim) % 3]
                edges = [1, 7, 8, 9, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
                lens = sorted({n for n in edges if n >= 1} | {int(torch.randint(1, 200, (1,), generator=g))})
                q, kv_layer, tables, lens, scale, want = decode_attention_case(
                    group * num_kv_heads, num_kv_heads, head_dim, block_size, lens, g)
                got = module.paged_decode_attention(q, kv_layer, tables, lens, scale)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=f"{used} block {block_size} head_dim {head_dim} group {group}")
    finally:
        module.set_isa("avx512")


# --- where the block kernel hands over to dequantize + F.linear (kernel_rows, session 28) ---

def test_crossover_rows_is_where_the_two_lines_meet():
    # kernel 1 + 0.5/row, dense 13 + 0.25/row: equal at 48 rows (times at 16 and 64 rows)
    assert gguf_blocks.crossover_rows((1 + 8, 1 + 32), (13 + 4, 13 + 16)) == 48
    # the dense path never catches up within the lines: the upper bound; always ahead: the lower
    assert gguf_blocks.crossover_rows((1.0, 2.0), (50.0, 60.0)) == gguf_blocks.MAX_CALIBRATED_ROWS
    assert gguf_blocks.crossover_rows((5.0, 20.0), (1.0, 2.0)) == gguf_blocks.MIN_KERNEL_ROWS
    assert gguf_blocks.crossover_rows((9.0, 33.0), (2.0, 3.0)) == gguf_blocks.MIN_KERNEL_ROWS  # crosses below 8


def test_linear_leaves_the_kernel_past_each_matrix_kernel_rows(module, monkeypatch):
    blocks, reference = random_blocks("q4_1", 5, 64)
    blocks.kernel_rows = 20
    calls = []
    monkeypatch.setattr(kernels, "load", lambda: type("M", (), {
        "linear": staticmethod(lambda x, *a: calls.append(x.shape[0]) or module.linear(x, *a)),
        "dequantize": staticmethod(module.dequantize)})())
    want = lambda x: F.linear(x, torch.from_numpy(reference))  # noqa: E731
    for m in (20, 21, gguf_blocks.MAX_KERNEL_ROWS):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        torch.testing.assert_close(gguf_blocks.linear(x, blocks), want(x), rtol=1e-5, atol=1e-5)
    assert calls == [20]  # 21 and 64 rows went to the dense path, though 64 is the default's kernel side


def test_calibration_sets_each_shape_from_its_own_timings_and_skips_the_warm_up():
    a1, a2 = random_blocks("q4_1", 4, 64)[0], random_blocks("q4_1", 4, 64, seed=1)[0]
    b = random_blocks("q8_0", 8, 64)[0]
    seen = []

    def time_paths(w, m):
        seen.append((w.fmt, m))
        if len([s for s in seen if s[0] == "q4_1"]) <= 2:
            return (1.0, 0.0)  # the warm-up pass: absurd times that must not be used
        # q4_1: kernel 0.5/row from 0, dense 12 + 0.25/row -> 48 rows; q8_0: dense never catches up
        return (0.5 * m, 12 + 0.25 * m) if w.fmt == "q4_1" else (0.01 * m, 50.0)

    chosen = gguf_blocks.calibrate_kernel_rows([a1, b, a2], time_paths)
    assert chosen == {("q4_1", 4, 64): 48, ("q8_0", 8, 64): gguf_blocks.MAX_CALIBRATED_ROWS}
    assert (a1.kernel_rows, a2.kernel_rows, b.kernel_rows) == (48, 48, gguf_blocks.MAX_CALIBRATED_ROWS)
    assert seen == [("q4_1", 16), ("q4_1", 64), ("q4_1", 16), ("q4_1", 64), ("q8_0", 16), ("q8_0", 64)]
    # no kernels for a shape: it keeps what it had
    c = random_blocks("q4_1", 2, 32)[0]
    assert gguf_blocks.calibrate_kernel_rows([c], lambda w, m: None) == {}
    assert c.kernel_rows == gguf_blocks.MAX_KERNEL_ROWS


def test_timing_both_paths_on_this_cpu_gives_a_crossover_in_bounds(module):
    w = random_blocks("q4_1", 256, 256)[0]
    timed = [gguf_blocks.time_both_paths(w, m, repeats=2) for m in gguf_blocks.CALIBRATION_ROWS]
    assert all(t is not None and t[0] > 0 and t[1] > 0 for t in timed)
    rows = gguf_blocks.crossover_rows((timed[0][0], timed[1][0]), (timed[0][1], timed[1][1]))
    assert gguf_blocks.MIN_KERNEL_ROWS <= rows <= gguf_blocks.MAX_CALIBRATED_ROWS


def test_engine_measures_kernel_rows_on_load_or_takes_the_number_it_is_given(module, quantized_gguf):
    from splitserve.config import CacheConfig, EngineConfig
    from splitserve.engine.core import EngineCore

    cache = CacheConfig(kv_cache_memory=2 * 2**20)
    fixed = EngineCore(EngineConfig(model=str(quantized_gguf), weight_format="gguf", kernel_rows=12, cache=cache))
    try:
        mats = fixed.runner.model.block_matrices()
        assert mats and all(w.kernel_rows == 12 for w in mats)
        assert set(fixed.kernel_rows.values()) == {12}
        fixed.add_request("a", [5, 6, 7] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
        out = run_to_end(fixed)
    finally:
        fixed.close()
    measured = EngineCore(EngineConfig(model=str(quantized_gguf), weight_format="gguf", cache=cache))
    try:
        assert measured.kernel_rows and all(gguf_blocks.MIN_KERNEL_ROWS <= r <= gguf_blocks.MAX_CALIBRATED_ROWS
                                            for r in measured.kernel_rows.values())
        measured.add_request("a", [5, 6, 7] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
        again = run_to_end(measured)
    finally:
        measured.close()
    assert again == out  # the crossover moves speed, not tokens (a 30-row prompt on either path)
    with pytest.raises(ValueError, match="kernel_rows"):
        EngineConfig(kernel_rows=-1)


def test_serve_kernel_rows_flag_takes_auto_or_rows_and_refuses_the_rest():
    import argparse

    from splitserve.entrypoints.launch import kernel_rows_arg

    assert kernel_rows_arg("auto") is None and kernel_rows_arg("AUTO") is None
    assert kernel_rows_arg("48") == 48 and kernel_rows_arg("0") == 0
    for bad in ("-3", "lots", "4.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--kernel-rows"):
            kernel_rows_arg(bad)
