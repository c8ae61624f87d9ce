"""Same-host transport: read the prefill instance's pool straight from shared memory.

Per transfer: Begin over the prefill instance's control socket (it names the blocks
and checks the lease), copy the blocks layer by layer from the read-only mapping into
our pool, then Confirm (which fails if the blocks were released meanwhile, in which
case what we copied is discarded). A mapping is attached once per source instance and kept
while that instance lives: a restarted source (a new segment under the same instance id)
replaces it, and one whose owner process died is unmapped and its segment removed, so
restarts never pin another whole pool here.
"""
from __future__ import annotations

import threading

import torch

from splitserve.kv_transfer.config import KVTransferConfig
from splitserve.kv_transfer.messages import Abort, Begin, Confirm, Reply, TransferDescriptor
from splitserve.kv_transfer.shm_pool import (KVPoolHandle, attach_kv_pool, cleanup_stale_segments,
                                             dtype_from_name, owner_alive)
from splitserve.kv_transfer.transport import (KVTransport, NetworkError, SourceGone, TransferError,
                                              check_layout, copy_blocks_by_layer)
from splitserve.kv_transfer.wire import Connection, connect


def control_call(conn: Connection, message) -> Reply:
    """One request/answer on the control socket; socket trouble becomes TransferError."""
    try:
        conn.send(message)
        reply = conn.recv()
    except OSError as exc:
        raise NetworkError(f"control socket to the prefill instance failed: {exc}") from None
    if not isinstance(reply, Reply):
        raise TransferError(f"prefill instance answered {type(message).__name__} "
                            f"with {type(reply).__name__}")
    return reply


def open_control(config: KVTransferConfig, descriptor: TransferDescriptor) -> Connection:
    source = descriptor.source
    return connect(source.host, source.port, config.secret, config.connect_timeout_s,
                   config.io_timeout_s, config.handshake_timeout_s)


def release_over_control(config: KVTransferConfig, descriptor: TransferDescriptor) -> None:
    try:
        conn = open_control(config, descriptor)
    except TransferError:
        return  # unreachable: its lease will free the blocks
    try:
        control_call(conn, Abort(descriptor.request_id, descriptor.access_token))
    except TransferError:
        pass
    finally:
        conn.close()


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self._pools: dict[str, tuple[str, torch.Tensor, KVPoolHandle]] = {}  # instance -> (segment, ...)
        self._lock = threading.Lock()

    def _source_pool(self, descriptor: TransferDescriptor) -> torch.Tensor:
        source = descriptor.source
        if not source.shm_name:
            raise TransferError(f"prefill instance {source.instance_id} offers no shared-memory "
                                "pool; use the tcp transport, or run it with --kv-transport shm")
        with self._lock:
            self._unmap_dead_sources()
            mapped = self._pools.get(source.instance_id)
            if mapped is not None and mapped[0] != source.shm_name:  # the source restarted
                self._pools.pop(source.instance_id)[2].close()
                mapped = None
            if mapped is None:
                try:
                    kv, handle = attach_kv_pool(source.shm_name, tuple(source.kv_shape),
                                                dtype_from_name(source.dtype))
                except ValueError as exc:
                    raise TransferError(str(exc)) from None
                mapped = self._pools[source.instance_id] = (source.shm_name, kv, handle)
            return mapped[1]

    def _unmap_dead_sources(self) -> None:
        """Under the lock. A puller still copying from a dropped pool keeps it mapped until done."""
        dead = [i for i, (name, _, _) in self._pools.items() if not owner_alive(name)]
        for instance_id in dead:
            self._pools.pop(instance_id)[2].close()
        if dead:
            cleanup_stale_segments()  # a SIGKILLed owner could not remove its segment itself

    def pull(self, descriptor, dst_kv, dst_block_ids, on_layer, first_block: int = 0) -> int:
        src_kv = self._source_pool(descriptor)
        conn = open_control(self.config, descriptor)
        try:
            begin = control_call(conn, Begin(descriptor.request_id, descriptor.access_token))
            if not begin.ok:
                raise SourceGone(begin.error)
            check_layout(descriptor, dst_kv, len(begin.block_ids), dst_block_ids)
            num_bytes = copy_blocks_by_layer(src_kv, begin.block_ids[first_block:], dst_kv,
                                             dst_block_ids[first_block:], on_layer)
            confirm = control_call(conn, Confirm(descriptor.request_id, descriptor.access_token))
            if not confirm.ok:
                raise SourceGone(confirm.error)
            return num_bytes
        finally:
            conn.close()

    def release(self, descriptor: TransferDescriptor) -> None:
        release_over_control(self.config, descriptor)

    def close(self) -> None:
        with self._lock:
            pools, self._pools = self._pools, {}
        for _, _, handle in pools.values():
            handle.close()
