"""One model of an engine step's time, shared by the simulator, the planner and the mix controller.

A step runs some prefill chunks and some decodes in one forward pass. Its time is a linear
function of what it holds (as NVIDIA Dynamo's load-based planner regresses step time on
prefill tokens and on decode KV tokens):

    step_s = overhead_s
           + per_prefill_token_s   * prefill_tokens            (weights: every token's matmuls)
           + per_prefill_attn_s    * prefill_attn_ktok2         (attention of a chunk over its context)
           + per_decode_seq_s      * decode_seqs                (a decode token's matmuls)
           + per_decode_kv_token_s * decode_kv_tokens           (a decode reads its whole KV)
           + per_panel_step_s      * [prefill_tokens + decode_seqs > PANEL_ROWS]
           + per_prompt_step_s     * [prefill_tokens > 0]

where prefill_attn_ktok2 = sum over chunks of chunk * (start + chunk / 2) / 1000: a chunk of
`chunk` tokens starting at position `start` attends to about start + chunk / 2 tokens each.
The last term is the GGUF kernels' panel path (kernels/gguf_linear.cpp): a step of more rows
than one 8-row tile first dequantizes every weight into fp32 panels, once per step, so it
costs a fixed amount more than a step of up to 8 rows; on one AVX2 thread about 50 ms, which
a line through the decode steps put on every prefill token instead (a 32-token prompt 28%
short). With fp32 weights the fit leaves it near 0.

The prompt-step term is a fixed cost of any step that carries prompt tokens, over what a
decode-only step of as many rows pays. On the AMX Xeon of sessions 27-30 the panel term alone put a
16-decode step's cost partly on that fixed cost, so each decode in a step beside a short prompt read
2.4 ms where it costs 3.5-5 ms, and a 32-token prompt beside 8 decodes 24-29% short
(bench/mixed_steps.py); with both terms the fit gives the panel 7 ms and a prompt step 24 ms, and
every prompt length from 32 to 256 tokens beside 8-16 decodes reads 5-11% short alike, the level of
one engine start against another's (docs/benchmarks.md, "Planner", session 30). Where decodes do pay the panel (the
AVX2 EPYC's 50 ms) the fit can still say so: the two terms are apart wherever the profile has a
decode-only step of more than PANEL_ROWS rows.

The coefficients are fitted per thread count by non-negative least squares on a profile's
samples. A thread count the profile lacks is extrapolated with Amdahl's law, its serial
fraction taken from two profiled thread counts when there are two (or given by hand).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from splitserve.stepfeatures import prefill_attn_ktok2  # one definition: engines report it, the model fits it

COEFFICIENTS = ("overhead_s", "per_prefill_token_s", "per_prefill_attn_s", "per_decode_seq_s",
                "per_decode_kv_token_s", "per_panel_step_s", "per_prompt_step_s")
PANEL_ROWS = 8  # kMR in kernels/gguf_linear.cpp: steps with more rows take the panel path
DEFAULT_SERIAL_FRACTION = 0.3  # when only one thread count was profiled: a CPU forward pass scales poorly


@dataclass(slots=True, frozen=True)
class StepShape:
    """What one step holds, in the model's features."""

    prefill_tokens: int = 0
    prefill_attn_ktok2: float = 0.0
    decode_seqs: int = 0
    decode_kv_tokens: int = 0

    def vector(self) -> list[float]:
        return [1.0, float(self.prefill_tokens), self.prefill_attn_ktok2, float(self.decode_seqs),
                float(self.decode_kv_tokens), float(self.prefill_tokens + self.decode_seqs > PANEL_ROWS),
                float(self.prefill_tokens > 0)]


