"""Roles as connectors: what happens to a request's KV at the edges of the engine.

The engine loop and the scheduler never ask which role they play; they ask the connector
(as vLLM v1's scheduler asks its KV connector):

    on_add(request, descriptor)  a request arrives. True: the connector keeps it until its KV is
                                 here (decode); False: it goes to the scheduler's waiting queue.
    poll()                       once per step: requests whose KV arrived (join as decodes), whose
                                 transfer failed and must be prefilled here (`recompute`), or
                                 that failed (`fail`), as `Arrivals`.
    on_finished(request)         a request's run here ended -> (keep_blocks, kv_params): a prefill
                                 instance keeps a prompt's blocks under a lease and returns the
                                 TransferDescriptor the frontend forwards to a decode instance.
    abort(request_id)            the connector's own share of an abort (held blocks, a transfer).
    prompt_tokens_per_step(streams_here)  the cap on a step's prompt tokens (None: the step budget
                                 alone), given whether streams that answer here are decoding.
    has_unfinished() / stats() / close()

Three connectors, one per role:
    ColocatedConnector  nothing arrives from or leaves for elsewhere.
    PrefillConnector    marks each new request `remote_decode`: it stops after its first token
                        (FINISHED_PREFILL_DONE) and its blocks wait for a decode instance.
    DecodeConnector     a request with a descriptor waits (WAITING_FOR_KV) while the KVReceiver
                        pulls its blocks; owns the failure policy and decides the outcome the
                        engine reports: ok | recomputed | failed.

A live role change (EngineCore.change_role) waits until the old connector has nothing in flight,
closes it and makes the new one: requests already decoding keep running under any connector. A
prefill connector that inherits such streams (from a colocated or decode role) gives them steps of
at most `chunk_tokens` prompt tokens until the last one ends, so they keep the gaps a decode
instance's local prefill keeps (issue 31), instead of meeting whole step budgets of prompts.

Everything here runs on the engine loop thread (the KV server and the pullers keep their own
threads inside kv_transfer/).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from splitserve.config import CARRIED_CHUNK_TOKENS, EngineConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request, RequestOutput, RequestStatus
from splitserve.kv_transfer import (DestinationBlocks, KVReceiver, KVSender, KVServer,
                                    TransferDescriptor, TransferOutcome, allocate_kv_pool,
                                    cleanup_stale_segments, make_transport, segment_name)
from splitserve.protocol import KVStats

FAILURE_POLICIES = ("recompute", "fail")
MakeRoom = Callable[[Request, int], bool]  # (request, num_tokens) -> may its blocks be allocated now


def allocate_kv_cache(config: EngineConfig, shape: tuple[int, ...], dtype: torch.dtype):
    """The KV pool, whatever the role: in shared memory whenever KV may leave over shm, so a role
    change never has to move the cache (a decode instance may become a prefill one)."""
    kv = config.kv_transfer
    if kv is not None and kv.transport == "shm" and config.device == "cpu":
        cleanup_stale_segments()
        return allocate_kv_pool(shape, dtype, segment_name(config.instance_id))
    return torch.zeros(shape, dtype=dtype, device=config.device), None


@dataclass(slots=True)
class Arrivals:
    """What a connector's poll() hands the scheduler (or the client) this step."""

    decode: list[Request] = field(default_factory=list)  # KV arrived: join the running batch
    prefill: list[Request] = field(default_factory=list)  # transfer failed: prefill here
    failed: list[RequestOutput] = field(default_factory=list)  # transfer failed: the request ends


