"""The engine's side of the KV handover between a prefill and a decode instance.

Prefill instance (`PrefillHandover`):
    a request's prompt is computed and its first token sampled -> FINISHED_PREFILL_DONE;
    `hand_over(request)` registers its blocks with the KVSender under a lease and returns
    the TransferDescriptor the frontend forwards to a decode instance. The blocks stay
    allocated here until `poll()` reports them confirmed, expired or aborted.

Decode instance (`DecodeIntake`):
    `add(request, descriptor)`: the request (prompt + the first token) waits in
    WAITING_FOR_KV; the KVReceiver asks our block manager for destination blocks and pulls.
    `poll()` returns (request, record) for each transfer that ended: DONE requests have
    their KV and join the decode batch; FAILED ones follow the failure policy
    (`recompute`: prefill here from scratch; `fail`: finish with the error).

Everything here runs on the engine loop thread (the KV server and the pullers keep their own
threads inside kv_transfer/).
"""
from __future__ import annotations

import dataclasses

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request, RequestStatus
from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer,
                                    KVTransferConfig, TransferDescriptor, TransferOutcome,
                                    TransferRecord, allocate_kv_pool, cleanup_stale_segments,
                                    make_transport, segment_name)

FAILURE_POLICIES = ("recompute", "fail")


def allocate_pool(config: KVTransferConfig | None, role: str, instance_id: str, shape: tuple[int, ...],
                  dtype: torch.dtype, device: str):
    """The KV pool: in shared memory for a prefill instance that ships over shm, else plain."""
    if role == "prefill" and config is not None and config.transport == "shm" and device == "cpu":
        cleanup_stale_segments()
        return allocate_kv_pool(shape, dtype, segment_name(instance_id))
    return torch.zeros(shape, dtype=dtype, device=device), None


class PrefillHandover:
    def __init__(self, config: KVTransferConfig, kv: torch.Tensor, instance_id: str,
                 block_manager: BlockManager, shm_name: str = ""):
        self.sender = KVSender(config, kv, instance_id, shm_name=shm_name)
        self.server = KVServer(self.sender)
        self.server.start()
        self.blocks = block_manager
        self.held: dict[str, Request] = {}

    def hand_over(self, request: Request) -> TransferDescriptor:
        self.held[request.request_id] = request
        return self.sender.register(request.request_id, request.block_table, request.num_prompt_tokens)

    def poll(self) -> None:
        for release in self.sender.poll():
            request = self.held.pop(release.request_id, None)
            if request is not None:
                self.blocks.free(request)

    def abort(self, request_id: str) -> bool:
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.sender.abort(request_id)
        self.blocks.free(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.held) or self.sender.has_unfinished()

    def stats(self) -> dict:
        return dataclasses.asdict(self.sender.stats())

    def close(self) -> None:
        self.server.close()


class DecodeIntake:
    def __init__(self, config: KVTransferConfig, kv: torch.Tensor, block_manager: BlockManager,
                 failure_policy: str = "recompute", network=None):
        if failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv failure policy must be one of {FAILURE_POLICIES}, got {failure_policy!r}")
        self.failure_policy = failure_policy
        self.blocks = block_manager
        self.waiting: dict[str, Request] = {}
        self.receiver = KVReceiver(config, kv, make_transport(config, network), self._allocate, self._free)

    def _allocate(self, request_id: str, num_blocks: int) -> DestinationBlocks | None:
        request = self.waiting[request_id]
        need = request.num_tokens  # prompt + first token: room for the first decode step too
        if self.blocks.blocks_needed(need) > self.blocks.num_blocks:
            raise ValueError(f"request needs {self.blocks.blocks_needed(need)} KV blocks; this decode "
                             f"instance has {self.blocks.num_blocks} in all")
        if not self.blocks.can_allocate(request, need):
            return None
        self.blocks.allocate(request, need)
        return DestinationBlocks(request.block_table[:num_blocks],
                                 num_cached=request.num_cached_tokens // self.blocks.block_size)

    def _free(self, request_id: str, block_ids: list[int]) -> None:
        request = self.waiting.get(request_id)
        if request is not None:
            self.blocks.free(request)
            request.num_computed_tokens = 0

    def add(self, request: Request, descriptor: TransferDescriptor) -> None:
        if descriptor.num_tokens != request.num_prompt_tokens:
            raise ValueError(f"KV descriptor covers {descriptor.num_tokens} tokens but the prompt has "
                             f"{request.num_prompt_tokens}")
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting[request.request_id] = request
        self.receiver.add(descriptor)

    def poll(self) -> list[tuple[Request, TransferRecord]]:
        ended = []
        for record in self.receiver.poll():
            request = self.waiting.pop(record.request_id, None)
            if request is None:
                continue
            if record.outcome is TransferOutcome.DONE:
                request.num_computed_tokens = request.num_prompt_tokens
                self.blocks.publish_computed(request)
            ended.append((request, record))
        return ended

    def abort(self, request_id: str) -> bool:
        if request_id not in self.waiting:
            return False
        self.receiver.abort(request_id)
        # The blocks come back through _free, now or at a later poll; keep the request
        # findable until then.
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.receiver.has_unfinished()

    def stats(self) -> dict:
        return dataclasses.asdict(self.receiver.stats())

    def close(self) -> None:
        self.receiver.close()
