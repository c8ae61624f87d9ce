"""The features of a model step that engines report and the step-time model fits (control/stepmodel.py).

Kept free of imports: `splitserve profile` must set OMP_WAIT_POLICY before torch loads, so the
control package's step model may not pull torch in through the engine protocol."""
from __future__ import annotations


def prefill_attn_ktok2(start: int, chunk: int) -> float:
    """The attention feature of one prefill chunk of `chunk` tokens after `start` computed ones:
    chunk * (start + chunk / 2) / 1000, the query-key pairs it scores, in thousands."""
    return chunk * (start + chunk / 2) / 1000.0
