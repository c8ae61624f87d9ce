"""The prefill side's KV socket against local and on-path attackers, and a hung prefill
instance against the decode side's other transfers (in process: the server is a thread)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from splitserve.kv_transfer import KVReceiver, KVSender, KVServer, KVTransferConfig, TransferOutcome, make_transport
from splitserve.kv_transfer.messages import Abort, Begin, Confirm
from splitserve.kv_transfer.wire import connect
from test_kv_transfer_support import BLOCK_SIZE, BlockPool, poll_until_ended, pool_shape, random_pool

torch.set_num_threads(1)
SECRET = b"correct horse battery"


def start_prefill(**config):
    config = KVTransferConfig(transport="tcp", **config)
    kv = random_pool(2, 8, seed=5)
    sender = KVSender(config, kv, "prefill-0")
    server = KVServer(sender)
    server.start()
    return sender, server


def make_receiver(num_blocks: int = 8, **config):
    config = KVTransferConfig(transport="tcp", **config)
    dst = torch.zeros(pool_shape(2, num_blocks))
    blocks = BlockPool(num_blocks, seed=9)
    return KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free), dst, blocks


def test_without_the_descriptor_token_a_local_process_cannot_read_or_release_kv():
    sender, server = start_prefill()
    try:
        descriptor = sender.register("victim", [1, 2], 2 * BLOCK_SIZE)
        host, port = sender.source_info.host, sender.source_info.port
        conn = connect(host, port, None, 2, 2)
        for token in (b"", b"guess" * 4):
            for message in (Begin("victim", token), Abort("victim", token), Confirm("victim", token)):
                conn.send(message)
                assert not conn.recv().ok or isinstance(message, Abort)
        conn.close()
        assert sender.stats().num_held == 1 and sender.stats().num_confirmed == 0  # still held, untouched
        receiver, dst, _ = make_receiver()
        receiver.add(descriptor)  # the real decode instance, with the token, still gets it
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.DONE, record.error
        receiver.close()
    finally:
        server.close()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_a_peer_that_drips_its_handshake_is_dropped_at_the_deadline():
    sender, server = start_prefill(handshake_timeout_s=0.5)
    try:
        with socket.create_connection((sender.source_info.host, sender.source_info.port)) as slow:
            slow.recv(4096)  # the challenge
            start = time.monotonic()
            closed = False
            while time.monotonic() - start < 5 and not closed:
                try:
                    slow.sendall(b"\x00")  # a byte every 0.2 s: each recv alone is well inside io_timeout
                except OSError:
                    closed = True
                closed = closed or closed_within(slow, 0.2)
            assert closed and time.monotonic() - start < 3
    finally:
        server.close()


def test_connections_past_max_peers_are_closed_and_a_real_peer_is_served_after():
    sender, server = start_prefill(max_peers=2, handshake_timeout_s=1.0)
    try:
        address = (sender.source_info.host, sender.source_info.port)
        idle = [socket.create_connection(address) for _ in range(2)]
        deadline = time.monotonic() + 30  # both accepted (each has its peer thread) before the third
        while len(server._peers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with socket.create_connection(address) as third:
            third.settimeout(2)
            assert third.recv(4096) == b""  # closed on accept, no challenge
        for s in idle:
            s.close()
        assert server.num_refused_peers >= 1
        deadline = time.monotonic() + 30  # the closed peers' threads notice and leave (slowly on a loaded box)
        while len(server._peers) >= 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        receiver, _, _ = make_receiver()
        receiver.add(sender.register("r", [1], BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.DONE, record.error
        receiver.close()
    finally:
        server.close()


class FlippingProxy:
    """A man in the middle: forwards both ways, flips one byte of what the server sends."""

    def __init__(self, target: tuple[str, int], flip_at: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.target, self.flip_at = target, flip_at
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
        self._pipe(server, client, self.flip_at)

    @staticmethod
    def _pipe(src, dst, flip_at) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(bytes(data))
        except OSError:
            pass
        finally:
            dst.close()


def test_kv_bytes_altered_on_the_path_fail_the_transfer_instead_of_arriving():
    sender, server = start_prefill(secret=SECRET)
    proxy = FlippingProxy((sender.source_info.host, sender.source_info.port), flip_at=1000)
    sender.set_address(*proxy.address)  # the descriptor now points through the proxy
    receiver, dst, blocks = make_receiver(secret=SECRET)
    try:
        receiver.add(sender.register("r", [1, 2, 3, 4], 4 * BLOCK_SIZE))  # 4 KiB of KV in two layers
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and record.error_kind == "auth", record
        assert "failed authentication" in record.error and blocks.num_used == 0
    finally:
        receiver.close()
        server.close()


def test_a_decode_instance_without_a_secret_refuses_an_off_host_source():
    from splitserve.kv_transfer.transport import AuthError
    with pytest.raises(AuthError, match="--kv-secret-file"):
        connect("192.0.2.1", 9, None, 1, 1)


def test_a_hung_prefill_instance_does_not_hold_up_transfers_from_a_healthy_one():
    # A SIGSTOPped process: the kernel still accepts connections, nobody ever answers.
    hung_listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    hung = KVSender(KVTransferConfig(transport="tcp"), random_pool(2, 8, seed=1), "prefill-hung")
    hung.set_address(*hung_listener.getsockname()[:2])
    healthy, server = start_prefill()
    receiver, _, blocks = make_receiver(num_blocks=16, handshake_timeout_s=0.5)
    try:
        for i in range(6):  # more than there are pullers
            receiver.add(hung.register(f"stuck-{i}", [i], BLOCK_SIZE))
        receiver.add(healthy.register("fine", [1], BLOCK_SIZE))
        ended, start = {}, time.monotonic()
        while len(ended) < 7 and time.monotonic() - start < 20:
            for record in receiver.poll():
                ended[record.request_id] = (record, time.monotonic() - start)
            time.sleep(0.01)
        fine, fine_at = ended["fine"]
        assert fine.outcome is TransferOutcome.DONE, fine.error
        assert fine_at < min(at for rid, (_, at) in ended.items() if rid != "fine")  # not queued behind them
        for i in range(6):
            record, at = ended[f"stuck-{i}"]
            assert record.outcome is TransferOutcome.FAILED and record.error_kind == "network", record
            assert at < 10  # each gives up after the handshake deadline, far inside the 30 s lease
        assert blocks.num_used == 1  # only "fine" holds blocks (until it decodes)
    finally:
        receiver.close()
        server.close()
        hung_listener.close()


@pytest.mark.parametrize("change", [
    {"num_blocks": 10**9}, {"num_blocks": 3}, {"num_tokens": 0}, {"num_tokens": -5},
    {"source.kv_shape": (2, 2, 2, 8, 4)}, {"source.kv_shape": (2, 2, 2, 8, 4, 16)},
    {"source.kv_shape": (2, 2, 2, 0, 4, 8)}, {"source.dtype": "float16"}, {"source.transport": "shm"},
    {"source.port": 0}, {"source.port": 70000}, {"source.host": ""}, {"access_token": b"x" * 1000},
])
def test_a_malformed_descriptor_fails_its_transfer_before_any_block_or_socket(change):
    import msgspec

    sender, server = start_prefill()
    allocated = []
    config = KVTransferConfig(transport="tcp")
    receiver = KVReceiver(config, torch.zeros(pool_shape(2, 8)), make_transport(config),
                          lambda rid, n: allocated.append(n), lambda rid, ids: None)
    try:
        good = sender.register("r", [1, 2], 2 * BLOCK_SIZE)
        fields = {k: v for k, v in change.items() if not k.startswith("source.")}
        source = msgspec.structs.replace(good.source, **{k[7:]: v for k, v in change.items() if k.startswith("source.")})
        receiver.add(msgspec.structs.replace(good, source=source, **fields))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and record.error_kind == "bad_descriptor", record
        assert allocated == [] and sender.stats().num_held == 1  # nothing allocated, nobody dialled
    finally:
        receiver.close()
        server.close()


def test_a_peer_hanging_up_between_messages_is_quiet_and_one_cut_mid_message_is_logged(caplog):
    """Every decode instance closes its connection when done: that is no news at INFO. A
    connection cut inside a frame is, and says so."""
    import logging
    import struct

    sender, server = start_prefill()
    try:
        host, port = sender.source_info.host, sender.source_info.port
        with caplog.at_level(logging.DEBUG, logger="splitserve.kv_transfer.server"):
            conn = connect(host, port, None, 2, 2)
            conn.send(Abort("nobody", b""))
            conn.recv()
            conn.close()  # at a message boundary
            conn = connect(host, port, None, 2, 2)
            conn.sock.sendall(struct.pack("!I", 64) + b"\x00" * 10)  # a header promising 64 bytes, then 10
            conn.close()
            # each connection is served on its own thread: wait for both of their messages (the
            # first one's hang-up was still unlogged when the second's arrived, under two workers)
            def both_seen():
                messages = [r.getMessage() for r in caplog.records]
                return any("middle of a message" in m for m in messages) and any("hung up" in m for m in messages)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not both_seen():
                time.sleep(0.05)
        info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert any("middle of a message" in m for m in info), info
        assert sum("dropped" in m for m in info) == 1, info
        assert any(r.levelno == logging.DEBUG and "hung up" in r.getMessage() for r in caplog.records)
    finally:
        server.close()
