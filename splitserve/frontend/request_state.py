"""What the frontend keeps per request and per engine instance, and what a consumer reads.

`EngineClient` (engine_client.py) owns these; `RequestStream` is the handle the HTTP layer
iterates. `trial_report` turns an engine's KV-transfer record into the per-request report the
trial reads (docs/internals.md, "Trial <-> server").
"""
from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.frontend.render import OutputText
from splitserve.protocol import EngineHello, EngineStats, KVTransferReport, WireSamplingParams

if TYPE_CHECKING:
    from splitserve.frontend.engine_client import EngineClient


@dataclass(slots=True)
class GenerationEvent:
    """What a request's consumer sees: new text, and at the end the reason and counts."""

    text: str
    num_new_tokens: int
    num_prompt_tokens: int
    num_completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    rejected: bool = False  # the engine refused it at admission: the user's request was bad
    kv_transfer: dict | None = None  # disaggregated: the transfer report the trial reads
    num_retries: int = 0  # times the request was sent again after its engine died
    token_ids: list[int] = field(default_factory=list)  # the new tokens (their text may be held back)


def trial_report(report: KVTransferReport, finish_reason: str | None) -> dict:
    """A decode instance's transfer report in the shape of docs/internals.md "Trial <-> server"."""
    if report.outcome == "done":
        outcome = "ok"
    else:
        outcome = "failed" if finish_reason == "error" else "recomputed"
    out = {"bytes": report.num_bytes, "seconds": round(report.seconds, 6), "outcome": outcome, "retries": 0,
           "wait_seconds": round(report.wait_seconds, 6), "source": report.source_instance,
           "transport": report.transport}
    if report.outcome != "done":
        out["error_kind"], out["error"] = report.error_kind, report.error
    return out


@dataclass(slots=True)
class RequestState:
    request_id: str
    instance_id: str
    output_text: OutputText
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_completion_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    num_retries: int = 0  # times it was sent again because its engine died before its first token
    # disaggregated: instance_id is P until the handover, then D
    decode_instance_id: str | None = None
    prefill_instance_id: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    wire_params: WireSamplingParams | None = None

    def holders(self) -> list[str]:
        """Every instance that may hold this request's blocks now."""
        return list(dict.fromkeys(i for i in (self.prefill_instance_id, self.instance_id,
                                              self.decode_instance_id) if i is not None))


@dataclass(slots=True)
class Instance:
    hello: EngineHello
    last_seen: float
    alive: bool = True
    stats: EngineStats | None = None
    process: subprocess.Popen | None = None


class RequestStream:
    """Async iterator of one request's events; closing it early aborts the request."""

    def __init__(self, client: EngineClient, state: RequestState) -> None:
        self._client, self._state, self._done = client, state, False
        self.request_id = state.request_id
        self.num_prompt_tokens = state.num_prompt_tokens

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._state.queue.get()
        self._done = event.finished
        return event

    def close(self) -> None:
        """Safe to call from a cancelled task: it never awaits."""
        if not self._done:
            self._done = True
            self._client.abort(self.request_id)
