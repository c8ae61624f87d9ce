"""What a GPU needs from the engine, checked on the CPU: the device and dtype an engine is given,
the routing that keeps the C++ CPU kernels off device tensors, the fused-attention path a CUDA
engine takes, step timing that synchronizes the device, pinned staging for a device pool's KV,
and one clear line when CUDA is asked for and absent. (What only a GPU can show is in
docs/benchmarks.md, "On a GPU".)"""
from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import pytest
import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.config import EngineConfig
from splitserve.devices import DeviceUnavailable, check_device, torch_dtype
from tiny_models import write_tiny_checkpoint

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_cpu_kernels_are_chosen_by_the_tensor_and_never_for_a_device_tensor(monkeypatch):
    assert kernels.applies_to("cpu", torch.float32)
    assert not kernels.applies_to("cuda", torch.float32)
    assert not kernels.applies_to("cuda:1", torch.float32)
    assert not kernels.applies_to("meta", torch.float32)
    assert not kernels.applies_to("cpu", torch.bfloat16)
    sentinel = object()
    monkeypatch.setattr(kernels, "load", lambda: sentinel)  # "built", whether or not they are here
    assert kernels.for_tensor(torch.zeros(2)) is sentinel
    assert kernels.for_tensor(torch.zeros(2, device="meta")) is None
    assert kernels.for_tensor(torch.zeros(2, dtype=torch.bfloat16)) is None


def test_the_fused_ops_take_the_torch_path_for_a_tensor_off_the_cpu(monkeypatch):
    from splitserve.models.fused import add_rms_norm, silu_mul

    class Refuses:
        def __getattr__(self, name):
            pytest.fail(f"the C++ kernel {name} was handed a meta tensor")

    monkeypatch.setattr(kernels, "load", lambda: Refuses())
    x = torch.empty(3, 8, device="meta")
    assert add_rms_norm(x, x, torch.empty(8, device="meta"), 1e-6).shape == (3, 8)
    assert silu_mul(torch.empty(3, 16, device="meta")).shape == (3, 8)


@pytest.mark.parametrize("causal", [True, False])
def test_repeating_kv_heads_gives_what_the_shared_heads_give(causal):
    """The path a CUDA engine's prefill takes (kv heads repeated, plain fused attention) against
    the CPU's (enable_gqa), on the same inputs."""
    from splitserve.models.llama import grouped_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 5, 16, generator=g), torch.randn(2, 9, 16, generator=g), torch.randn(2, 9, 16, generator=g)
    mask = None if causal else torch.arange(9).unsqueeze(0) <= torch.arange(4, 9).unsqueeze(1)  # a cached prefix of 4
    if causal:
        k, v = k[:, :5], v[:, :5]
    shared = grouped_attention(q, k, v, mask, causal, 0.25, repeat_heads=False)
    repeated = grouped_attention(q, k, v, mask, causal, 0.25, repeat_heads=True)
    torch.testing.assert_close(repeated, shared)
    head = 5  # query head 5 reads kv head 1 (4 query heads a kv head)
    want = F.scaled_dot_product_attention(q[head:head + 1], k[1:2], v[1:2], attn_mask=mask, is_causal=causal,
                                          scale=0.25)
    torch.testing.assert_close(shared[head:head + 1], want)


def attention_shell(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    """A LlamaModel with only what its attention methods read."""
    from splitserve.config import ModelConfig
    from splitserve.models.llama import LlamaModel

    model = LlamaModel.__new__(LlamaModel)
    model.config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=num_heads * head_dim,
                               intermediate_size=8, num_layers=1, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim)
    model.scale, model.block_size = head_dim ** -0.5, block_size
    return model


