"""The connector's lifecycle over the in-process fake transport: exact bytes, leases,
aborts at every stage, injected faults, queueing when the decode pool is full."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from splitserve.kv_transfer import (DestinationBlocks, FakeNetwork, FakeTransport, KVReceiver,
                                    KVSender, KVTransferConfig, ReleaseReason, TransferOutcome)
from test_kv_transfer_support import BLOCK_SIZE, BlockPool, poll_until_ended, pool_shape, random_pool

torch.set_num_threads(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pair(num_layers=2, src_blocks=64, dst_blocks=64, layer_hook=None, clock=None, **config):
    config = KVTransferConfig(transport="fake", **config)
    src = random_pool(num_layers, src_blocks, seed=1)
    sender = KVSender(config, src, "prefill-0", clock=clock or FakeClock())
    network = FakeNetwork()
    network.add(sender)
    dst = torch.zeros(pool_shape(num_layers, dst_blocks))
    blocks = BlockPool(dst_blocks, seed=2)
    receiver = KVReceiver(config, dst, FakeTransport(network, layer_hook), blocks.allocate,
                          blocks.free)
    return sender, receiver, src, dst, blocks


@pytest.mark.parametrize("num_layers", [2, 30])
def test_fake_transfer_moves_exactly_the_requested_blocks(num_layers):
    sender, receiver, src, dst, blocks = make_pair(num_layers, src_blocks=48, dst_blocks=48)
    rng = random.Random(num_layers)
    src_free = list(range(48))
    rng.shuffle(src_free)
    wanted = {}
    for i, num_blocks in enumerate([1, 5, 12]):
        src_ids = [src_free.pop() for _ in range(num_blocks)]
        num_tokens = (num_blocks - 1) * BLOCK_SIZE + rng.randint(1, BLOCK_SIZE)
        receiver.add(sender.register(f"r{i}", src_ids, num_tokens))
        wanted[f"r{i}"] = src_ids
    records = poll_until_ended(receiver, num=3)
    touched = set()
    for record in records:
        assert record.outcome is TransferOutcome.DONE, record.error
        assert torch.equal(dst[:, :, :, record.dst_block_ids], src[:, :, :, wanted[record.request_id]])
        assert record.num_bytes == src[:, :, :, wanted[record.request_id]].numel() * 4
        assert record.end >= record.start > 0
        touched.update(record.dst_block_ids)
    untouched = [b for b in range(48) if b not in touched]
    assert not dst[:, :, :, untouched].any(), "blocks outside the destination lists were written"
    releases = sender.poll()
    assert sorted(r.request_id for r in releases) == ["r0", "r1", "r2"]
    assert all(r.reason is ReleaseReason.CONFIRMED for r in releases)
    assert receiver.stats().num_done == 3 and blocks.num_used == sum(map(len, wanted.values()))
    receiver.close()


def test_leading_blocks_the_decode_side_caches_are_not_pulled():
    config = KVTransferConfig(transport="fake")
    src = random_pool(2, 8, seed=0)
    sender = KVSender(config, src, "p")
    network = FakeNetwork()
    network.add(sender)
    dst = torch.full(pool_shape(2, 8), 7.0)
    receiver = KVReceiver(config, dst, FakeTransport(network),
                          lambda request_id, n: DestinationBlocks([6, 1, 2], num_cached=1),
                          lambda *_: None)
    receiver.add(sender.register("r", [0, 3, 5], 3 * BLOCK_SIZE))
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.DONE
    assert (dst[:, :, :, 6] == 7.0).all()
    assert torch.equal(dst[:, :, :, [1, 2]], src[:, :, :, [3, 5]])
    receiver.close()


def test_lease_expiry_frees_blocks_and_counts():
    clock = FakeClock()
    sender, receiver, *_ , blocks = make_pair(clock=clock, lease_s=30)
    descriptor = sender.register("late", [4, 5], 2 * BLOCK_SIZE)
    clock.now += 29.9
    assert sender.poll() == []
    clock.now += 0.2
    [release] = sender.poll()
    assert release.reason is ReleaseReason.EXPIRED and release.block_ids == [4, 5]
    assert sender.stats().num_lease_expiries == 1 and sender.stats().num_held == 0
    receiver.add(descriptor)  # the decode side comes too late
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.FAILED and record.error_kind == "source_gone"
    assert "lease expired" in record.error
    assert blocks.num_used == 0
    receiver.close()


def test_lease_expiring_mid_transfer_discards_what_was_read():
    clock = FakeClock()

    def expire_at_layer_1(layer):
        if layer == 1:
            clock.now += 31  # the prefill side may reuse the blocks from here on

    sender, receiver, *_, blocks = make_pair(clock=clock, layer_hook=expire_at_layer_1)
    receiver.add(sender.register("slow", [1, 2, 3], 3 * BLOCK_SIZE))
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.FAILED and record.error_kind == "source_gone"
    assert blocks.num_used == 0
    assert [r.reason for r in sender.poll()] == [ReleaseReason.EXPIRED]
    receiver.close()


def test_abort_mid_transfer_frees_blocks_on_both_sides():
    at_layer_3, resume = threading.Event(), threading.Event()

    def pause_at_layer_3(layer):
        if layer == 3:
            at_layer_3.set()
            resume.wait(10)

    sender, receiver, *_, blocks = make_pair(num_layers=6, layer_hook=pause_at_layer_3)
    receiver.add(sender.register("doomed", [10, 11, 12, 13], 4 * BLOCK_SIZE))
    assert receiver.poll() == []  # blocks allocated, puller started
    assert at_layer_3.wait(10)
    assert blocks.num_used == 4
    assert receiver.abort("doomed")
    resume.set()
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.ABORTED
    assert blocks.num_used == 0
    [release] = sender.poll()
    assert release.reason is ReleaseReason.ABORTED and release.block_ids == [10, 11, 12, 13]
    assert receiver.stats().num_aborted == 1 and sender.stats().num_held == 0
    receiver.close()


def test_abort_while_waiting_for_decode_blocks_releases_the_prefill_side():
    sender, receiver, *_, blocks = make_pair(dst_blocks=4)
    hog = blocks.take("someone-else", 3)  # only one block left
    receiver.add(sender.register("queued", [1, 2], 2 * BLOCK_SIZE))
    assert receiver.poll() == [] and receiver.stats().num_pending == 1
    assert receiver.abort("queued")
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.ABORTED
    receiver.close()  # waits for the release message to be delivered
    assert [r.reason for r in sender.poll()] == [ReleaseReason.ABORTED]
    assert blocks.num_used == len(hog)


def test_abort_on_the_prefill_side_fails_the_pull_clearly():
    sender, receiver, *_, blocks = make_pair()
    descriptor = sender.register("gone", [7], BLOCK_SIZE)
    release = sender.abort("gone")
    assert release.block_ids == [7] and release.reason is ReleaseReason.ABORTED
    assert sender.abort("gone") is None
    receiver.add(descriptor)
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.FAILED and "no longer holds" in record.error
    assert blocks.num_used == 0
    receiver.close()


def test_decode_queues_transfers_when_full_and_proceeds_in_order():
    sender, receiver, src, dst, blocks = make_pair(dst_blocks=5)
    receiver.add(sender.register("first", [1, 2, 3], 3 * BLOCK_SIZE))
    receiver.add(sender.register("second", [4, 5, 6], 3 * BLOCK_SIZE))
    assert receiver.has_unfinished() and sender.has_unfinished()
    [first] = poll_until_ended(receiver)
    assert first.request_id == "first" and receiver.stats().num_pending == 1
    assert receiver.poll() == []  # still no room for "second"
    blocks.free("first", first.dst_block_ids)  # the first request finished decoding
    [second] = poll_until_ended(receiver)
    assert second.outcome is TransferOutcome.DONE
    assert torch.equal(dst[:, :, :, second.dst_block_ids], src[:, :, :, [4, 5, 6]])
    assert not receiver.has_unfinished()
    assert len(sender.poll()) == 2 and not sender.has_unfinished()
    receiver.close()


def test_transfer_larger_than_the_decode_pool_is_refused_explicitly():
    sender, receiver, *_, blocks = make_pair(dst_blocks=2)
    receiver.add(sender.register("huge", [1, 2, 3], 3 * BLOCK_SIZE))
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.FAILED and record.error_kind == "no_space"
    assert "refused" in record.error and "exceed" in record.error
    receiver.close()
    assert [r.reason for r in sender.poll()] == [ReleaseReason.ABORTED]


def test_every_injected_fault_fails_with_a_message_and_frees_blocks():
    sender, receiver, *_, blocks = make_pair(num_layers=4, fault_rate=1.0)
    for i in range(5):
        receiver.add(sender.register(f"r{i}", [i], BLOCK_SIZE))
    records = poll_until_ended(receiver, num=5)
    assert all(r.outcome is TransferOutcome.FAILED for r in records)
    assert all("injected fault at layer" in r.error and r.error_kind == "injected" for r in records)
    assert receiver.stats().failures_by_kind == {"injected": 5}
    assert blocks.num_used == 0
    assert sorted(r.reason for r in sender.poll()) == [ReleaseReason.ABORTED] * 5
    receiver.close()


def test_partial_fault_rate_fails_some_and_the_rest_are_exact():
    sender, receiver, src, dst, blocks = make_pair(num_layers=3, src_blocks=40, dst_blocks=40,
                                                   fault_rate=0.5, seed=3)
    for i in range(40):
        receiver.add(sender.register(f"r{i}", [i], BLOCK_SIZE))
    records = poll_until_ended(receiver, num=40)
    done = [r for r in records if r.outcome is TransferOutcome.DONE]
    failed = [r for r in records if r.outcome is TransferOutcome.FAILED]
    assert 5 < len(failed) < 35 and len(done) + len(failed) == 40
    for record in done:
        source = int(record.request_id[1:])
        assert torch.equal(dst[:, :, :, record.dst_block_ids], src[:, :, :, [source]])
    assert blocks.num_used == len(done)
    receiver.close()


def test_delay_ms_slows_every_transfer_down():
    sender, receiver, *_ = make_pair(delay_ms=50)
    receiver.add(sender.register("slow", [1], BLOCK_SIZE))
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.DONE and record.end - record.start >= 0.05
    receiver.close()


def test_pools_with_different_layouts_fail_with_a_clear_message():
    config = KVTransferConfig(transport="fake")
    sender = KVSender(config, random_pool(2, 8, seed=0), "p")
    network = FakeNetwork()
    network.add(sender)
    dst = torch.zeros((2, 2, 8, BLOCK_SIZE, 2, 16))  # head_dim 16 instead of 8
    blocks = BlockPool(8)
    receiver = KVReceiver(config, dst, FakeTransport(network), blocks.allocate, blocks.free)
    receiver.add(sender.register("r", [1], BLOCK_SIZE))
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.FAILED and "disagree on the KV layout" in record.error
    assert blocks.num_used == 0
    receiver.close()


def test_unreachable_prefill_instance_is_a_network_failure():
    sender, receiver, *_ , blocks = make_pair()
    descriptor = sender.register("r", [1], BLOCK_SIZE)
    receiver.transport.network.remove("prefill-0")
    receiver.add(descriptor)
    [record] = poll_until_ended(receiver)
    assert record.outcome is TransferOutcome.FAILED and record.error_kind == "network"
    assert blocks.num_used == 0
    receiver.close()


@pytest.mark.parametrize("field, value, words", [
    ("transport", "udp", "transport must be one of"),
    ("fault_rate", 1.5, "fault_rate"),
    ("delay_ms", -1, "delay_ms"),
    ("lease_s", 0, "lease_s"),
    ("secret", b"short", "at least 8 bytes"),
    ("host", "0.0.0.0", "without a secret"),
    ("host", "10.0.0.5", "without a secret"),
])
def test_config_names_the_bad_field(field, value, words):
    with pytest.raises(ValueError, match=words):
        KVTransferConfig(**{field: value})


def test_non_loopback_host_is_fine_with_a_secret():
    assert KVTransferConfig(host="10.0.0.5", secret=b"0123456789").host == "10.0.0.5"
    assert KVTransferConfig(host="::1").host == "::1"


def test_register_rejects_too_few_blocks_and_duplicates():
    sender, receiver, *_ = make_pair()
    with pytest.raises(ValueError, match="need 2 blocks"):
        sender.register("r", [1], BLOCK_SIZE + 1)
    sender.register("r", [1], BLOCK_SIZE)
    with pytest.raises(ValueError, match="already has blocks held"):
        sender.register("r", [2], BLOCK_SIZE)
    receiver.close()


def test_contiguous_runs_cover_every_pair_once():
    from splitserve.kv_transfer.transport import contiguous_runs
    assert contiguous_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    assert contiguous_runs([], []) == []


@pytest.mark.parametrize("layout", ["contiguous", "scattered", "mixed"])
def test_block_copy_matches_plain_indexing_for_long_block_lists(layout):
    from splitserve.kv_transfer.transport import copy_blocks_by_layer
    rng = random.Random(layout)
    src, dst = random_pool(30, 200, seed=7), torch.zeros(pool_shape(30, 200))
    if layout == "contiguous":
        src_ids, dst_ids = list(range(20, 148)), list(range(60, 188))
    elif layout == "scattered":
        src_ids, dst_ids = rng.sample(range(200), 128), rng.sample(range(200), 128)
    else:
        src_ids = list(range(10, 74)) + rng.sample(range(100, 200), 64)
        dst_ids = list(range(0, 32)) + rng.sample(range(40, 200), 96)
    layers_seen = []
    num_bytes = copy_blocks_by_layer(src, src_ids, dst, dst_ids, layers_seen.append)
    assert layers_seen == list(range(30))
    reference = torch.zeros_like(dst)
    reference[:, :, :, dst_ids] = src[:, :, :, src_ids]
    assert torch.equal(dst, reference)
    assert num_bytes == src[:, :, :, src_ids].numel() * 4


def test_many_transfers_with_random_aborts_and_faults_leave_no_block_in_use():
    """Engine-loop style: both sides poll, the 'clients' abort at random stages."""
    clock = FakeClock()
    rng = random.Random(0)
    config = KVTransferConfig(transport="fake", fault_rate=0.2, lease_s=30, seed=1,
                              max_concurrent_transfers=2)
    src, dst = random_pool(4, 64, seed=1), torch.zeros(pool_shape(4, 48))
    prefill_blocks, decode_blocks = BlockPool(64, seed=3), BlockPool(48, seed=4)
    sender = KVSender(config, src, "prefill-0", clock=clock)
    network = FakeNetwork()
    network.add(sender)
    receiver = KVReceiver(config, dst, FakeTransport(network), decode_blocks.allocate,
                          decode_blocks.free)
    outcomes, started, expected, abort_at, step = {}, 0, {}, {}, 0
    while started < 200 or receiver.has_unfinished() or sender.has_unfinished():
        step += 1
        if started < 200 and prefill_blocks.free_ids and rng.random() < 0.5:
            request_id = f"r{started}"
            num_blocks = rng.randint(1, min(6, len(prefill_blocks.free_ids)))
            ids = prefill_blocks.take(request_id, num_blocks)
            expected[request_id] = src[:, :, :, ids].clone()
            descriptor = sender.register(request_id, ids, num_blocks * BLOCK_SIZE)
            if rng.random() < 0.05:
                clock.now += 31  # nobody comes for it in time
            elif rng.random() < 0.05:
                release = sender.abort(request_id)  # client left before the pull
                prefill_blocks.free(release.request_id, release.block_ids)
            receiver.add(descriptor)
            started += 1
            if rng.random() < 0.15:  # the client will leave while it waits or moves
                abort_at.setdefault(step + rng.randint(0, 20), []).append(request_id)
        for request_id in abort_at.pop(step, []):
            receiver.abort(request_id)
        for release in sender.poll():
            prefill_blocks.free(release.request_id, release.block_ids)
        for record in receiver.poll():
            outcomes[record.request_id] = record.outcome
            if record.outcome is TransferOutcome.DONE:
                assert torch.equal(dst[:, :, :, record.dst_block_ids], expected[record.request_id])
                decode_blocks.free(record.request_id, record.dst_block_ids)  # decoding ended
    receiver.close()
    assert len(outcomes) == 200
    counts = {o: list(outcomes.values()).count(o) for o in TransferOutcome}
    # The counts only show that every path ran: how many pulls finish before their scheduled abort
    # depends on how fast the pull threads get a core (over 50 on a quiet box, 43 on a loaded one,
    # 21 with two test workers and a two-process benchmark on two cores: session 37).
    assert counts[TransferOutcome.DONE] > 10 and counts[TransferOutcome.FAILED] > 10
    assert counts[TransferOutcome.ABORTED] > 5
    assert prefill_blocks.num_used == 0 and decode_blocks.num_used == 0


def test_kv_flags_build_a_config_and_name_the_bad_one(tmp_path):
    import argparse
    from splitserve.kv_transfer import add_kv_arguments, kv_config_from_args
    parser = argparse.ArgumentParser()
    add_kv_arguments(parser)
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef\n")
    config = kv_config_from_args(parser.parse_args(
        ["--kv-transport", "tcp", "--kv-fault-rate", "0.2", "--kv-delay-ms", "5",
         "--kv-host", "10.1.2.3", "--kv-secret-file", str(secret)]))
    assert (config.transport, config.fault_rate, config.delay_ms) == ("tcp", 0.2, 5.0)
    assert config.secret == b"0123456789abcdef"
    with pytest.raises(ValueError, match="without a secret.*--kv-"):
        kv_config_from_args(parser.parse_args(["--kv-host", "10.1.2.3"]))
    with pytest.raises(ValueError, match="--kv-secret-file: cannot read"):
        kv_config_from_args(parser.parse_args(["--kv-secret-file", str(tmp_path / "none")]))
