"""The features of a model step that engines report and the step-time model fits (control/stepmodel.py).

Kept free of imports: `splitserve profile` must set OMP_WAIT_POLICY before torch loads, so the
control package's step model may not pull torch in through the engine protocol."""
from __future__ import annotations


def prefill_attn_ktok2(start: int, chunk: int) -> float:
    """The attention feature of one prefill chunk of `chunk` tokens after `start` computed ones:
    chunk * (start + chunk / 2) / 1000, the query-key pairs it scores, in thousands."""
    return chunk * (start + chunk / 2) / 1000.0


def step_shape(batch) -> tuple[int, float, int, int]:
    """(prefill tokens, prefill attention ktok2, decode sequences, decode KV tokens) of a scheduled
    batch (engine/scheduler.ScheduledBatch) before it runs, as control/stepmodel.py models it; a
    decode at position p attends to p + 1 tokens. The engine reports it, the simulator times it."""
    prefill_tokens = sum(n for _, n in batch.prefills)
    attn = sum(prefill_attn_ktok2(r.num_computed_tokens, n) for r, n in batch.prefills)
    return prefill_tokens, attn, len(batch.decodes), sum(r.num_computed_tokens + 1 for r in batch.decodes)
