"""Shared pieces of the kv_transfer tests (no tests here), and a small command line
that runs one side of a transfer in its own process:

    python tests/test_kv_transfer_support.py serve --transport tcp --host H --blocks 3,1,7
        prefill side: fills a pool from --seed, holds the blocks, prints the descriptor
        (one JSON line), waits until they are released, prints the reason, exits.
    python tests/test_kv_transfer_support.py pull --descriptor JSON
        decode side: pulls into a fresh pool, checks every byte against --seed, prints
        the record (one JSON line).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer,  # noqa: E402
                                    KVTransferConfig,
                                    TransferDescriptor, allocate_kv_pool, make_transport,
                                    segment_name)

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 2, 8


def pool_shape(num_layers: int, num_blocks: int) -> tuple[int, ...]:
    """The engine's head-major layout."""
    return (num_layers, 2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)


def random_pool(num_layers: int, num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(pool_shape(num_layers, num_blocks), generator=generator)


class BlockPool:
    """A stand-in for the engine's block manager: a free list handing out ids at random."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free_ids = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_ids)
        self.owner: dict[int, str] = {}

    def take(self, request_id: str, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self.free_ids) + len(self.owner):
            raise ValueError(f"{num_blocks} blocks exceed the whole pool")
        if num_blocks > len(self.free_ids):
            return None
        ids = [self.free_ids.pop() for _ in range(num_blocks)]
        self.owner.update((b, request_id) for b in ids)
        return ids

    def allocate(self, request_id: str, num_blocks: int) -> DestinationBlocks | None:
        """The KVReceiver's allocate callback."""
        ids = self.take(request_id, num_blocks)
        return None if ids is None else DestinationBlocks(ids)

    def free(self, request_id: str, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self.owner.pop(b) == request_id, f"block {b} freed by a non-owner"
        self.free_ids.extend(block_ids)

    @property
    def num_used(self) -> int:
        return len(self.owner)


def poll_until_ended(receiver: KVReceiver, num: int = 1, limit_s: float = 60.0):
    """Poll like an engine loop would until `num` transfers have ended."""
    ended, give_up = [], time.monotonic() + limit_s
    while len(ended) < num:
        ended += receiver.poll()
        if time.monotonic() > give_up:
            raise RuntimeError(f"only {len(ended)} of {num} transfers ended within {limit_s}s")
        time.sleep(0.002)
    return ended


def serve(args) -> None:
    torch.set_num_threads(1)
    config = KVTransferConfig(transport=args.transport, host=args.host, secret=args.secret,
                              lease_s=args.lease_s)
    shape = pool_shape(args.layers, args.num_blocks)
    handle = None
    if args.transport == "shm":
        kv, handle = allocate_kv_pool(shape, torch.float32, segment_name("test-prefill"))
        kv.copy_(random_pool(args.layers, args.num_blocks, args.seed))
    else:
        kv = random_pool(args.layers, args.num_blocks, args.seed)
    sender = KVSender(config, kv, "test-prefill", shm_name=handle.name if handle else "")
    with KVServer(sender):
        block_ids = [int(b) for b in args.blocks.split(",")]
        descriptor = sender.register("req-0", block_ids, len(block_ids) * BLOCK_SIZE)
        print(msgspec.json.encode(descriptor).decode(), flush=True)
        releases = []
        while not releases:
            releases = sender.poll()
            time.sleep(0.005)
        print(msgspec.json.encode({"reason": releases[0].reason.value,
                                   "block_ids": releases[0].block_ids}).decode(), flush=True)
    # The shm segment is left to the exit-time finalizer on purpose: a test checks it.


def pull(args) -> None:
    torch.set_num_threads(1)
    descriptor = msgspec.json.decode(args.descriptor, type=TransferDescriptor)
    config = KVTransferConfig(transport=descriptor.source.transport, secret=args.secret)
    num_layers = descriptor.source.kv_shape[0]
    dst = torch.zeros(pool_shape(num_layers, args.num_blocks))
    blocks = BlockPool(args.num_blocks, seed=args.seed + 1)
    receiver = KVReceiver(config, dst, make_transport(config), blocks.allocate, blocks.free)
    receiver.add(descriptor)
    record = poll_until_ended(receiver)[0]
    receiver.close()
    src_ids = descriptor_block_ids(args.blocks)
    expected = random_pool(num_layers, descriptor.source.kv_shape[3], args.seed)  # num_blocks
    exact = bool(record.outcome.value == "done" and torch.equal(
        dst[:, :, :, record.dst_block_ids], expected[:, :, :, src_ids]))
    print(msgspec.json.encode({"outcome": record.outcome.value, "error": record.error,
                               "num_bytes": record.num_bytes, "exact": exact}).decode(), flush=True)


def descriptor_block_ids(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("side", choices=("serve", "pull"))
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--secret", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=32)
    parser.add_argument("--blocks", default="3,1,7")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--descriptor", default="")
    args = parser.parse_args()
    serve(args) if args.side == "serve" else pull(args)


if __name__ == "__main__":
    main()
