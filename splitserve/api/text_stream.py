"""Token ids become the client's text: one TextStream over any TokenStream.

    TokenStream (the coordinator's, in this process; or an API process's RemoteTokenStream)
      --TextStream: detokenize, stop strings--> GenerationEvent --> answer.py

The one place text is made and stop strings are found, for `serve --api-server-count 1` and
`N` alike: a stop string ends the answer here and closes the token stream with reason "stop",
which the coordinator counts as a stop and aborts on every instance that holds the request.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

from splitserve.api.render import OutputText
from splitserve.coordinator.request_state import TokenEvent


@dataclass(slots=True, kw_only=True)
class GenerationEvent(TokenEvent):
    """What the HTTP layer sees: the coordinator's TokenEvent (its fields, defined once there) plus
    the new text (the tokens' text may be held back for a stop string)."""

    text: str

    @classmethod
    def of(cls, tokens: TokenEvent, text: str, **changes) -> GenerationEvent:
        """The token event with its text; `changes` (by keyword) override its fields."""
        values = {f.name: getattr(tokens, f.name) for f in fields(TokenEvent)}
        return cls(**(values | changes), text=text)


class TokenSource(Protocol):
    """coordinator.request_state.TokenStream, or api_worker.RemoteTokenStream."""

    def __aiter__(self): ...

    async def __anext__(self) -> TokenEvent: ...

    def close(self, reason: str = "abort") -> None: ...


class TextStream:
    """Async iterator of one request's GenerationEvents; closing it early aborts the request."""

    def __init__(self, tokens: TokenSource, output_text: OutputText) -> None:
        self._tokens, self._output_text, self._done = tokens, output_text, False

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        e = await self._tokens.__anext__()
        text = self._output_text.add_tokens(e.token_ids, e.finished)
        finished, reason = e.finished, e.finish_reason
        if self._output_text.stopped and not finished:
            finished, reason = True, "stop"
            self._tokens.close("stop")
        self._done = finished
        return GenerationEvent.of(e, text, finished=finished, finish_reason=reason)

    def close(self) -> None:
        """Safe to call from a cancelled task: it never awaits."""
        if not self._done:
            self._done = True
            self._tokens.close("abort")
