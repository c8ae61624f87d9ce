"""The step-time model learnt online from the engines' own measured steps.

Every engine reports the shape and the seconds of each step that ran the model (protocol.StepSample,
with its stats); the frontend keeps the last few hundred per instance (request_state.STEP_WINDOW).
Per thread count the model is refitted by stepmodel.fit_step_model (NNLS on relative error) over
those samples plus pseudo-samples of the prior model (a `--profile`, or mix.FALLBACK_STEP_MODEL)
at a fixed grid of shapes, PRIOR_WEIGHT samples' worth in all. So a coefficient the recent steps
pin down follows them (a few hundred samples outweigh the prior a hundredfold), while one they
cannot tell apart stays near the prior: with no prefill seen yet, every prefill coefficient; with
every decode batch of one size, how a step's cost splits between its overhead and its decodes.

This is one regression of step time on prefill tokens and on decode KV tokens, as NVIDIA Dynamo's
load-based planner fits from measured steps; with few samples the prior, scaled by the measured
to modelled ratio (mix.MixController._correction), serves instead.

The fit predicts a step's mean time. A stream's worst gap is one step, not a mean: the steps that
carry prompt tokens spread (on a 2-vCPU box, 1.12-1.35x the fit at their 90th percentile; issue
28 measured prompt steps 9-35% longer beside a second engine), so `prompt_step_tail` keeps a quantile of their
measured to fitted ratio for control/whatif.py's gap (changing_demand, session 19: a 128-token
chunk predicted at 450 ms against a 500 ms gap target ran 0.51-0.78 s, and the documents that met
those steps missed their p99 gap).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.control.stepmodel import StepModel, StepModels, StepShape, fit_step_model, prefill_attn_ktok2

PRIOR_WEIGHT = 3.0  # the prior's pseudo-samples weigh as much as this many measured steps, all together
MIN_SAMPLES = 30    # measured steps before the online fit replaces the scaled prior
TAIL_QUANTILE = 0.9   # prompt_step_tail's quantile of measured / fitted over steps with prompt tokens
MIN_TAIL_SAMPLES = 10  # such steps before it is read (1.0 until then)
MAX_TAIL = 2.0         # a cap, so a few steps stalled by something else do not rule the gap
REWEIGHTS = 3       # fits per refit: each weighs the prior's pseudo-samples by the last fit's times


def _prior_grid() -> list[StepShape]:
    """Shapes where the prior speaks, each dominated by one or two of its terms, so that a term the
    measured steps pin down (say the overhead) moves the others little: a near-empty step, a short
    prompt (its step's fixed costs), long prompts, chunks deep into long prompts, wide and long
    decode batches. No mixed step: the model adds its terms, and a mixed pseudo-sample would tie
    the prefill terms to the decode ones."""
    shapes = [StepShape(0, 0.0, 1, 64)]
    shapes += [StepShape(n, prefill_attn_ktok2(0, n)) for n in (32, 512, 1024)]  # 32: a prompt step's fixed cost
    shapes += [StepShape(256, prefill_attn_ktok2(start, 256)) for start in (2048, 4096)]
    shapes += [StepShape(0, 0.0, seqs, seqs * context) for seqs in (16, 32) for context in (64, 2048)]
    return shapes


PRIOR_GRID = tuple(_prior_grid())


@dataclass(slots=True, frozen=True)
class StepSample:
    """One measured step: what it held and how long it took."""

    shape: StepShape
    seconds: float


def describe_model(m: StepModel) -> str:
    return (f"{m.overhead_s * 1e3:.1f} ms + {m.per_prefill_token_s * 1e3:.2f} ms/prompt token + "
            f"{m.per_prefill_attn_s * 1e3:.2f} ms/attention ktok2 + {m.per_decode_seq_s * 1e3:.2f} ms/decode + "
            f"{m.per_decode_kv_token_s * 1e6:.1f} us/KV token + {m.per_panel_step_s * 1e3:.1f} ms/panel step + "
            f"{m.per_prompt_step_s * 1e3:.1f} ms/prompt step")


class OnlineStepModel:
    """One thread count's model: the prior until `min_samples` steps are measured, then the fit."""

    def __init__(self, prior: StepModel, prior_weight: float = PRIOR_WEIGHT, min_samples: int = MIN_SAMPLES):
        if not prior_weight > 0 or min_samples < 1:
            raise ValueError(f"online step model: prior_weight must be positive and min_samples >= 1, got "
                             f"{prior_weight} and {min_samples}")
        self.prior, self.model = prior, prior
        self.prior_weight, self.min_samples = prior_weight, min_samples
        self.num_samples = 0
        self.num_fits = 0
        self.median_error: float | None = None  # the fit's median |relative error| on the measured steps
        self.prompt_step_tail = 1.0  # TAIL_QUANTILE of measured / fitted for steps with prompt tokens, in [1, MAX_TAIL]
        self.num_prompt_steps = 0
        grid = [(shape, prior.predict(shape)) for shape in PRIOR_GRID]
        self._grid = [(shape, seconds) for shape, seconds in grid if seconds > 0]

    @property
    def ready(self) -> bool:
        return self.num_samples >= self.min_samples

    def refit(self, samples: Sequence[StepSample]) -> None:
        measured = [s for s in samples if s.seconds > 0]
        self.num_samples = len(measured)
        if not self.ready:
            self.model, self.median_error, self.prompt_step_tail = self.prior, None, 1.0
            return
        shapes = [s.shape for s in measured] + [shape for shape, _ in self._grid]
        seconds = [s.seconds for s in measured] + [t for _, t in self._grid]
        prior_t = np.asarray([t for _, t in self._grid])
        share = np.full(len(self._grid), self.prior_weight / len(self._grid))
        for _ in range(REWEIGHTS):
            self.model = fit_step_model(shapes, seconds, [1.0] * len(measured) + share.tolist()).model
            # A pseudo-sample's error relative to the larger of the prior's time and the fit's: relative to the
            # prior's alone, a prior 5x too fast would pull 25x harder than the steps that contradict it.
            fitted = np.asarray([self.model.predict(shape) for shape, _ in self._grid])
            share = self.prior_weight / len(self._grid) * (prior_t / np.maximum(prior_t, fitted)) ** 2
        y = np.asarray([s.seconds for s in measured])
        predicted = np.asarray([self.model.predict(s.shape) for s in measured])
        self.median_error = float(np.median(np.abs(predicted - y) / y))
        prompt = np.asarray([s.shape.prefill_tokens > 0 for s in measured])
        self.num_prompt_steps = int(prompt.sum())
        self.prompt_step_tail = 1.0
        if self.num_prompt_steps >= MIN_TAIL_SAMPLES:
            ratio = y[prompt] / np.maximum(predicted[prompt], 1e-9)
            self.prompt_step_tail = min(max(float(np.quantile(ratio, TAIL_QUANTILE)), 1.0), MAX_TAIL)
        self.num_fits += 1

    def describe(self) -> dict:
        """For GET /admin/mix: which model is in use and how well it fits."""
        return {"source": "online" if self.ready else "prior", "num_samples": self.num_samples,
                "min_samples": self.min_samples, "num_fits": self.num_fits, "coefficients": self.model.to_dict(),
                "median_abs_rel_error": self.median_error, "prompt_step_tail": self.prompt_step_tail,
                "num_prompt_steps": self.num_prompt_steps, "prior": self.prior.to_dict()}


class OnlineStepModels:
    """Online models by thread count, each anchored to the prior's model for its count."""

    def __init__(self, prior: StepModels | StepModel, prior_weight: float = PRIOR_WEIGHT,
                 min_samples: int = MIN_SAMPLES):
        self.prior, self.prior_weight, self.min_samples = prior, prior_weight, min_samples
        self.by_threads: dict[int, OnlineStepModel] = {}
        self._seen: dict[int, tuple] = {}

    def prior_for(self, threads: int) -> StepModel:
        return self.prior.for_threads(threads) if isinstance(self.prior, StepModels) else self.prior

    def update(self, threads: int, sources: Sequence[tuple[str, int, Sequence[StepSample]]]) -> OnlineStepModel:
        """sources: (instance id, step samples it has sent so far, its recent window) for every
        instance at this thread count. Refits only if some instance sent samples since the last call."""
        online = self.by_threads.get(threads)
        if online is None:
            online = self.by_threads[threads] = OnlineStepModel(self.prior_for(threads), self.prior_weight,
                                                                self.min_samples)
        seen = tuple((instance_id, count) for instance_id, count, _ in sources)
        if seen != self._seen.get(threads):
            self._seen[threads] = seen
            online.refit([sample for _, _, window in sources for sample in window])
        return online
