"""In-process transport for tests: both pools live in one process.

`FakeNetwork` stands in for the network (senders by instance id; an explicit object,
not a global). Besides the connector's own fault injection, a test can pause or break a
transfer at a chosen layer through `layer_hook`, e.g. to abort mid-transfer.
"""
from __future__ import annotations

from splitserve.kv_transfer.messages import TransferDescriptor
from splitserve.kv_transfer.sender import KVSender
from splitserve.kv_transfer.transport import (KVTransport, LayerHook, NetworkError, SourceGone,
                                              check_layout, copy_blocks_by_layer)


class FakeNetwork:
    def __init__(self) -> None:
        self._senders: dict[str, KVSender] = {}

    def add(self, sender: KVSender) -> None:
        self._senders[sender.instance_id] = sender

    def remove(self, instance_id: str) -> None:
        self._senders.pop(instance_id, None)

    def sender(self, instance_id: str) -> KVSender:
        try:
            return self._senders[instance_id]
        except KeyError:
            raise NetworkError(f"prefill instance {instance_id!r} is not reachable") from None


class FakeTransport(KVTransport):
    name = "fake"

    def __init__(self, network: FakeNetwork, layer_hook: LayerHook | None = None):
        self.network = network
        self.layer_hook = layer_hook

    def pull(self, descriptor: TransferDescriptor, dst_kv, dst_block_ids, on_layer,
             first_block: int = 0) -> int:
        sender = self.network.sender(descriptor.source.instance_id)
        begin = sender.peer_begin(descriptor.request_id, descriptor.access_token)
        if not begin.ok:
            raise SourceGone(begin.error)
        check_layout(descriptor, dst_kv, len(begin.block_ids), dst_block_ids)

        def hooks(layer: int) -> None:
            on_layer(layer)
            if self.layer_hook is not None:
                self.layer_hook(layer)

        num_bytes = copy_blocks_by_layer(sender.kv, begin.block_ids[first_block:], dst_kv,
                                         dst_block_ids[first_block:], hooks)
        confirm = sender.peer_confirm(descriptor.request_id, descriptor.access_token)
        if not confirm.ok:
            raise SourceGone(confirm.error)
        return num_bytes

    def release(self, descriptor: TransferDescriptor) -> None:
        try:
            self.network.sender(descriptor.source.instance_id).peer_abort(descriptor.request_id,
                                                                      descriptor.access_token)
        except NetworkError:
            pass  # unreachable: its lease will free the blocks
