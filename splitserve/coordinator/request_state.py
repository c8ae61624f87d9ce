"""What the coordinator keeps per request and per engine instance, and what a consumer reads.

The dispatcher (dispatcher.py) owns request states, the engine link (engine_link.py) the
instances; `TokenStream` is the handle a consumer iterates: token ids only (the API wraps it in
api/text_stream.TextStream, in this process or in an API process). A KV-transfer report stays
the engine's `protocol.KVTransferReport` all the way; api/answer.py makes it JSON.
"""
from __future__ import annotations

import asyncio
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from splitserve.protocol import EngineHello, EngineStats, KVTransferReport, StepSample, WireSamplingParams


@dataclass(slots=True, kw_only=True)
class TokenEvent:
    """What a request's consumer gets from the coordinator: new token ids, and at the end the
    reason and counts. Built by keyword; the API adds the text (api/text_stream.py)."""

    token_ids: list[int] = field(default_factory=list)  # the new tokens
    num_prompt_tokens: int
    num_completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    rejected: bool = False  # the engine refused it at admission: the user's request was bad
    kv_transfer: KVTransferReport | None = None  # disaggregated: the decode instance's transfer report
    num_retries: int = 0  # times the request was sent again after its engine died
    logprobs: list | None = None  # [protocol.TokenLogprobs] of token_ids, when the request asked
    prompt_logprobs: list | None = None  # [protocol.TokenLogprobs] of prompt tokens 1.., with the first token
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache of the instance that prefilled it
    placement: dict | None = None  # disaggregated: where the prompt was prefilled and why (Placement.report)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


class EventSink(Protocol):
    """Where a request's events go: its TokenStream's queue, or an API process's outbox."""

    def put_nowait(self, event: TokenEvent) -> None: ...


@dataclass(slots=True)
class RequestState:
    request_id: str  # inside the system: unique, and new at every dispatch (the client's id may repeat)
    client_request_id: str  # X-Request-Id, echoed to the client
    prompt_token_ids: list[int]
    wire_params: WireSamplingParams
    instance_id: str | None = None  # where it runs now; disaggregated: P until the handover, then D
    queue: asyncio.Queue | EventSink = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)  # every token produced so far (a resume recomputes them)
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    num_retries: int = 0  # sent again because its engine died before its first token
    num_resumes: int = 0  # sent again after tokens had streamed: prompt + tokens recomputed elsewhere
    decode_instance_id: str | None = None
    prefill_instance_id: str | None = None
    priority: int = 0  # lower first under --scheduling-policy priority; sent to every stage
    ttft_due: float | None = None  # monotonic time its first token is due by (its class's TTFT target)
    sent_prompt: list[int] = field(default_factory=list)  # what the current dispatch sent: the prompt,
    sent_params: WireSamplingParams | None = None  # plus tokens recomputed on a resume; what remains of the answer
    # kv send mode overlap: the decode instance that got the request while P still prefilled it,
    # and its outputs that came before P's first token (delivered right after it)
    streamed_to: str | None = None
    held_outputs: list = field(default_factory=list)
    stream_failed: bool = False  # once failed, it is handed over at the end (no resume loop)
    placement: dict | None = None  # disaggregated: Placement.report() of the current dispatch
    num_cached_tokens: int | None = None  # prefix-cache hits where its prompt was first prefilled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    def holders(self) -> list[str]:
        """Every instance that may hold this request's blocks now."""
        return list(dict.fromkeys(i for i in (self.prefill_instance_id, self.instance_id,
                                              self.decode_instance_id) if i is not None))


STEP_WINDOW = 300  # step samples kept per instance: a few seconds of busy steps, a minute of slow ones
STEP_LOG = 50_000  # ... and for GET /admin/steps (a trial reads each run's): minutes of busy steps


@dataclass(slots=True)
class Instance:
    hello: EngineHello  # its role is kept current across live role changes
    last_seen: float
    alive: bool = True
    stats: EngineStats | None = None
    process: subprocess.Popen | None = None
    removed: bool = False  # out of rotation for good (drained, or silent long after its death)
    dead_since: float | None = None
    lost_request_ids: set[str] = field(default_factory=set)  # sent elsewhere when it was declared dead
    # its last STEP_WINDOW measured steps, for the mix controller's online step model
    step_samples: deque[StepSample] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    num_step_samples: int = 0  # received since it joined: tells a reader whether new ones came
    # the last STEP_LOG of them, for GET /admin/steps; sample i (counting from 0 since it joined) is
    # step_log[i - (num_step_samples - len(step_log))]
    step_log: deque[StepSample] = field(default_factory=lambda: deque(maxlen=STEP_LOG))

    def observe_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        self.step_samples.extend(stats.step_samples)
        self.step_log.extend(stats.step_samples)
        self.num_step_samples += len(stats.step_samples)


class TokenStream:
    """Async iterator of one request's token events; closing it early aborts the request.

    `on_close(state, reason)` is the dispatcher's abort: reason "abort" (the client left) or
    "stop" (the API found a stop string in the text, counted as a stop)."""

    def __init__(self, state: RequestState, on_close: Callable[[RequestState, str], None]) -> None:
        self._state, self._on_close, self._done = state, on_close, False
        self.request_id = state.client_request_id
        self.num_prompt_tokens = state.num_prompt_tokens

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._state.queue.get()
        self._done = event.finished
        return event

    def close(self, reason: str = "abort") -> None:
        """Safe to call from a cancelled task: it never awaits."""
        if not self._done:
            self._done = True
            self._on_close(self._state, reason)