class ColocatedConnector:
    role = "colocated"
    # prompt tokens a step carries beside streams that answer here (None: max_num_batched_tokens
    # alone); EngineCore.set_chunk_tokens moves it live (the mix controller's chunk-budget knob)
    chunk_tokens: int | None = None

    def prompt_tokens_per_step(self, streams_here: bool) -> int | None:
        """The scheduler's cap on this step's prompt tokens (None: none besides the step budget)."""
        return self.chunk_tokens

    def on_add(self, request: Request, descriptor: TransferDescriptor | None) -> bool:
        if descriptor is not None:
            raise ValueError(f"a KV descriptor can only go to a decode-role instance; this one is {self.role}")
        return False

    def poll(self) -> Arrivals:
        return Arrivals()

    def on_finished(self, request: Request) -> tuple[bool, TransferDescriptor | None]:
        return False, None

    def on_prefill_progress(self, request: Request) -> TransferDescriptor | None:
        """After a prompt chunk that did not end the prompt: a descriptor to hand over now (the
        decode instance pulls while the rest is prefilled), or None."""
        return None

    def abort(self, request_id: str) -> bool:
        return False

    def has_unfinished(self) -> bool:
        return False

    def held_request_ids(self) -> list[str]:
        """Finished requests whose blocks are still kept (for a handover)."""
        return []

    def stats(self) -> KVStats | None:
        return None

    def close(self) -> None:
        pass


class PrefillConnector(ColocatedConnector):
    role = "prefill"

    def __init__(self, config: EngineConfig, kv: torch.Tensor, block_manager: BlockManager, shm_name: str):
        self.sender = KVSender(config.kv_transfer, kv, config.instance_id, shm_name=shm_name)
        self.server = KVServer(self.sender)
        self.server.start()
        self.blocks = block_manager
        self.prefilling: set[str] = set()  # requests that will hand their KV over when their prompt is done
        self.held: dict[str, Request] = {}  # handed over; blocks kept until confirmed, expired or aborted
        self.overlap = config.kv_transfer.send_mode == "overlap"
        self.chunk_tokens = default_chunk_tokens(self.role, config)  # for streams inherited from an earlier role
        # overlap mode: requests handed over mid-prompt -> (block ids, tokens whose KV is final, descriptor)
        self.streaming: dict[str, tuple[list[int], int, TransferDescriptor]] = {}

    def prompt_tokens_per_step(self, streams_here: bool) -> int | None:
        # its own prompts (remote_decode) end on their first token and care only for TTFT: whole
        # budgets; streams inherited from an earlier role answer here and would stall behind them
        return self.chunk_tokens if streams_here else None

    def on_add(self, request: Request, descriptor: TransferDescriptor | None) -> bool:
        super().on_add(request, descriptor)
        request.remote_decode = True
        self.prefilling.add(request.request_id)
        return False

    def on_prefill_progress(self, request: Request) -> TransferDescriptor | None:
        if not self.overlap or request.request_id not in self.prefilling or request.grammar is not None:
            return None
        rid, ready = request.request_id, request.num_computed_tokens
        seen = self.streaming.get(rid)
        if seen is None:
            descriptor = self.sender.open(rid, request.block_table, request.num_prompt_tokens)
            self.sender.advance(rid, ready)
            self.streaming[rid] = (list(request.block_table), ready, descriptor)
            return descriptor
        blocks, before, descriptor = seen
        if ready < before or request.block_table[:len(blocks)] != blocks:
            # preempted and restarted: what was streamed is stale; the decode side fails the pull
            self.sender.abort(rid)
            del self.streaming[rid]
            return None
        self.sender.advance(rid, ready)
        self.streaming[rid] = (blocks, ready, descriptor)
        return None

    def on_finished(self, request: Request) -> tuple[bool, TransferDescriptor | None]:
        self.prefilling.discard(request.request_id)
        streamed = self.streaming.pop(request.request_id, None)
        if request.status is not RequestStatus.FINISHED_PREFILL_DONE:
            if streamed:
                self.sender.abort(request.request_id)  # the decode side stops waiting
            return False, None  # finished on its first token (stop, length): nothing to hand over
        self.held[request.request_id] = request
        if streamed and self.sender.complete(request.request_id, request.output_token_ids[:1]):
            return True, streamed[2]  # streamed: the frontend knows whether D already has it
        if streamed:
            self.sender.abort(request.request_id)  # the decode side gave it up: a fresh hold, handed over now
        descriptor = self.sender.register(request.request_id, request.block_table, request.num_prompt_tokens)
        return True, descriptor

    def poll(self) -> Arrivals:
        for release in self.sender.poll():
            request = self.held.pop(release.request_id, None)
            if request is not None:
                self.blocks.free(request)
        return Arrivals()

    def abort(self, request_id: str) -> bool:
        self.prefilling.discard(request_id)
        if self.streaming.pop(request_id, None) is not None:
            self.sender.abort(request_id)  # the request still owns its blocks: the scheduler frees them
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.sender.abort(request_id)
        self.blocks.free(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.prefilling or self.held) or self.sender.has_unfinished()

    def held_request_ids(self) -> list[str]:
        return list(self.held)

    def stats(self) -> KVStats:
        s = self.sender.stats()
        return KVStats(num_lease_expiries=s.num_lease_expiries, num_held_blocks=s.num_held_blocks,
                       num_confirmed=s.num_confirmed)

    def close(self) -> None:
        self.server.close()


