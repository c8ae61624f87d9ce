"""Shared-memory pools on the decode side: mapped once per live source, unmapped when the
source restarts or dies (its segment removed), names nobody can guess or plant."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.kv_transfer import (KVReceiver, KVSender, KVServer, KVTransferConfig, TransferOutcome,
                                    allocate_kv_pool, make_transport, segment_name)
from splitserve.kv_transfer.messages import SourceInfo, TransferDescriptor
from splitserve.kv_transfer.shm_pool import SHM_DIR, attach_kv_pool
from test_kv_transfer_support import BLOCK_SIZE, BlockPool, poll_until_ended, pool_shape, random_pool

torch.set_num_threads(1)


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def serve_pool(name: str):
    config = KVTransferConfig(transport="shm")
    kv, handle = allocate_kv_pool(pool_shape(2, 8), torch.float32, name)
    kv.copy_(random_pool(2, 8, seed=5))
    sender = KVSender(config, kv, "prefill-0", shm_name=name)  # same instance id: a restart
    server = KVServer(sender)
    server.start()
    return sender, server, handle


def mapped(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def test_a_restarted_or_killed_source_is_unmapped_and_its_segment_removed():
    # the first incarnation's segment carries the pid of a process that is gone (SIGKILLed)
    first_name = f"splitserve-kv-{dead_pid()}-prefill-0-{os.urandom(8).hex()}"
    first, first_server, first_handle = serve_pool(first_name)
    first_handle._finalizer.detach()  # a killed owner never unlinks
    config = KVTransferConfig(transport="shm")
    dst = torch.zeros(pool_shape(2, 16))
    blocks = BlockPool(16, seed=9)
    receiver = KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free)
    second_server = second_handle = None
    try:
        receiver.add(first.register("before", [1, 2], 2 * BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.DONE, record.error
        assert mapped(first_name)
        first_server.close()
        first_handle._mmap.close()  # the owner's own mapping ends with its process
        del first
        second, second_server, second_handle = serve_pool(segment_name("prefill-0"))
        receiver.add(second.register("after", [3], BLOCK_SIZE))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.DONE, record.error
        assert not mapped(first_name), "the dead source's pool is still mapped"
        assert not (SHM_DIR / first_name).exists(), "the dead source's segment was left in /dev/shm"
        assert mapped(second_handle.name)
    finally:
        receiver.close()
        for server in (first_server, second_server):
            if server is not None:
                server.close()
        (SHM_DIR / first_name).unlink(missing_ok=True)
        if second_handle is not None:
            second_handle.close()


def test_segment_names_are_unguessable_and_attach_refuses_foreign_names(tmp_path):
    names = {segment_name("prefill-0") for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(f"splitserve-kv-{os.getpid()}-prefill-0-") for n in names)
    for hostile in ("../../etc/passwd", "splitserve-kv-1-a/../../x", "", "other-segment"):
        with pytest.raises(ValueError):
            attach_kv_pool(hostile, pool_shape(2, 4), torch.float32, shm_dir=tmp_path)


def test_a_descriptor_with_a_hostile_segment_name_fails_cleanly():
    config = KVTransferConfig(transport="shm")
    dst = torch.zeros(pool_shape(2, 8))
    blocks = BlockPool(8, seed=9)
    receiver = KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free)
    source = SourceInfo("p", "shm", pool_shape(2, 8), "float32", "127.0.0.1", 9, shm_name="../../dev/zero")
    try:
        receiver.add(TransferDescriptor(source, "r", BLOCK_SIZE, 1))
        [record] = poll_until_ended(receiver)
        assert record.outcome is TransferOutcome.FAILED and "segment name" in record.error, record
        assert blocks.num_used == 0
    finally:
        receiver.close()
