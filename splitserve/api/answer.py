"""One answer in OpenAI's exact format: `chat.completion[.chunk]` or `text_completion`, whole or as
SSE chunks (`data: {...}\\n\\n` ... `data: [DONE]\\n\\n`), with logprobs, token ids, usage, the
per-request report, and tool calls.

Tool calls stream as OpenAI sends them: a call's first delta carries its index, id, type, name and
empty arguments, the next ones fragments of its arguments; content before a call is streamed as
content; the finishing chunk says `finish_reason: "tool_calls"`. A whole answer is the same
parser's pieces joined, so the two never disagree.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from splitserve.api.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from splitserve.api.openai_schema import ApiError
from splitserve.api.text_stream import GenerationEvent, TextStream
from splitserve.api.tool_parsers import Piece, ToolParser
from splitserve.protocol import KVTransferReport

_json = msgspec.json.Encoder()


def sse(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def tool_deltas(pieces: list[Piece]) -> list[dict]:
    """Parser pieces -> chat deltas; neighbouring content, or fragments of one call's arguments, in one."""
    deltas: list[dict] = []
    for piece in pieces:
        last = deltas[-1] if deltas else {}
        last_call = last["tool_calls"][0] if "tool_calls" in last else None
        if isinstance(piece, str):
            if "content" in last:
                last["content"] += piece
            else:
                deltas.append({"content": piece})
        elif piece.id is not None:
            deltas.append({"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                           "function": {"name": piece.name, "arguments": ""}}]})
        elif last_call is not None and "id" not in last_call and last_call["index"] == piece.index:
            last_call["function"]["arguments"] += piece.arguments
        elif piece.arguments:
            deltas.append({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]})
    return deltas


def error_for(event: GenerationEvent) -> ApiError:
    if event.rejected:
        error = ApiError(400, f"the engine refused the request: {event.error}")
    elif event.kv_transfer is not None:
        error = ApiError(503, event.error or "the KV transfer failed", "server_error",
                         code="kv_transfer_failed", retry_after_s=1)
    else:
        error = ApiError(503, event.error or "the engine failed", "server_error", code="engine_failure",
                         retry_after_s=1)
    error.report = splitserve_report(event)
    return error


def trial_report(report: KVTransferReport) -> dict:
    """A decode instance's transfer report in the shape of docs/internals.md "Trial <-> server";
    the outcome is the one the decode instance decided (ok | recomputed | failed)."""
    out = {"bytes": report.num_bytes, "seconds": round(report.seconds, 6), "outcome": report.outcome, "retries": 0,
           "wait_seconds": round(report.wait_seconds, 6), "source": report.source_instance,
           "transport": report.transport}
    if report.outcome != "ok":
        out["error_kind"], out["error"] = report.error_kind, report.error
    return out


def splitserve_report(event: GenerationEvent) -> dict | None:
    """The per-request report of docs/internals.md "Trial <-> server": present when the request
    moved KV between instances or was retried on another instance after its engine died."""
    if event.kv_transfer is None and not event.num_retries and event.placement is None:
        return None
    report = {"retries": event.num_retries}
    if event.kv_transfer is not None:
        report["kv_transfer"] = trial_report(event.kv_transfer)
    if event.placement is not None:
        report["prefill"] = event.placement  # disaggregated: local (on the decode instance) or remote, and why
    return report


def with_report(payload: dict, event: GenerationEvent) -> dict:
    report = splitserve_report(event)
    return payload if report is None else {**payload, "splitserve": report}


def usage(event: GenerationEvent) -> dict:
    # cached_tokens: OpenAI's field (vLLM fills it, AIPerf reads it), counted on the instance that prefilled
    return {"prompt_tokens": event.num_prompt_tokens, "completion_tokens": event.num_completion_tokens,
            "total_tokens": event.num_prompt_tokens + event.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.num_cached_tokens}}


@dataclass(slots=True)
class Echo:
    """What a completion repeats before its answer (`echo: true`)."""

    text: str  # the prompt
    prompt_ids: list[int] | None = None  # with logprobs: the prompt's tokens, scored (the first: null)
    score_only: bool = False  # max_tokens 0: the prompt alone; the one token the engine made is dropped