def take_blocks_for_kv(blocks: BlockManager, make_room: MakeRoom, request: Request, streamed: bool) -> bool:
    """The decode side's say on a pending transfer (also the planner's simulator's): blocks for
    the prompt + first token, so the first decode step has room too (streamed: the token comes
    last); False to wait (full for now); ValueError if they can never fit."""
    need = request.num_tokens + (1 if streamed else 0)
    if blocks.blocks_needed(need) > blocks.num_blocks:
        raise ValueError(f"request needs {blocks.blocks_needed(need)} KV blocks; this decode "
                         f"instance has {blocks.num_blocks} in all")
    if not make_room(request, need):
        return False
    blocks.allocate(request, need)
    return True


def kv_landed(blocks: BlockManager, request: Request) -> None:
    """A transfer is done: the prompt's KV is computed here and joins the prefix cache."""
    request.kv_outcome = "ok"
    request.num_computed_tokens = request.num_prompt_tokens
    blocks.publish_computed(request)


class DecodeConnector(ColocatedConnector):
    role = "decode"

    def __init__(self, config: EngineConfig, kv: torch.Tensor, block_manager: BlockManager, network=None,
                 make_room: MakeRoom | None = None):
        if config.kv_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv failure policy must be one of {FAILURE_POLICIES}, got {config.kv_failure_policy!r}")
        self.failure_policy = config.kv_failure_policy
        # a prompt sent here to prefill (conditional disaggregation) shares its steps with running streams
        self.chunk_tokens = default_chunk_tokens(self.role, config)
        self.by_priority = config.scheduler.scheduling_policy == "priority"
        self.blocks = block_manager
        # the scheduler's say on taking blocks for arriving KV (it may preempt lower priorities)
        self.make_room = make_room or block_manager.can_allocate
        self.waiting: dict[str, Request] = {}  # WAITING_FOR_KV, until the receiver reports the transfer
        self.streamed: set[str] = set()  # of those, handed over mid-prompt (overlap mode)
        self.receiver = KVReceiver(config.kv_transfer, kv, make_transport(config.kv_transfer, network),
                                   self._allocate, self._free)

    def on_add(self, request: Request, descriptor: TransferDescriptor | None) -> bool:
        if descriptor is None:
            # prefilled here like any prompt: a short or cached one the frontend's disaggregation
            # policy kept local, or a stream resumed by recomputing
            return False
        if descriptor.streamed:
            self.streamed.add(request.request_id)  # its first token comes at the end of the stream
        elif not request.output_token_ids:
            raise ValueError("a KV descriptor needs the first token the prefill instance produced")
        if descriptor.num_tokens != request.num_prompt_tokens:
            raise ValueError(f"KV descriptor covers {descriptor.num_tokens} tokens but the prompt has "
                             f"{request.num_prompt_tokens}")
        # under the priority policy the more urgent KV takes free blocks first; fcfs: arrival order
        self.receiver.add(descriptor, request.priority if self.by_priority else 0)
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting[request.request_id] = request
        return True

    def _allocate(self, request_id: str, num_blocks: int) -> DestinationBlocks | None:
        request = self.waiting[request_id]
        if not take_blocks_for_kv(self.blocks, self.make_room, request, request_id in self.streamed):
            return None
        return DestinationBlocks(request.block_table[:num_blocks],
                                 num_cached=request.num_cached_tokens // self.blocks.block_size)

    def _free(self, request_id: str, block_ids: list[int]) -> None:
        request = self.waiting.get(request_id)
        if request is not None:
            self.blocks.free(request)
            request.num_computed_tokens = 0

    def poll(self) -> Arrivals:
        arrivals = Arrivals()
        for record in self.receiver.poll():
            request = self.waiting.pop(record.request_id, None)
            streamed = record.request_id in self.streamed
            self.streamed.discard(record.request_id)
            if request is None or record.outcome is TransferOutcome.ABORTED:
                continue
            request.kv_transfer = record
            if streamed and record.outcome is TransferOutcome.DONE:
                if not record.first_token_ids:
                    record.outcome, record.error_kind = TransferOutcome.FAILED, "bug"
                    record.error = "the stream ended without the first token"
                request.output_token_ids = list(record.first_token_ids)
            if record.outcome is TransferOutcome.DONE:
                kv_landed(self.blocks, request)
                arrivals.decode.append(request)
            elif self.failure_policy == "recompute" and request.output_token_ids:  # a streamed one may lack it
                request.kv_outcome = "recomputed"
                request.status = RequestStatus.WAITING  # prompt + first token are prefilled here
                arrivals.prefill.append(request)
            else:
                request.kv_outcome = "failed"
                request.status = RequestStatus.FINISHED_ERROR
                arrivals.failed.append(RequestOutput(
                    request.request_id, [], finished=True, finish_reason="error",
                    num_prompt_tokens=request.num_prompt_tokens, kv_transfer=record, kv_outcome="failed",
                    error=f"KV transfer from the prefill instance failed ({record.error_kind}): {record.error}"))
        return arrivals

    def abort(self, request_id: str) -> bool:
        if request_id not in self.waiting:
            return False
        self.streamed.discard(request_id)
        # The blocks come back through _free, now or at a later poll; keep the request findable until then.
        self.receiver.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.receiver.has_unfinished()

    def stats(self) -> KVStats:
        s = self.receiver.stats()
        return KVStats(num_done=s.num_done, num_failed=s.num_failed, num_pending=s.num_pending,
                       num_transferring=s.num_transferring)

    def close(self) -> None:
        self.receiver.close()  # also unmaps the prefill pools it attached (shm)


def make_connector(role: str, config: EngineConfig, kv: torch.Tensor, block_manager: BlockManager,
                   shm_name: str = "", network=None, make_room: MakeRoom | None = None) -> ColocatedConnector:
    if role == "colocated":
        return ColocatedConnector()
    if config.kv_transfer is None:
        raise ValueError(f"role {role!r} needs KV transfer settings, and this instance was started without "
                         "them; start it with --kv-transport shm|tcp")
    if role == "prefill":
        return PrefillConnector(config, kv, block_manager, shm_name)
    if role == "decode":
        return DecodeConnector(config, kv, block_manager, network, make_room)
    raise ValueError(f"role must be one of colocated, prefill, decode; got {role!r}")


def default_chunk_tokens(role: str, config: EngineConfig) -> int | None:
    """A role's own chunk_tokens, as its connector starts with it."""
    if role == "prefill":
        return config.local_prefill_chunk_tokens or CARRIED_CHUNK_TOKENS
    return config.local_prefill_chunk_tokens if role == "decode" else None
