"""kv send mode overlap at the transfer layer: a streamed hold hands out blocks only once the
prefill has finished them, the pull receives them in rounds and ends with the first token, and
a hold the decode side gave up cannot be completed (the prefill side hands over afresh)."""
from __future__ import annotations

import time

import torch

from splitserve.kv_transfer import KVReceiver, KVSender, KVServer, KVTransferConfig, TransferOutcome, make_transport
from test_kv_transfer_support import BLOCK_SIZE, BlockPool, poll_until_ended, pool_shape, random_pool

torch.set_num_threads(1)


def test_a_streamed_hold_offers_only_finished_blocks_and_the_last_partial_one_at_completion():
    sender = KVSender(KVTransferConfig(transport="tcp"), random_pool(2, 8, seed=1), "prefill-0")
    descriptor = sender.open("r", [5, 2, 7], 2 * BLOCK_SIZE + 1)  # the third block will be partly full
    assert descriptor.streamed and descriptor.num_blocks == 3
    token = descriptor.access_token
    assert sender.wait_ready("r", token, 0, timeout_s=0.01) == (0, None)
    sender.advance("r", BLOCK_SIZE + 2)  # one whole block so far
    assert sender.wait_ready("r", token, 0, timeout_s=0.01) == (1, None)
    sender.advance("r", 2 * BLOCK_SIZE + 1)  # every token, but the prompt is not done
    assert sender.wait_ready("r", token, 1, timeout_s=0.01) == (2, None)
    assert sender.complete("r", [42])
    assert sender.wait_ready("r", token, 2, timeout_s=0.01) == (3, [42])
    assert sender.wait_ready("r", b"wrong token", 0, timeout_s=0.01) is None


def test_a_hold_the_decode_side_gave_up_cannot_be_completed():
    sender = KVSender(KVTransferConfig(transport="tcp"), random_pool(2, 8, seed=1), "prefill-0")
    descriptor = sender.open("r", [1, 2], 2 * BLOCK_SIZE)
    assert sender.peer_abort("r", descriptor.access_token).ok
    assert not sender.complete("r", [7])


def test_a_streamed_pull_receives_blocks_as_the_prefill_finishes_them_then_the_first_token():
    config = KVTransferConfig(transport="tcp")
    src = random_pool(2, 8, seed=3)
    sender = KVSender(config, src, "prefill-0")
    with KVServer(sender):
        src_ids = [6, 1, 4]
        descriptor = sender.open("r", src_ids, 3 * BLOCK_SIZE - 1)
        dst = torch.zeros(pool_shape(2, 8))
        blocks = BlockPool(8, seed=2)
        receiver = KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free)
        try:
            receiver.add(descriptor)
            receiver.poll()  # allocates and starts the puller
            time.sleep(0.2)
            assert receiver.poll() == [] and receiver.stats().num_transferring == 1  # waits for the prefill
            sender.advance("r", 2 * BLOCK_SIZE)
            time.sleep(0.2)
            assert receiver.poll() == []  # two blocks arrived; the third is not final yet
            sender.complete("r", [99])
            [record] = poll_until_ended(receiver)
        finally:
            receiver.close()
    assert record.outcome is TransferOutcome.DONE and record.first_token_ids == [99]
    for src_block, dst_block in zip(src_ids, record.dst_block_ids):
        assert torch.equal(dst[:, :, :, dst_block], src[:, :, :, src_block])
