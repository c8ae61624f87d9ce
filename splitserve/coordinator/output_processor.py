"""Output processing: an engine's token ids become the client's text, and the latency metrics.

    TokenOutput --detokenize, stop strings--> GenerationEvent (text, counts, finish, KV report)

Knows nothing about instances or routing: the dispatcher decides what a finish means for the
request's KV (a handover, an abort on every holder); this only says what the client sees.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.api.render import OutputText, Renderer
from splitserve.coordinator.request_state import GenerationEvent, RequestState, trial_report
from splitserve.protocol import TokenOutput


@dataclass(slots=True)
class Processed:
    event: GenerationEvent
    handed_over: bool  # a prefill instance finished the prompt: a decode instance continues
    engine_done: bool  # the engine ended the request itself: it holds nothing any more


class OutputProcessor:
    def __init__(self, renderer: Renderer | None, metrics: FrontendMetrics) -> None:
        self.renderer, self.metrics = renderer, metrics

    def new_output_text(self, stop: list[str]) -> OutputText:
        return self.renderer.new_output_text(stop)

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
        finished, reason = out.finished and not handed_over, out.finish_reason
        text = state.output_text.add_tokens(out.new_token_ids, finished)
        if state.output_text.stopped and not finished:
            finished, reason, handed_over = True, "stop", False  # the dispatcher aborts it on every holder
        kv_report = None
        if out.kv_transfer is not None:
            kv_report = trial_report(out.kv_transfer)
            self.metrics.observe_transfer(out.kv_transfer, kv_report["outcome"])
        event = GenerationEvent(text, len(out.new_token_ids), state.num_prompt_tokens, state.num_completion_tokens,
                                finished, reason if finished else None, out.error, out.rejected, kv_report,
                                state.num_retries + state.num_resumes, list(out.new_token_ids), out.logprobs,
                                out.prompt_logprobs, **(answer_facts(state) if finished else {}))
        # Ended by the engine for good (not handed over, not an error a prefill instance may hold
        # KV through, not a stop string the engine has not seen): nothing to abort anywhere.
        engine_done = out.finished and out.finish_reason not in ("prefill_done", "error") and reason == out.finish_reason
        return Processed(event, handed_over, engine_done)

    def finish_event(self, state: RequestState, reason: str, error: str | None = None) -> GenerationEvent:
        """The last event of a request ended by the frontend (abort, a dead engine, no instance)."""
        return GenerationEvent("", 0, state.num_prompt_tokens, state.num_completion_tokens, True, reason, error,
                               num_retries=state.num_retries + state.num_resumes, **answer_facts(state))


def answer_facts(state: RequestState) -> dict:
    """What every event of a request says about its prompt: the prefix-cache hits, and where it was
    prefilled (disaggregated serving)."""
    placement = state.placement.report() if state.placement is not None else None
    return {"num_cached_tokens": state.num_cached_tokens or 0, "placement": placement}
