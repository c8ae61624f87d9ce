"""The transfer layer against the real engine: KV computed by a prefill-role EngineCore,
moved over tcp into another engine's pool, is all that engine needs to continue exactly
as a colocated engine would. (Until the decode role exists, the decode side here is a
colocated engine whose own KV for the request is overwritten with garbage first.)"""
from __future__ import annotations

import pytest
import torch

from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer,
                                    KVTransferConfig, ReleaseReason, TransferOutcome,
                                    make_transport)
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from test_kv_transfer_support import poll_until_ended
from tiny_models import write_tiny_checkpoint

PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("kv_engine") / "m", arch="llama")


def _prefill_elsewhere(tiny):
    """A prefill-role engine: returns it, the request (its blocks still held) and the token."""
    engine = make_engine(tiny, role="prefill")
    engine.add_request("r", PROMPT, PARAMS)
    request = engine.requests["r"]
    [output] = engine.step()
    assert output.finished and output.finish_reason == "prefill_done"
    return engine, request, output.new_token_ids


def _decode_with_garbled_kv(tiny):
    """A second engine that has run the prompt itself, then lost its KV for it."""
    engine = make_engine(tiny)
    engine.add_request("r", PROMPT, PARAMS)
    request = engine.requests["r"]
    [output] = engine.step()
    generator = torch.Generator().manual_seed(0)
    blocks = torch.tensor(request.block_table)
    kv = engine.runner.kv_cache  # [layers, 2, kv_heads, blocks, block_size, head_dim]
    garbage = torch.randn(kv.index_select(3, blocks).shape, generator=generator)
    kv.index_copy_(3, blocks, garbage)
    return engine, request, output.new_token_ids


def test_decoding_from_transferred_kv_matches_colocated(tiny):
    colocated = make_engine(tiny)
    colocated.add_request("r", PROMPT, PARAMS)
    reference = run_to_end(colocated)["r"]

    prefill, prefill_request, first = _prefill_elsewhere(tiny)
    assert first == reference[:1]
    decode, decode_request, decode_first = _decode_with_garbled_kv(tiny)

    config = KVTransferConfig(transport="tcp")
    sender = KVSender(config, prefill.runner.kv_cache, "prefill-0")
    receiver = KVReceiver(config, decode.runner.kv_cache, make_transport(config),
                          lambda request_id, n: DestinationBlocks(decode_request.block_table[:n]),
                          lambda *_: pytest.fail("no blocks should come back"))
    with KVServer(sender):
        receiver.add(sender.register("r", prefill_request.block_table,
                                     prefill_request.num_computed_tokens))
        [record] = poll_until_ended(receiver)
    receiver.close()
    assert record.outcome is TransferOutcome.DONE, record.error
    assert record.num_bytes == 3 * decode.model_config.kv_bytes_per_token * 16

    assert decode_first + run_to_end(decode)["r"] == reference

    [release] = sender.poll()
    assert release.reason is ReleaseReason.CONFIRMED
    prefill.block_manager.free(prefill_request)
    assert prefill.stats().num_free_blocks == prefill.stats().num_blocks_total


def test_without_the_transfer_the_garbled_kv_changes_the_answer(tiny):
    """The control: proves the test above depends on the bytes that were moved."""
    colocated = make_engine(tiny)
    colocated.add_request("r", PROMPT, PARAMS)
    reference = run_to_end(colocated)["r"]
    decode, _, decode_first = _decode_with_garbled_kv(tiny)
    assert decode_first + run_to_end(decode)["r"] != reference
