"""Output processing: an engine's token ids become the consumer's token event, and the latency metrics.

    TokenOutput --counts, KV report--> TokenEvent (token ids, counts, finish, KV report)

Knows nothing about instances, routing or text: the dispatcher decides what a finish means for
the request's KV (a handover, an abort on every holder); the API makes the text and finds stop
strings (api/text_stream.py), and tells the dispatcher when one ends the request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.request_state import RequestState, TokenEvent
from splitserve.protocol import TokenOutput


@dataclass(slots=True)
class Processed:
    event: TokenEvent
    handed_over: bool  # a prefill instance finished the prompt: a decode instance continues
    engine_done: bool  # the engine ended the request itself: it holds nothing any more


class OutputProcessor:
    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    def process(self, state: RequestState, out: TokenOutput) -> Processed:
        now = time.monotonic()
        state.token_ids.extend(out.new_token_ids)
        if out.new_token_ids:
            if state.last_token_at is None:
                self.metrics.ttft.observe(now - state.arrival)
            else:
                self.metrics.inter_token.observe(now - state.last_token_at)
            state.last_token_at = now
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        handed_over = out.finish_reason == "prefill_done"
        finished = out.finished and not handed_over
        if out.kv_transfer is not None:
            self.metrics.observe_transfer(out.kv_transfer, out.kv_transfer.outcome)
        event = TokenEvent(token_ids=list(out.new_token_ids), num_prompt_tokens=state.num_prompt_tokens,
                           num_completion_tokens=state.num_completion_tokens, finished=finished,
                           finish_reason=out.finish_reason if finished else None, error=out.error,
                           rejected=out.rejected, kv_transfer=out.kv_transfer,
                           num_retries=state.num_retries + state.num_resumes, logprobs=out.logprobs,
                           prompt_logprobs=out.prompt_logprobs, **answer_facts(state))
        # Ended by the engine for good (not handed over, not an error a prefill instance may hold
        # KV through): nothing to abort anywhere.
        engine_done = out.finished and out.finish_reason not in ("prefill_done", "error")
        return Processed(event, handed_over, engine_done)

    def finish_event(self, state: RequestState, reason: str, error: str | None = None) -> TokenEvent:
        """The last event of a request ended here (abort, a dead engine, no instance)."""
        return TokenEvent(num_prompt_tokens=state.num_prompt_tokens, num_completion_tokens=state.num_completion_tokens,
                          finished=True, finish_reason=reason, error=error,
                          num_retries=state.num_retries + state.num_resumes, **answer_facts(state))


def answer_facts(state: RequestState) -> dict:
    """What each event says about the request's prompt (any may be its last: the API may find a stop
    string in it): the prefix-cache hits, and where it was prefilled (disaggregated serving)."""
    return {"num_cached_tokens": state.num_cached_tokens or 0, "placement": state.placement}
