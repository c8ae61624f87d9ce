"""KV transfer throughput per transport, measured in one process with the project's own transports.

The prefill side (KVSender served by a KVServer thread) and the decode side (KVReceiver) run
here, as in tests/test_kv_transfer_shm_tcp.py; bench/kv_transfer.py measures the same thing
across two processes. A transfer's time is what the receiver records (connect, handshake,
copy, confirm). latency_s and gb_per_s are a least-squares line through (bytes, seconds).
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch

from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer, KVTransferConfig,
                                    TransferOutcome, allocate_kv_pool, make_transport, segment_name)


def _pull_once(receiver: KVReceiver, descriptor, timeout_s: float = 60.0):
    receiver.add(descriptor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ended = receiver.poll()
        if ended:
            return ended[0]
        time.sleep(0.0005)
    raise RuntimeError("KV transfer did not finish within 60 s")


def measure_transport(transport: str, shape: tuple[int, ...], block_counts: list[int], repeats: int,
                      block_size: int) -> dict:
    """shape: the engine's pool layout [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]."""
    pool_blocks = shape[3]
    config = KVTransferConfig(transport=transport, lease_s=600, max_concurrent_transfers=1)
    handle = None
    if transport == "shm":
        kv, handle = allocate_kv_pool(shape, torch.float32, segment_name(f"profile{random.randrange(1 << 30)}"))
        kv.normal_()
    else:
        kv = torch.randn(shape)
    sender = KVSender(config, kv, "profile-prefill", shm_name=handle.name if handle else "")
    server = KVServer(sender)
    server.start()
    dst = torch.zeros(shape)
    rng = random.Random(0)
    receiver = KVReceiver(config, dst, make_transport(config),
                          allocate=lambda request_id, n: DestinationBlocks(rng.sample(range(pool_blocks), n)),
                          free=lambda *_: None)
    samples = []
    try:
        for num_blocks in block_counts:
            seconds, num_bytes = [], 0
            for i in range(repeats):
                ids = rng.sample(range(pool_blocks), num_blocks)  # scattered, as after churn
                record = _pull_once(receiver, sender.register(f"p{num_blocks}-{i}", ids, num_blocks * block_size))
                if record.outcome is not TransferOutcome.DONE:
                    raise RuntimeError(f"{transport} transfer failed while profiling: {record.error}")
                seconds.append(record.seconds)
                num_bytes = record.num_bytes
                sender.poll()  # release the confirmed lease
            samples.append({"num_tokens": num_blocks * block_size, "bytes": num_bytes, "seconds": seconds})
    finally:
        receiver.close()
        server.close()
        if handle is not None:
            handle.close()
    x = np.asarray([s["bytes"] for s in samples], dtype=float)
    y = np.asarray([float(np.median(s["seconds"])) for s in samples])
    slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (y[0] / x[0], 0.0)
    slope = max(slope, 1e-15)
    return {"latency_s": max(float(intercept), 0.0), "gb_per_s": float(1 / slope / 1e9), "samples": samples}


def measure_kv_transfer(model_config, block_size: int, token_counts: list[int], repeats: int,
                        transports=("shm", "tcp")) -> dict:
    num_blocks = [-(-n // block_size) for n in token_counts]
    shape = (model_config.num_layers, 2, model_config.num_kv_heads, 2 * max(num_blocks), block_size,
             model_config.head_dim)
    return {t: measure_transport(t, shape, num_blocks, repeats, block_size) for t in transports}