class Answer:
    """Formats one answer as OpenAI does: `chat.completion[.chunk]` or `text_completion`.

    token_text, when given, names tokens for the logprobs the request asked for; echo is what a
    completion repeats before its answer; tool_parser, when given, reads tool calls out of a chat
    answer."""

    def __init__(self, kind: str, answer_id: str, model: str, include_usage: bool,
                 return_token_ids: bool = False, token_text: TokenText | None = None, echo: Echo | None = None,
                 tool_parser: ToolParser | None = None) -> None:
        self.kind, self.id, self.model, self.include_usage = kind, answer_id, model, include_usage
        self.return_token_ids = return_token_ids
        self.token_text, self.tool_parser = token_text, tool_parser
        self.echo = echo or Echo("")
        self._text_logprobs = CompletionLogprobs(token_text, len(self.echo.text)) \
            if token_text and kind == "text" else None
        self.created = int(time.time())

    def view(self, event: GenerationEvent) -> GenerationEvent:
        """The event as this answer shows it: a prompt-only score has no answer tokens."""
        if not self.echo.score_only:
            return event
        return dataclasses.replace(event, text="", num_completion_tokens=0, token_ids=[],
                                   logprobs=None, finish_reason="length" if event.finish_reason else None)

    def _echo_logprobs(self, prompt_logprobs: list | None) -> dict | None:
        if self._text_logprobs is None or self.echo.prompt_ids is None:
            return None
        return self._text_logprobs.prompt(self.echo.prompt_ids, prompt_logprobs or [], len(self.echo.text))

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list | None) -> dict | None:
        if self.token_text is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.token_text, entries or [])
        return self._text_logprobs.chunk(entries or [])

    def full(self, text: str, last: GenerationEvent, token_ids: list[int] | None = None,
             logprobs: list | None = None, prompt_logprobs: list | None = None) -> dict:
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.tool_parser is not None:
                message["content"], calls = self.tool_parser.parse(text)
                if calls:
                    message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                      "finish_reason": self._finish_reason(last)}
            head = self._head("chat.completion")
        else:
            echoed = self._echo_logprobs(prompt_logprobs)
            answered = self._logprobs(logprobs)
            if echoed is not None:
                answered = {key: echoed[key] + answered[key] for key in echoed}
            choice = {"index": 0, "text": self.echo.text + text, "logprobs": answered,
                      "finish_reason": last.finish_reason}
            head = self._head("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids or [])
        return with_report({**head, "choices": [choice], "usage": usage(last)}, last)

    def _ids(self, choice: dict, event: GenerationEvent, carries: bool = True) -> dict:
        """The chunk that delivers an event's tokens names them (return_token_ids) and carries
        their logprobs; any other chunk has empty lists."""
        if self.return_token_ids:
            choice["token_ids"] = list(event.token_ids) if carries else []
        if self.token_text is not None:
            choice["logprobs"] = self._logprobs(event.logprobs if carries else [])
        return choice

    def _chat_deltas(self, event: GenerationEvent) -> list[dict]:
        if self.tool_parser is None:
            return [{"content": event.text}] if event.text else []
        pieces = self.tool_parser.feed(event.text)
        return tool_deltas(pieces + self.tool_parser.finish() if event.finished else pieces)

    def _finish_reason(self, last: GenerationEvent) -> str | None:
        if self.tool_parser is not None and self.tool_parser.num_calls and last.finish_reason == "stop":
            return "tool_calls"
        return last.finish_reason

    def _per_token(self, event: GenerationEvent) -> bool:
        """Whether every engine step gets a chunk, even one whose text is held back."""
        return (self.return_token_ids or self.token_text is not None) and bool(event.token_ids)

    def _chunk(self, obj: str, choice: dict, last: GenerationEvent | None = None) -> bytes:
        chunk = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        elif last is not None:  # no usage chunk follows: the finishing chunk carries the report
            chunk = with_report(chunk, last)
        return sse(chunk)

    async def _events(self, stream: TextStream) -> AsyncIterator[GenerationEvent]:
        try:
            async for event in stream:
                yield self.view(event)
        finally:
            stream.close()  # client gone mid-stream: abort in the engine, free its blocks

    def _tail(self, obj: str, last: GenerationEvent) -> list[bytes]:
        out = []
        if self.include_usage:
            out.append(sse(with_report({**self._head(obj), "choices": [], "usage": usage(last)}, last)))
        return out + [SSE_DONE]

    async def chat_chunks(self, stream: TextStream) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk"
        yield self._chunk(obj, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None})
        async for event in self._events(stream):
            if event.error:
                yield sse(error_for(event).body())
                break
            deltas = self._chat_deltas(event)
            carried = bool(deltas) or (self._per_token(event) and not event.finished)
            for j, delta in enumerate(deltas or ([{"content": ""}] if carried else [])):
                yield self._chunk(obj, self._ids({"index": 0, "delta": delta, "logprobs": None,
                                                  "finish_reason": None}, event, j == 0))
            if event.finished:
                yield self._chunk(obj, self._ids({"index": 0, "delta": {}, "logprobs": None,
                                                  "finish_reason": self._finish_reason(event)}, event,
                                                 not carried), event)
                for chunk in self._tail(obj, event):
                    yield chunk
                return
        yield SSE_DONE

    async def text_chunks(self, stream: TextStream) -> AsyncIterator[bytes]:
        obj = "text_completion"
        echo_pending = bool(self.echo.text)
        if echo_pending and self.echo.prompt_ids is None:
            yield self._chunk(obj, {"index": 0, "text": self.echo.text, "logprobs": None, "finish_reason": None})
            echo_pending = False
        async for event in self._events(stream):
            if echo_pending:  # its logprobs come with the first token
                yield self._chunk(obj, {"index": 0, "text": self.echo.text, "finish_reason": None,
                                        "logprobs": self._echo_logprobs(event.prompt_logprobs)})
                echo_pending = False
            if event.error:
                yield sse(error_for(event).body())
                break
            if event.text or event.finished or self._per_token(event):
                yield self._chunk(obj, self._ids({"index": 0, "text": event.text, "logprobs": None,
                                                  "finish_reason": event.finish_reason if event.finished else None},
                                                 event),
                                  event if event.finished else None)
            if event.finished:
                for chunk in self._tail(obj, event):
                    yield chunk
                return
        yield SSE_DONE
