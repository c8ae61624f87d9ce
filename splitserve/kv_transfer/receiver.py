"""The decode side of the connector: a small poll state machine per transfer.

A request's path on a decode instance, before it can join the decode batch:

    add(descriptor)          engine thread: PENDING (queued until blocks are free)
    poll()                   engine thread, once per step:
        - PENDING: ask the block manager for destination blocks (`allocate`); if there is
          no room yet the transfer stays queued, in arrival order; if it can never fit,
          FAILED with the allocator's message. A transfer whose source already has
          `max_transfers_per_source` transfers moving waits without blocking the others:
          a hung prefill instance ties up at most that many pullers, each for at most its
          handshake/io timeout, and transfers from other sources go on. Leading blocks the decode side's own prefix
          cache already holds (`DestinationBlocks.num_cached`) are not pulled.
        - then TRANSFERRING on a puller thread: the transport copies the blocks layer
          by layer and confirms receipt to the prefill instance
        - returns every transfer that ended since the last poll: DONE (its blocks now
          hold the prompt's KV), FAILED (error + kind; blocks already given back) or
          ABORTED
    abort(request_id)        engine thread: any stage; the destination blocks go back
        through `free` (at once, or at the next poll once the puller has stopped writing
        into them) and the prefill instance is told to free its copy.

`allocate` and `free` are only ever called from the engine thread (inside poll/abort).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from splitserve.kv_transfer.config import KVTransferConfig
from splitserve.kv_transfer.messages import TransferDescriptor, TransferOutcome, TransferRecord
from splitserve.kv_transfer.transport import (FaultInjector, InjectedFault, KVTransport,
                                              TransferCancelled, TransferError, descriptor_problem)



@dataclass(slots=True)
class DestinationBlocks:
    """What the decode side's block manager gave a transfer."""

    block_ids: list[int]  # one per source block, in order
    num_cached: int = 0  # leading blocks that already hold this prompt's KV: not pulled


Allocate = Callable[[str, int], "DestinationBlocks | None"]  # (request_id, num_blocks); None: full
Free = Callable[[str, list[int]], None]  # (request_id, block ids it was given)


@dataclass(slots=True, eq=False)
class _Transfer:
    descriptor: TransferDescriptor
    record: TransferRecord
    cancel: threading.Event = field(default_factory=threading.Event)
    fail_at_layer: int | None = None
    future: Future | None = None
    priority: int = 0  # lower first (the engine's priority policy); equal: arrival order


@dataclass(slots=True)
class ReceiverStats:
    num_done: int = 0
    num_failed: int = 0
    num_aborted: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # summed over DONE transfers
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    num_pending: int = 0
    num_transferring: int = 0


