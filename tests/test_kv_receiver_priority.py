"""The decode side's KV receiver takes pending transfers most urgent first under the priority policy,
in arrival order within a priority (and always in arrival order without one)."""
import torch

from splitserve.kv_transfer import KVReceiver, KVTransferConfig, TransferDescriptor, make_transport, segment_name
from splitserve.kv_transfer.messages import SourceInfo

from test_kv_transfer_support import BLOCK_SIZE, pool_shape


def receiver_asking(asked: list[str]) -> KVReceiver:
    """A receiver whose pool is full: every allocation is refused, and each request asked is noted."""
    config = KVTransferConfig(transport="shm")

    def allocate(request_id: str, num_blocks: int):
        asked.append(request_id)
        return None

    return KVReceiver(config, torch.zeros(pool_shape(2, 8)), make_transport(config), allocate, lambda *a: None)


def descriptor(request_id: str) -> TransferDescriptor:
    source = SourceInfo("p", "shm", pool_shape(2, 8), "float32", "127.0.0.1", 9, shm_name=segment_name("p"))
    return TransferDescriptor(source, request_id, BLOCK_SIZE, 1)


def test_an_urgent_transfer_takes_free_blocks_before_an_earlier_less_urgent_one():
    asked: list[str] = []
    receiver = receiver_asking(asked)
    try:
        receiver.add(descriptor("document"), priority=0)
        receiver.add(descriptor("chat"), priority=-1)
        receiver.poll()
        assert asked == ["chat"]          # the pool is full: the chat waits first in line, not behind
        receiver.abort("chat")
        receiver.poll()
        assert asked == ["chat", "document"]
    finally:
        receiver.close()


def test_equal_priorities_keep_arrival_order():
    asked: list[str] = []
    receiver = receiver_asking(asked)
    try:
        for name in ("first", "second", "third"):
            receiver.add(descriptor(name))
        receiver.poll()
        receiver.abort("first")
        receiver.poll()
        assert asked == ["first", "second"]
    finally:
        receiver.close()
