"""Transfers between two real processes: shm and tcp on one host, and tcp between two
network namespaces joined by a veth pair (root only)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from splitserve.kv_transfer import (KVReceiver, KVTransferConfig, TransferDescriptor,
                                    TransferOutcome, make_transport)
from test_kv_transfer_support import BlockPool, poll_until_ended, pool_shape, random_pool

torch.set_num_threads(1)
SUPPORT = str(Path(__file__).with_name("test_kv_transfer_support.py"))
SECRET = "two processes, one secret"


def spawn_prefill(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, SUPPORT, "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"prefill process ended early: {proc.stderr.read()}")
    return line


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_transfer_between_two_processes(transport):
    block_ids = [9, 2, 30, 17, 4]
    prefill = spawn_prefill("--transport", transport, "--layers", "30", "--seed", "11",
                            "--blocks", ",".join(map(str, block_ids)), "--secret", SECRET)
    try:
        descriptor = msgspec.json.decode(read_line(prefill), type=TransferDescriptor)
        config = KVTransferConfig(transport=transport, secret=SECRET)
        dst = torch.zeros(pool_shape(30, 16))
        blocks = BlockPool(16, seed=4)
        receiver = KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free)
        receiver.add(descriptor)
        [record] = poll_until_ended(receiver)
        receiver.close()
        assert record.outcome is TransferOutcome.DONE, record.error
        expected = random_pool(30, 32, seed=11)[:, :, :, block_ids]
        assert torch.equal(dst[:, :, :, record.dst_block_ids], expected)
        release = msgspec.json.decode(read_line(prefill))
        assert release == {"reason": "confirmed", "block_ids": block_ids}
        assert prefill.wait(timeout=30) == 0
        if transport == "shm":
            segment = Path("/dev/shm") / descriptor.source.shm_name
            assert not segment.exists(), "the prefill process left its segment behind"
    finally:
        prefill.kill()
        prefill.wait()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def veth_namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces and a veth pair")
    tag = str(os.getpid() % 100000)
    ns_a, ns_b = f"sskv-a-{tag}", f"sskv-b-{tag}"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", f"skva{tag}", "type", "veth", "peer", "name", f"skvb{tag}")
        _ip("link", "set", f"skva{tag}", "netns", ns_a)
        _ip("link", "set", f"skvb{tag}", "netns", ns_b)
        for ns, dev, addr in ((ns_a, f"skva{tag}", "10.77.0.1/24"),
                              (ns_b, f"skvb{tag}", "10.77.0.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create namespaces here: {exc.stderr.decode().strip()}")
    yield ns_a, ns_b
    for ns in (ns_a, ns_b):  # deleting a namespace also deletes its end of the veth pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_tcp_transfer_between_two_network_namespaces(veth_namespaces):
    ns_a, ns_b = veth_namespaces
    block_ids = "5,0,12,3"
    prefill = spawn_prefill("--transport", "tcp", "--host", "10.77.0.1", "--layers", "30",
                            "--seed", "21", "--blocks", block_ids, "--secret", SECRET,
                            prefix=("ip", "netns", "exec", ns_a))
    try:
        descriptor_json = read_line(prefill)
        assert msgspec.json.decode(descriptor_json)["source"]["host"] == "10.77.0.1"
        pull = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, SUPPORT, "pull",
                               "--descriptor", descriptor_json, "--seed", "21",
                               "--blocks", block_ids, "--secret", SECRET],
                              capture_output=True, text=True, timeout=120)
        assert pull.returncode == 0, pull.stderr
        result = msgspec.json.decode(pull.stdout.strip().splitlines()[-1])
        assert result["outcome"] == "done", result["error"]
        assert result["exact"] is True
        assert result["num_bytes"] == 30 * 2 * 4 * 4 * 2 * 8 * 4
        assert msgspec.json.decode(read_line(prefill))["reason"] == "confirmed"
    finally:
        prefill.kill()
        prefill.wait()