class KVReceiver:
    def __init__(self, config: KVTransferConfig, kv: torch.Tensor, transport: KVTransport,
                 allocate: Allocate, free: Free, clock: Callable[[], float] = time.time):
        """kv: this instance's pool [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]."""
        self.config = config
        self.kv = kv
        self.transport = transport
        self._allocate = allocate
        self._free = free
        self._clock = clock
        self._faults = FaultInjector(config.fault_rate, config.delay_ms, config.seed)
        self._pending: dict[str, _Transfer] = {}  # insertion order = arrival order; taken by (priority, arrival)
        self._active: dict[str, _Transfer] = {}
        self._ended: list[TransferRecord] = []  # ended outside poll (aborted while pending)
        self._stats = ReceiverStats()
        self._pullers = ThreadPoolExecutor(config.max_concurrent_transfers,
                                           thread_name_prefix="kv-pull")
        # Releases (best effort, to maybe-unreachable sources) never take a puller.
        self._releasers = ThreadPoolExecutor(1, thread_name_prefix="kv-release")

    # --- engine thread -------------------------------------------------------------------

    def add(self, descriptor: TransferDescriptor, priority: int = 0) -> None:
        """Queue a transfer. Pending transfers take blocks most urgent first (lower `priority`),
        in arrival order within a priority: under the priority policy a chat's KV must not wait
        behind a document's that finds no blocks."""
        request_id = descriptor.request_id
        if request_id in self._pending or request_id in self._active:
            raise ValueError(f"a transfer for request {request_id!r} is already in progress")
        record = TransferRecord(request_id, descriptor.source.instance_id, self.transport.name,
                                queued_at=self._clock())
        transfer = _Transfer(descriptor, record, priority=priority)
        problem = descriptor_problem(descriptor, self.kv, self.transport.name)
        if problem is not None:  # ends at the next poll like any failure: the failure policy applies
            self._end(transfer, TransferOutcome.FAILED, f"bad KV descriptor: {problem}", kind="bad_descriptor")
            self._ended.append(record)
            return
        self._pending[request_id] = transfer

    def abort(self, request_id: str) -> bool:
        if (transfer := self._pending.pop(request_id, None)) is not None:
            self._end(transfer, TransferOutcome.ABORTED, "aborted while waiting for blocks")
            self._ended.append(transfer.record)
            self._releasers.submit(self.transport.release, transfer.descriptor)
            return True
        if (transfer := self._active.get(request_id)) is not None:
            transfer.cancel.set()  # the puller stops before its next layer; poll() frees
            return True
        return False

    def poll(self) -> list[TransferRecord]:
        ended, self._ended = self._ended, []
        for request_id, transfer in list(self._active.items()):
            if transfer.future.done():
                del self._active[request_id]
                ended.append(self._finish(transfer))
        per_source: dict[str, int] = {}
        for transfer in self._active.values():
            source = transfer.descriptor.source.instance_id
            per_source[source] = per_source.get(source, 0) + 1
        # sorted() is stable: within one priority the dict's arrival order stands
        for request_id, transfer in sorted(self._pending.items(), key=lambda kv: kv[1].priority):
            if len(self._active) >= self.config.max_concurrent_transfers:
                break  # do not take blocks for transfers that would only wait for a puller
            source = transfer.descriptor.source.instance_id
            if per_source.get(source, 0) >= self.config.max_transfers_per_source:
                continue  # its source is busy (or hung): let transfers from other sources by
            try:
                blocks = self._allocate(request_id, transfer.descriptor.num_blocks)
            except ValueError as exc:  # can never fit: refuse explicitly
                del self._pending[request_id]
                self._end(transfer, TransferOutcome.FAILED, f"decode instance refused: {exc}",
                          kind="no_space")
                self._releasers.submit(self.transport.release, transfer.descriptor)
                ended.append(transfer.record)
                continue
            if blocks is None:
                break  # full for now; keep the order (the scheduler's make_room may preempt for it)
            del self._pending[request_id]
            self._start(transfer, blocks)
            per_source[source] = per_source.get(source, 0) + 1
        return ended

    def has_unfinished(self) -> bool:
        """True while poll() has something to do or report: keep the engine loop turning."""
        return bool(self._pending or self._active or self._ended)

    def stats(self) -> ReceiverStats:
        stats = ReceiverStats(**{k: getattr(self._stats, k) for k in ReceiverStats.__slots__})
        stats.failures_by_kind = dict(self._stats.failures_by_kind)
        stats.num_pending = len(self._pending)
        stats.num_transferring = len(self._active)
        return stats

    def close(self) -> None:
        """Stops pullers; blocks of unfinished transfers are not handed back (engine exit)."""
        for transfer in self._active.values():
            transfer.cancel.set()
        self._pullers.shutdown(wait=True)
        self._releasers.shutdown(wait=False, cancel_futures=True)  # best effort; leases expire anyway
        self.transport.close()

    # --- internals -----------------------------------------------------------------------

    def _start(self, transfer: _Transfer, blocks: DestinationBlocks) -> None:
        if (len(blocks.block_ids) != transfer.descriptor.num_blocks
                or not 0 <= blocks.num_cached <= len(blocks.block_ids)):
            self._free(transfer.descriptor.request_id, blocks.block_ids)
            raise AssertionError(f"allocate returned {len(blocks.block_ids)} blocks "
                                 f"({blocks.num_cached} cached), asked for "
                                 f"{transfer.descriptor.num_blocks}")
        transfer.record.dst_block_ids = list(blocks.block_ids)
        transfer.record.num_cached_blocks = blocks.num_cached
        transfer.record.outcome = TransferOutcome.TRANSFERRING
        transfer.fail_at_layer = self._faults.plan(self.kv.shape[0])
        self._active[transfer.descriptor.request_id] = transfer
        transfer.future = self._pullers.submit(self._pull, transfer)

    def _finish(self, transfer: _Transfer) -> TransferRecord:
        record = transfer.record
        if transfer.cancel.is_set() and record.outcome is not TransferOutcome.ABORTED:
            # Aborted after the last layer moved: the data arrived but nobody wants it.
            self._end(transfer, TransferOutcome.ABORTED, "aborted after the blocks arrived")
        elif record.outcome is TransferOutcome.DONE:
            self._stats.num_done += 1
            self._stats.num_bytes += record.num_bytes
            self._stats.seconds += record.seconds
            return record
        else:
            self._count(record)
        self._free(record.request_id, record.dst_block_ids)
        return record

    def _end(self, transfer: _Transfer, outcome: TransferOutcome, error: str,
             kind: str | None = None) -> None:
        record = transfer.record
        record.outcome, record.error = outcome, error
        record.end = record.end or self._clock()
        if kind is not None:
            record.error_kind = kind
        self._count(record)

    def _count(self, record: TransferRecord) -> None:
        if record.outcome is TransferOutcome.ABORTED:
            self._stats.num_aborted += 1
        else:
            self._stats.num_failed += 1
            kinds = self._stats.failures_by_kind
            kinds[record.error_kind] = kinds.get(record.error_kind, 0) + 1

    def _pull(self, transfer: _Transfer) -> None:
        """Puller thread: touches only this transfer's record and destination blocks."""
        record, descriptor = transfer.record, transfer.descriptor

        def on_layer(layer: int) -> None:
            if transfer.cancel.is_set():
                raise TransferCancelled("aborted while the blocks were moving")
            if layer == transfer.fail_at_layer:
                raise InjectedFault(f"injected fault at layer {layer} "
                                    f"(kv fault_rate={self._faults.fault_rate})")

        record.start = self._clock()
        try:
            if transfer.cancel.wait(self._faults.delay_s):
                raise TransferCancelled("aborted during the injected delay")
            if descriptor.streamed:  # only the tcp transport takes one (descriptor_problem)
                record.num_bytes = self.transport.pull(descriptor, self.kv, record.dst_block_ids, on_layer,
                                                       record.num_cached_blocks, record.first_token_ids)
            else:
                record.num_bytes = self.transport.pull(descriptor, self.kv, record.dst_block_ids,
                                                       on_layer, record.num_cached_blocks)
            record.outcome = TransferOutcome.DONE
        except TransferError as exc:
            aborted = isinstance(exc, TransferCancelled)
            record.outcome = TransferOutcome.ABORTED if aborted else TransferOutcome.FAILED
            record.error, record.error_kind = str(exc), exc.kind
            self._releasers.submit(self.transport.release, descriptor)
        except Exception as exc:  # a bug, but still never a silent failure
            record.outcome = TransferOutcome.FAILED
            record.error, record.error_kind = f"unexpected {type(exc).__name__}: {exc}", "bug"
            self._releasers.submit(self.transport.release, descriptor)
        finally:
            record.end = self._clock()
