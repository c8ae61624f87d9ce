"""The shm and tcp transports inside one process (prefill side served by a thread):
exact bytes, authentication, shared-memory segment lifetime."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer,
                                    KVTransferConfig,
                                    ReleaseReason, TransferOutcome, allocate_kv_pool,
                                    attach_kv_pool, cleanup_stale_segments, make_transport,
                                    segment_name)
from test_kv_transfer_support import BLOCK_SIZE, BlockPool, poll_until_ended, pool_shape, random_pool

torch.set_num_threads(1)
SECRET = b"correct horse battery"


def start_prefill(transport, num_layers, num_blocks, secret=None, tmp_path=None):
    config = KVTransferConfig(transport=transport, secret=secret)
    handle = None
    if transport == "shm":
        kv, handle = allocate_kv_pool(pool_shape(num_layers, num_blocks), torch.float32,
                                      segment_name(f"t{random.randrange(1 << 30)}"))
        kv.copy_(random_pool(num_layers, num_blocks, seed=5))
    else:
        kv = random_pool(num_layers, num_blocks, seed=5)
    sender = KVSender(config, kv, "prefill-0", shm_name=handle.name if handle else "")
    server = KVServer(sender)
    server.start()
    return sender, server, handle


def make_receiver(transport, num_layers, num_blocks, secret=None):
    config = KVTransferConfig(transport=transport, secret=secret)
    dst = torch.zeros(pool_shape(num_layers, num_blocks))
    blocks = BlockPool(num_blocks, seed=9)
    return KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free), dst, blocks


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("num_layers", [2, 30])
def test_transport_moves_exactly_the_requested_blocks(transport, num_layers):
    sender, server, handle = start_prefill(transport, num_layers, 40, secret=SECRET)
    receiver, dst, blocks = make_receiver(transport, num_layers, 40, secret=SECRET)
    try:
        rng = random.Random(num_layers)
        src_free = rng.sample(range(40), 40)
        wanted = {}
        for i, n in enumerate([1, 3, 9, 17]):
            wanted[f"r{i}"] = [src_free.pop() for _ in range(n)]
            receiver.add(sender.register(f"r{i}", wanted[f"r{i}"], n * BLOCK_SIZE))
        records = poll_until_ended(receiver, num=4)
        for record in records:
            assert record.outcome is TransferOutcome.DONE, record.error
            assert torch.equal(dst[:, :, :, record.dst_block_ids],
                               sender.kv[:, :, :, wanted[record.request_id]])
            assert record.transport == transport
        touched = {b for r in records for b in r.dst_block_ids}
        assert not dst[:, :, :, [b for b in range(40) if b not in touched]].any()
        assert sorted(r.reason for r in sender.poll()) == [ReleaseReason.CONFIRMED] * 4
    finally:
        receiver.close()
        server.close()
        if handle:
            handle.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_blocks_the_decode_side_already_caches_are_not_pulled(transport):
    sender, server, handle = start_prefill(transport, 3, 16)
    config = KVTransferConfig(transport=transport)
    dst = torch.full(pool_shape(3, 16), 7.0)  # 7.0 stands for KV the decode side already has
    receiver = KVReceiver(config, dst, make_transport(config),
                          lambda request_id, n: DestinationBlocks([4, 5, 0, 9], num_cached=2),
                          lambda *_: None)
    try:
        receiver.add(sender.register("r", [1, 2, 3, 8], 4 * BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.DONE, record.error
        assert torch.equal(dst[:, :, :, [0, 9]], sender.kv[:, :, :, [3, 8]])
        assert (dst[:, :, :, [4, 5]] == 7.0).all()
        assert record.num_bytes == sender.kv[:, :, :, [3, 8]].numel() * 4
        assert record.num_cached_blocks == 2
    finally:
        receiver.close()
        server.close()
        if handle:
            handle.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("client_secret, words", [
    (b"wrong secret!", "authentication failed"),
    (None, "requires a kv secret"),
])
def test_peer_without_the_right_secret_is_refused(transport, client_secret, words):
    sender, server, handle = start_prefill(transport, 2, 8, secret=SECRET)
    receiver, dst, blocks = make_receiver(transport, 2, 8, secret=client_secret)
    try:
        receiver.add(sender.register("r", [1, 2], 2 * BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and record.error_kind == "auth"
        assert words in record.error
        assert not dst.any() and blocks.num_used == 0
        assert sender.stats().num_held == 1  # nothing was released by a stranger
        if client_secret is not None:
            assert server.num_refused_peers >= 1
    finally:
        receiver.close()
        server.close()
        if handle:
            handle.close()


def test_client_with_a_secret_refuses_an_unauthenticated_server():
    sender, server, _ = start_prefill("tcp", 2, 8, secret=None)
    receiver, dst, _ = make_receiver("tcp", 2, 8, secret=SECRET)
    try:
        receiver.add(sender.register("r", [1], BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and "does not authenticate" in record.error
    finally:
        receiver.close()
        server.close()


def test_tcp_fetch_of_an_expired_request_fails_and_frees_destination_blocks():
    sender, server, _ = start_prefill("tcp", 2, 8)
    receiver, _, blocks = make_receiver("tcp", 2, 8)
    try:
        descriptor = sender.register("r", [1], BLOCK_SIZE)
        sender.abort("r")
        receiver.add(descriptor)
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and record.error_kind == "source_gone"
        assert blocks.num_used == 0
    finally:
        receiver.close()
        server.close()


def test_stopped_prefill_instance_is_a_network_failure():
    sender, server, _ = start_prefill("tcp", 2, 8)
    descriptor = sender.register("r", [1], BLOCK_SIZE)
    server.close()
    receiver, _, blocks = make_receiver("tcp", 2, 8)
    try:
        receiver.add(descriptor)
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and record.error_kind == "network"
        assert "cannot reach" in record.error and blocks.num_used == 0
    finally:
        receiver.close()


def test_shm_segment_is_removed_on_close_and_attach_checks_the_shape(tmp_path):
    shape, name = pool_shape(2, 4), segment_name("test")  # attach accepts only names of this form
    kv, handle = allocate_kv_pool(shape, torch.float32, name, shm_dir=tmp_path)
    kv.fill_(3.0)
    with pytest.raises(ValueError, match="already exists"):
        allocate_kv_pool(shape, torch.float32, name, shm_dir=tmp_path)
    seen, reader = attach_kv_pool(name, shape, torch.float32, shm_dir=tmp_path)
    assert torch.equal(seen, kv)
    with pytest.raises(ValueError, match="disagree on the pool"):
        attach_kv_pool(name, pool_shape(3, 4), torch.float32, shm_dir=tmp_path)
    reader.close()
    handle.close()
    assert not (tmp_path / name).exists()
    with pytest.raises(ValueError, match="no shared-memory segment"):
        attach_kv_pool(name, shape, torch.float32, shm_dir=tmp_path)


def test_cleanup_removes_segments_of_dead_owners_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f"splitserve-kv-{dead_pid}-prefill").write_bytes(b"x")
    (tmp_path / f"splitserve-kv-{os.getpid()}-prefill").write_bytes(b"x")
    (tmp_path / "unrelated").write_bytes(b"x")
    assert cleanup_stale_segments(tmp_path) == [f"splitserve-kv-{dead_pid}-prefill"]
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == [
        f"splitserve-kv-{os.getpid()}-prefill", "unrelated"]



def _noncontiguous_pool(pool: torch.Tensor) -> torch.Tensor:
    """Same shape and values, not viewable as flat bytes (as a GPU pool is not)."""
    swapped = torch.empty(pool.shape[:4] + (pool.shape[5], pool.shape[4]))
    view = swapped.transpose(4, 5)
    view.copy_(pool)
    return view


@pytest.mark.parametrize("secret", [None, SECRET])  # with a secret every staged layer is tagged too
@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_tcp_stages_through_host_buffers_for_pools_without_byte_views(side, secret):
    config = KVTransferConfig(transport="tcp", secret=secret)
    src = random_pool(3, 16, seed=3)
    dst = torch.zeros(pool_shape(3, 16))
    if side == "sender":
        src = _noncontiguous_pool(src)
    else:
        dst = _noncontiguous_pool(dst)
    assert not (src.is_contiguous() and dst.is_contiguous())
    sender = KVSender(config, src, "p")
    blocks = BlockPool(16, seed=1)
    receiver = KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free)
    with KVServer(sender):
        receiver.add(sender.register("r", [3, 4, 9, 0], 4 * BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
    receiver.close()
    assert record.outcome is TransferOutcome.DONE, record.error
    assert torch.equal(dst[:, :, :, record.dst_block_ids], src[:, :, :, [3, 4, 9, 0]])


@pytest.mark.parametrize("secret", [None, SECRET])  # tags over views split across partial sends
def test_tcp_layers_of_megabytes_arrive_intact(secret):
    """Big layers make sendmsg/recvmsg_into return partial counts; nothing may slip."""
    shape = (2, 2, 3, 96, 16, 64)  # 2 * 80 blocks * 12 KiB = ~2 MB per layer
    config = KVTransferConfig(transport="tcp", secret=secret)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    dst = torch.zeros(shape)
    src_ids = random.Random(1).sample(range(96), 80)
    dst_ids = list(range(8, 48)) + random.Random(2).sample(range(48, 96), 40)
    sender = KVSender(config, src, "p")
    receiver = KVReceiver(config, dst, make_transport(config),
                          lambda request_id, n: DestinationBlocks(list(dst_ids)), lambda *_: None)
    with KVServer(sender):
        receiver.add(sender.register("big", src_ids, 80 * 16))
        [record] = poll_until_ended(receiver)
    receiver.close()
    assert record.outcome is TransferOutcome.DONE, record.error
    assert torch.equal(dst[:, :, :, dst_ids], src[:, :, :, src_ids])
    assert record.num_bytes == src[:, :, :, src_ids].numel() * 4


def test_advancing_past_partially_sent_views():
    from splitserve.kv_transfer.wire import _advance
    views = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"fgh")]
    first = _advance(views, 0, 4)
    assert first == 1 and bytes(views[1]) == b"e"
    assert _advance(views, first, 1) == 2
    assert _advance(views, 2, 3) == 3


def test_a_peer_speaking_garbage_is_dropped_and_others_are_still_served():
    import socket
    sender, server, _ = start_prefill("tcp", 2, 8)
    receiver, dst, _ = make_receiver("tcp", 2, 8)
    try:
        host, port = sender.source_info.host, sender.source_info.port
        with socket.create_connection((host, port), timeout=5) as rogue:
            rogue.recv(4096)  # the challenge
            rogue.sendall(b"\xff\xff\xff\xff" + b"GET / HTTP/1.1\r\n\r\n")  # a 4 GiB "frame"
            try:
                answer = rogue.recv(4096)
            except ConnectionResetError:  # closed with our junk unread: also a hang-up
                answer = b""
            assert answer == b"", "the server should hang up on it"
        receiver.add(sender.register("r", [1, 2], 2 * BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.DONE, record.error
    finally:
        receiver.close()
        server.close()


def test_listening_everywhere_needs_an_address_to_advertise():
    config = KVTransferConfig(transport="tcp", host="0.0.0.0", secret=SECRET)
    sender = KVSender(config, random_pool(2, 4, seed=0), "p")
    with pytest.raises(ValueError, match="advertise_host"):
        KVServer(sender).start()
