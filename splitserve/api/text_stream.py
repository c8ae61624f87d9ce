"""Token ids become the client's text: one TextStream over any TokenStream.

    TokenStream (the coordinator's, in this process; or an API process's RemoteTokenStream)
      --TextStream: detokenize, stop strings--> GenerationEvent --> answer.py

The one place text is made and stop strings are found, for `serve --api-server-count 1` and
`N` alike: a stop string ends the answer here and closes the token stream with reason "stop",
which the coordinator counts as a stop and aborts on every instance that holds the request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from splitserve.api.render import OutputText
from splitserve.coordinator.request_state import TokenEvent


@dataclass(slots=True, kw_only=True)
class GenerationEvent:
    """What the HTTP layer sees: new text, and at the end the reason and counts."""

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
    logprobs: list | None = None  # [protocol.TokenLogprobs] of token_ids, when the request asked
    prompt_logprobs: list | None = None  # [protocol.TokenLogprobs] of prompt tokens 1.., with the first token
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache of the instance that prefilled it
    placement: dict | None = None  # disaggregated: where the prompt was prefilled and why


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
        return GenerationEvent(text=text, num_new_tokens=len(e.token_ids), num_prompt_tokens=e.num_prompt_tokens,
                               num_completion_tokens=e.num_completion_tokens, finished=finished,
                               finish_reason=reason, error=e.error, rejected=e.rejected, kv_transfer=e.kv_transfer,
                               num_retries=e.num_retries, token_ids=e.token_ids, logprobs=e.logprobs,
                               prompt_logprobs=e.prompt_logprobs, num_cached_tokens=e.num_cached_tokens,
                               placement=e.placement)

    def close(self) -> None:
        """Safe to call from a cancelled task: it never awaits."""
        if not self._done:
            self._done = True
            self._tokens.close("abort")
