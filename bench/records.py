"""One row of the engine benchmark, whichever system produced it.

Every time is taken twice: wall time, and the CPU time of the process. On the shared
2-core box other engineers' jobs steal the core from a 1-thread run; its CPU time
leaves out the stolen slices and so estimates what a quiet machine would show
("quiet" figures). With 2 threads CPU time also counts threads spinning at barriers,
so there the quiet figure is the wall time.

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
    seconds: float  # best of the repeats: wall time to the first sampled token
    cpu_seconds: float  # best of the repeats: process CPU time
    repeats: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def quiet_seconds(self) -> float:
        return quiet(self.seconds, self.cpu_seconds, self.threads)


@dataclass(slots=True)
class DecodeResult:
    system: str
    threads: int
    batch_size: int
    context_len: int  # mean tokens already in each sequence's cache while timing
    num_steps: int
    best_step_s: float  # the rate uses the fastest step: on a shared machine it is the least disturbed
    median_step_s: float  # kept to show how much neighbours disturbed the run
    best_step_cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.best_step_s

    @property
    def quiet_seconds(self) -> float:
        """Per step."""
        return quiet(self.best_step_s, self.best_step_cpu_s, self.threads)


def quiet(wall_s: float, cpu_s: float, threads: int) -> float:
    """The time a quiet machine would take: CPU time for one thread, wall time otherwise."""
    return cpu_s if threads == 1 else wall_s


def as_row(result: PrefillResult | DecodeResult) -> dict:
    """A JSON-ready dict with the derived rate included."""
    row = {name: getattr(result, name) for name in result.__slots__}
    row["kind"] = "prefill" if isinstance(result, PrefillResult) else "decode"
    row["tokens_per_s"] = result.tokens_per_s
    size = result.num_tokens if isinstance(result, PrefillResult) else result.batch_size
    row["quiet_tokens_per_s"] = size / result.quiet_seconds
    return row


class StepTimer:
    """Collects per-step wall and process-CPU times."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = self._cpu_start = 0.0

    def __enter__(self) -> "StepTimer":
        self._start, self._cpu_start = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def best_cpu(self) -> float:
        return min(self.cpu_times)
