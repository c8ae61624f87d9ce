"""Moving a request's KV blocks from a prefill instance to a decode instance.

Scheduler side (which blocks, who owns them, until when): `KVSender` on the prefill
instance, `KVReceiver` on the decode instance. Worker side (moving bytes): a
`KVTransport` — `fake` (in-process, tests), `shm` (same host, the prefill pool lives in
shared memory), `tcp` (across hosts, streamed by the prefill instance's `KVServer`).
See docs/internals.md, "KV transfer", for the calls an engine makes and from which thread.
"""
from __future__ import annotations

from splitserve.kv_transfer.cli_args import add_kv_arguments, kv_config_from_args
from splitserve.kv_transfer.config import TRANSPORTS, KVTransferConfig
from splitserve.kv_transfer.fake_transport import FakeNetwork, FakeTransport
from splitserve.kv_transfer.messages import (SourceInfo, TransferDescriptor, TransferOutcome,
                                             TransferRecord)
from splitserve.kv_transfer.receiver import DestinationBlocks, KVReceiver, ReceiverStats
from splitserve.kv_transfer.sender import KVSender, Release, ReleaseReason, SenderStats
from splitserve.kv_transfer.server import KVServer
from splitserve.kv_transfer.shm_pool import (allocate_kv_pool, attach_kv_pool,
                                             cleanup_stale_segments, segment_name)
from splitserve.kv_transfer.shm_transport import ShmTransport
from splitserve.kv_transfer.tcp_transport import TcpTransport
from splitserve.kv_transfer.transport import KVTransport, TransferError


def make_transport(config: KVTransferConfig, network: FakeNetwork | None = None) -> KVTransport:
    """The decode side's transport for `config.transport` (`fake` needs the FakeNetwork)."""
    if config.transport == "shm":
        return ShmTransport(config)
    if config.transport == "tcp":
        return TcpTransport(config)
    if network is None:
        raise ValueError("kv transport 'fake' works inside one process only; pass the "
                         "FakeNetwork both sides share (or choose shm or tcp)")
    return FakeTransport(network)


__all__ = [
    "TRANSPORTS", "DestinationBlocks", "FakeNetwork", "FakeTransport", "KVReceiver", "KVSender",
    "KVServer",
    "KVTransferConfig", "KVTransport", "ReceiverStats", "Release", "ReleaseReason",
    "SenderStats", "ShmTransport", "SourceInfo", "TcpTransport", "TransferDescriptor",
    "TransferError", "TransferOutcome", "TransferRecord", "allocate_kv_pool",
    "add_kv_arguments", "attach_kv_pool", "cleanup_stale_segments", "kv_config_from_args",
    "make_transport", "segment_name",
]