@dataclass(slots=True, frozen=True)
class StepModel:
    overhead_s: float
    per_prefill_token_s: float
    per_prefill_attn_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_decode_kv_token_s: float = 0.0
    per_panel_step_s: float = 0.0
    per_prompt_step_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value) or value < 0:
                raise ValueError(f"step model: {f.name} must be a finite number >= 0, got {value!r}")

    def step_s(self, prefill_tokens: int = 0, prefill_attn: float = 0.0, decode_seqs: int = 0,
               decode_kv_tokens: int = 0) -> float:
        """Hot path of the simulator: plain arithmetic, no objects."""
        seconds = (self.overhead_s + self.per_prefill_token_s * prefill_tokens
                   + self.per_prefill_attn_s * prefill_attn + self.per_decode_seq_s * decode_seqs
                   + self.per_decode_kv_token_s * decode_kv_tokens)
        if prefill_tokens:
            seconds += self.per_prompt_step_s
        return seconds + self.per_panel_step_s if prefill_tokens + decode_seqs > PANEL_ROWS else seconds

    @property
    def prompt_step_fixed_s(self) -> float:
        """What a step with prompt tokens pays once beside them, over the overhead: the panel path
        (a prompt step nearly always has more than PANEL_ROWS rows) and its own fixed cost."""
        return self.per_panel_step_s + self.per_prompt_step_s

    def predict(self, shape: StepShape) -> float:
        return self.step_s(shape.prefill_tokens, shape.prefill_attn_ktok2, shape.decode_seqs,
                           shape.decode_kv_tokens)

    def prefill_s(self, num_tokens: int, chunk_budget: int | None = None) -> float:
        """Seconds to prefill one prompt alone, whole or in chunks of `chunk_budget` tokens."""
        chunk = num_tokens if not chunk_budget else chunk_budget
        total, start = 0.0, 0
        while start < num_tokens:
            n = min(chunk, num_tokens - start)
            total += self.step_s(n, prefill_attn_ktok2(start, n))
            start += n
        return total

    def decode_step_s(self, num_seqs: int, kv_tokens: int) -> float:
        return self.step_s(decode_seqs=num_seqs, decode_kv_tokens=kv_tokens)

    def scaled(self, factor: float) -> "StepModel":
        return StepModel(*(getattr(self, name) * factor for name in COEFFICIENTS))

    def to_dict(self) -> dict:
        return asdict(self)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (drop the most negative coefficient and refit until none is).
    Good enough for five well-separated features; numpy has no NNLS and scipy is not a dependency."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


@dataclass(slots=True, frozen=True)
class FitReport:
    model: StepModel
    num_samples: int
    median_abs_rel_error: float
    max_abs_rel_error: float


def fit_step_model(shapes: list[StepShape], seconds: list[float], weights: list[float] | None = None) -> FitReport:
    """Fit on relative error (each row divided by its time) so short decode steps weigh as much
    as long prefills: the simulator sums thousands of the former. weights: each row's share of
    the squared error (default 1 each; the online model gives its prior's pseudo-samples little)."""
    if len(shapes) != len(seconds) or not shapes or (weights is not None and len(weights) != len(shapes)):
        raise ValueError("fit_step_model: give one time (and one weight, if any) per step shape, at least one")
    y = np.asarray(seconds, dtype=float)
    if (y <= 0).any():
        raise ValueError("fit_step_model: step times must be positive")
    a = np.asarray([s.vector() for s in shapes])  # [num_samples, num_coefficients]
    w = 1.0 / y
    if weights is not None:
        if any(not weight > 0 for weight in weights):
            raise ValueError("fit_step_model: weights must be positive")
        w = w * np.sqrt(np.asarray(weights, dtype=float))
    coef = nnls(a * w[:, None], y * w)
    model = StepModel(*(float(c) for c in coef))
    rel = np.abs(a @ coef - y) / y
    return FitReport(model, len(y), float(np.median(rel)), float(rel.max()))


def serial_fraction(t1: int, s1: float, t2: int, s2: float) -> float:
    """Amdahl's serial fraction from the same work timed at two thread counts (s = seconds)."""
    if t1 == t2:
        return DEFAULT_SERIAL_FRACTION
    r = s2 / s1  # = (f + (1 - f) / t2) / (f + (1 - f) / t1)
    a, b = 1 / t1, 1 / t2
    f = (b - r * a) / (r * (1 - a) - (1 - b))
    return float(min(max(f, 0.0), 1.0))


def amdahl(threads: int, fraction: float) -> float:
    return fraction + (1 - fraction) / threads


class StepModels:
    """Step models by thread count; any thread count answered, profiled or extrapolated."""

    def __init__(self, by_threads: dict[int, StepModel], serial: float | None = None):
        if not by_threads:
            raise ValueError("step models: at least one thread count is needed")
        self.by_threads = dict(sorted(by_threads.items()))
        if serial is None:
            serial = DEFAULT_SERIAL_FRACTION
            if len(self.by_threads) >= 2:
                (t1, m1), (t2, m2) = list(self.by_threads.items())[:1] + list(self.by_threads.items())[-1:]
                probe = StepShape(256, prefill_attn_ktok2(0, 256), 8, 8 * 512)
                serial = serial_fraction(t1, m1.predict(probe), t2, m2.predict(probe))
        self.serial_fraction = serial

    def for_threads(self, threads: int) -> StepModel:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if threads in self.by_threads:
            return self.by_threads[threads]
        below = [t for t in self.by_threads if t <= threads]
        base = max(below) if below else min(self.by_threads)
        factor = amdahl(threads, self.serial_fraction) / amdahl(base, self.serial_fraction)
        return self.by_threads[base].scaled(factor)
