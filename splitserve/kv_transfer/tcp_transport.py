"""Cross-host transport: the prefill instance streams the blocks over its socket.

Per transfer, on one authenticated connection: Fetch(request_id), then for each layer
a LayerHeader and `kv[layer].index_select(2, src_blocks)` as raw bytes, written into our blocks as
they arrive (the next layer is on the wire while this one is copied); then Confirm. A streamed
descriptor (overlap mode) gets the same per block range, as the prefill finishes chunks, and the
first token at the end (server.py).
"""
from __future__ import annotations

import socket

from splitserve.kv_transfer import layout
from splitserve.kv_transfer.block_bytes import has_byte_views, id_runs, layer_views, pool_bytes
from splitserve.kv_transfer.config import KVTransferConfig
from splitserve.kv_transfer.host_staging import byte_view, staging_buffer
from splitserve.kv_transfer.messages import (BlockRange, Confirm, Fetch, LayerHeader, Reply, StreamEnd,
                                             TransferDescriptor)
from splitserve.kv_transfer.shm_transport import control_call, open_control, release_over_control
from splitserve.kv_transfer.transport import (KVTransport, NetworkError, SourceGone, TransferError,
                                              block_index, check_layout)


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, config: KVTransferConfig):
        self.config = config

    def pull(self, descriptor, dst_kv, dst_block_ids, on_layer, first_block: int = 0,
             first_token_ids: list[int] | None = None) -> int:
        """A streamed descriptor (overlap mode) also appends the prefill's first token to
        `first_token_ids`."""
        check_layout(descriptor, dst_kv, descriptor.num_blocks, dst_block_ids)
        conn = open_control(self.config, descriptor)
        try:
            conn.send(Fetch(descriptor.request_id, first_block, descriptor.access_token, descriptor.streamed))
            if descriptor.streamed:
                num_bytes, first = self._receive_rounds(conn, dst_kv, dst_block_ids, first_block, on_layer)
                if first_token_ids is not None:
                    first_token_ids.extend(first)
            else:
                num_bytes = self._receive_layers(conn, dst_kv, dst_block_ids[first_block:], on_layer)
            confirm = control_call(conn, Confirm(descriptor.request_id, descriptor.access_token))
            if not confirm.ok:
                raise SourceGone(confirm.error)
            return num_bytes
        except (OSError, socket.timeout) as exc:
            raise NetworkError(f"streaming {descriptor.request_id!r} from "
                                f"{descriptor.source.host}:{descriptor.source.port} failed: "
                                f"{exc}") from None
        finally:
            conn.close()

    def _receive_rounds(self, conn, dst_kv, dst_block_ids, first_block, on_layer) -> tuple[int, list[int]]:
        """BlockRange rounds (each: every layer of the blocks the prefill finished since the
        last), until StreamEnd brings the first token."""
        num_bytes, expected = 0, first_block
        while True:
            message = conn.recv()
            if isinstance(message, StreamEnd):
                if expected != len(dst_block_ids):
                    raise TransferError(f"the stream ended after {expected} of {len(dst_block_ids)} blocks")
                return num_bytes, list(message.first_token_ids)
            if isinstance(message, Reply):
                raise SourceGone(message.error or "prefill instance refused the fetch")
            if not isinstance(message, BlockRange) or message.first_block != expected or (
                    expected + message.num_blocks > len(dst_block_ids)):
                raise TransferError(f"expected blocks from {expected} of {len(dst_block_ids)}, got {message!r}")
            if message.num_blocks:  # else a keepalive: the prefill has no new block yet
                stop = expected + message.num_blocks
                num_bytes += self._receive_layers(conn, dst_kv, dst_block_ids[expected:stop], on_layer)
                expected = stop

    def _receive_layers(self, conn, dst_kv, dst_block_ids, on_layer) -> int:
        layer_bytes = (layout.block_numel(tuple(dst_kv.shape)) // dst_kv.shape[0]
                       * dst_kv.element_size() * len(dst_block_ids))
        if has_byte_views(dst_kv):  # straight into our blocks
            raw, runs = pool_bytes(dst_kv), id_runs(dst_block_ids)
            receive = lambda layer: conn.recv_into_views(  # noqa: E731
                layer_views(raw, tuple(dst_kv.shape), dst_kv.element_size(), layer, runs))
        else:  # a GPU pool: stage each layer on the host, then one copy to the device
            dst_index = block_index(dst_block_ids, dst_kv.device)
            # staging: [2, kv_heads, n, block_size, head_dim], pinned for CUDA, reused for every layer
            staging = staging_buffer(dst_kv, len(dst_block_ids))
            staging_raw = byte_view(staging)

            def receive(layer: int) -> None:
                conn.recv_raw_into(staging_raw)
                dst_kv[layer].index_copy_(2, dst_index, staging.to(dst_kv.device))

        for layer in range(dst_kv.shape[0]):
            on_layer(layer)
            header = conn.recv()
            if isinstance(header, Reply):
                raise SourceGone(header.error or "prefill instance refused the fetch")
            if not isinstance(header, LayerHeader) or header.layer != layer:
                raise TransferError(f"expected layer {layer} from the prefill instance, got "
                                    f"{header!r}")
            if header.num_bytes != layer_bytes:
                raise TransferError(f"layer {layer}: prefill sent {header.num_bytes} bytes, "
                                    f"{layer_bytes} expected for {len(dst_block_ids)} blocks")
            receive(layer)
        return layer_bytes * dst_kv.shape[0]

    def release(self, descriptor: TransferDescriptor) -> None:
        release_over_control(self.config, descriptor)