def test_decode_attention_on_gathered_blocks_matches_attention_written_out():
    """The torch decode path (a CUDA engine's, and the CPU's without the kernels): fused attention
    over each sequence's gathered blocks, padding masked, against the sums written out."""
    g = torch.Generator().manual_seed(1)
    model, block_size = attention_shell(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4), 4
    lens = [3, 9, 6]
    kv_layer = torch.randn(2, 2, 12, block_size, 8, generator=g)
    tables = torch.tensor([[5, 2, 0], [7, 1, 9], [3, 11, 0]])
    q = torch.randn(3, 4, 8, generator=g)
    visible = torch.arange(3 * block_size).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    got = model._decode_attention(q, kv_layer, tables, visible)
    for b, n in enumerate(lens):
        slots = [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(n)]
        keys = kv_layer[0].flatten(1, 2)[:, slots]  # [nkv, n, hd]
        values = kv_layer[1].flatten(1, 2)[:, slots]
        for h in range(4):
            scores = keys[h // 2] @ q[b, h] / math.sqrt(8)
            torch.testing.assert_close(got[b, h], torch.softmax(scores, 0) @ values[h // 2])


def test_prefill_slots_are_the_per_token_formula_without_the_loop():
    from splitserve.engine.model_runner import prefill_slots

    blocks = [7, 2, 9, 4]
    got = prefill_slots(blocks, 5, 14, 4).tolist()
    assert got == [blocks[p // 4] * 4 + p % 4 for p in range(5, 14)]


@NO_CUDA
def test_cuda_asked_for_and_absent_is_one_clear_error():
    with pytest.raises(DeviceUnavailable, match="--device cpu"):
        check_device("cuda")
    with pytest.raises(DeviceUnavailable, match="not supported"):
        check_device("mps")
    assert check_device("cpu") == torch.device("cpu")


@NO_CUDA
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["engine", "--connect", "tcp://127.0.0.1:9"]])
def test_the_cli_with_cuda_absent_prints_one_line_and_exits_nonzero(command):
    done = subprocess.run([sys.executable, "-m", "splitserve.cli", *command, "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "no CUDA device" in lines[0] and "--device cpu" in lines[0] and "Traceback" not in done.stderr


def test_engine_dtype_is_checked_and_crosses_the_wire():
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(dtype="bf16")
    config = EngineConfig(dtype="bfloat16")
    from splitserve.protocol import decode_engine_config, encode_engine_config

    assert decode_engine_config(encode_engine_config(config)).dtype == "bfloat16"
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(msgspec.ValidationError, match="dtype"):
        decode_engine_config(msgspec.msgpack.encode({**msgspec.to_builtins(config), "dtype": "int8"}))


def test_a_bf16_engine_holds_weights_and_kv_in_bf16_and_synchronizes_each_step(tmp_path, monkeypatch):
    from splitserve.engine import model_runner
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling import SamplingParams

    synced = []
    monkeypatch.setattr(model_runner, "synchronize", synced.append)
    llm = LLM(str(write_tiny_checkpoint(tmp_path / "m", arch="qwen2")), dtype="bfloat16", kv_cache_memory="4MiB",
              max_num_batched_tokens=8)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.runner.model.embed.dtype == torch.bfloat16
    [result] = llm.generate([list(range(3, 23))], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(result.token_ids) == 5
    # every step, the prompt's chunks that sample nothing too (20 tokens in chunks of 8: 3, then 4 decodes)
    assert synced == [torch.device("cpu")] * llm.engine.num_steps and llm.engine.num_steps == 7


def test_a_device_pool_is_staged_through_pinned_host_memory_and_a_cpu_pool_is_not():
    from splitserve.kv_transfer.host_staging import pins_for, staging_buffer

    assert pins_for("cuda") and pins_for(torch.device("cuda", 1))
    assert not pins_for("cpu") and not pins_for("meta")
    pool = torch.zeros(3, 2, 2, 10, 4, 8, dtype=torch.bfloat16)  # [layers, 2, kv_heads, blocks, block_size, hd]
    staging = staging_buffer(pool, 5)
    assert staging.shape == (2, 2, 5, 4, 8) and staging.dtype == torch.bfloat16 and not staging.is_pinned()


def test_the_shm_transport_refuses_a_device_pool_and_names_tcp():
    from splitserve.kv_transfer.config import KVTransferConfig
    from splitserve.kv_transfer.sender import KVSender

    pool = torch.empty(2, 2, 2, 8, 4, 8, device="meta")
    with pytest.raises(ValueError, match="--kv-transport tcp"):
        KVSender(KVTransferConfig(transport="shm"), pool, "prefill-0", shm_name="splitserve-kv-x")
