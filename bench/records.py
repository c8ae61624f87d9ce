"""One row of the engine benchmark, whichever system produced it.

Standard library only: the llama.cpp baseline imports this from its own venv,
which has no torch and no splitserve.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(slots=True)
class PrefillResult:
    system: str  # "splitserve" | "hf" | "llama.cpp"
    threads: int
    num_tokens: int
    seconds: float  # best of the repeats: time to the first sampled token
    repeats: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


@dataclass(slots=True)
class DecodeResult:
    system: str
    threads: int
    batch_size: int
    context_len: int  # mean tokens already in each sequence's cache while timing
    num_steps: int
    best_step_s: float  # the rate uses the fastest step: on a shared machine it is the least disturbed
    median_step_s: float  # kept to show how much neighbours disturbed the run

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.best_step_s


def as_row(result: PrefillResult | DecodeResult) -> dict:
    """A JSON-ready dict with the derived rate included."""
    row = {name: getattr(result, name) for name in result.__slots__}
    row["kind"] = "prefill" if isinstance(result, PrefillResult) else "decode"
    row["tokens_per_s"] = result.tokens_per_s
    return row


class StepTimer:
    """Collects per-step wall times; `median` summarises them."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def __enter__(self) -> "StepTimer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.times.append(time.perf_counter() - self._start)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)
