"""When each request arrives: constant, Poisson, gamma, on/off bursts, phases, or a replayed trace.

Every generator is a pure function of the spec and a seeded numpy Generator, so one seed
gives every arrangement the same arrival times. An `Arrival` may also fix the request's
class or lengths (bursts of documents, trace rows); the workload fills in the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve.trial.spec import ArrivalSpec
from splitserve.trial.traces import read_trace


@dataclass(slots=True, frozen=True)
class Arrival:
    time_s: float
    class_name: str | None = None
    prompt_tokens: int | None = None
    answer_tokens: int | None = None


def interarrival_gaps(pattern: str, rate: float, count: int, rng: np.random.Generator,
                      burstiness: float = 1.0) -> np.ndarray:
    """`count` gaps (seconds) with mean 1/rate; gamma's coefficient of variation is `burstiness`."""
    if pattern == "constant":
        return np.full(count, 1.0 / rate)
    if pattern == "poisson":
        return rng.exponential(1.0 / rate, count)
    if pattern == "gamma":
        shape = 1.0 / burstiness**2  # CV of a gamma variable is 1/sqrt(shape)
        return rng.gamma(shape, 1.0 / (rate * shape), count)
    raise ValueError(f"unknown arrival pattern {pattern!r}")


def _times(pattern: str, rate: float, rng: np.random.Generator, burstiness: float,
           num_requests: int | None, duration_s: float | None) -> np.ndarray:
    """Arrival times starting at 0: the first request goes at once, the rest follow the gaps."""
    if num_requests is not None:
        gaps = interarrival_gaps(pattern, rate, max(num_requests - 1, 0), rng, burstiness)
        return np.concatenate([[0.0], np.cumsum(gaps)])
    assert duration_s is not None
    times, t = [], 0.0
    while t < duration_s:
        times.append(t)
        t += float(interarrival_gaps(pattern, rate, 1, rng, burstiness)[0])
    return np.asarray(times)


def generate_arrivals(spec: ArrivalSpec, rng: np.random.Generator) -> list[Arrival]:
    if spec.pattern in ("constant", "poisson", "gamma"):
        times = _times(spec.pattern, spec.rate, rng, spec.burstiness, spec.num_requests, spec.duration_s)
        return [Arrival(float(t)) for t in times]
    if spec.pattern == "on_off":
        return _on_off(spec, rng)
    if spec.pattern == "phases":
        return _phases(spec, rng)
    if spec.pattern == "trace":
        return _from_trace(spec, rng)
    raise ValueError(f"unknown arrival pattern {spec.pattern!r}")


def _phases(spec: ArrivalSpec, rng: np.random.Generator) -> list[Arrival]:
    """Each phase's stream after the last; a phase with its own `mix` fixes its requests' classes
    (drawn after every time, so giving a phase a mix never moves an arrival)."""
    per_phase, start = [], 0.0
    for phase in spec.phases:
        times = _times(phase.pattern, phase.rate, rng, phase.burstiness, None, phase.duration_s)
        per_phase.append([start + float(t) for t in times])
        start += phase.duration_s
    out = []
    for phase, times in zip(spec.phases, per_phase):
        if phase.mix is None:
            out += [Arrival(t) for t in times]
            continue
        names = list(phase.mix)
        weights = np.asarray([phase.mix[n] for n in names], dtype=float)
        picks = rng.choice(len(names), size=len(times), p=weights / weights.sum())
        out += [Arrival(t, names[int(k)]) for t, k in zip(times, picks)]
    return out


def _on_off(spec: ArrivalSpec, rng: np.random.Generator) -> list[Arrival]:
    """A steady Poisson stream of the quiet class, with a burst of the burst class every period."""
    quiet = _times("poisson", spec.rate, rng, 1.0, None, spec.duration_s)
    out = [Arrival(float(t), spec.quiet_class) for t in quiet]
    burst_start = spec.burst_every_s / 2  # the first burst lands mid-period, after the chats settle
    while burst_start < spec.duration_s:
        offsets = np.sort(rng.uniform(0.0, spec.burst_spread_s, spec.burst_size))
        out += [Arrival(burst_start + float(o), spec.burst_class) for o in offsets]
        burst_start += spec.burst_every_s
    return sorted(out, key=lambda a: a.time_s)


def _from_trace(spec: ArrivalSpec, rng: np.random.Generator) -> list[Arrival]:
    out = []
    for rec in read_trace(spec.trace_path, spec.trace_format):
        if rec.time_s < spec.start_s or rng.random() >= spec.sample:
            continue
        time_s = (rec.time_s - spec.start_s) / spec.time_scale
        if spec.duration_s is not None and time_s >= spec.duration_s:
            break
        prompt = min(max(rec.prompt_tokens, 1), spec.max_prompt_tokens or rec.prompt_tokens or 1)
        answer = min(max(rec.answer_tokens, 1), spec.max_answer_tokens or rec.answer_tokens or 1)
        out.append(Arrival(time_s, "long" if rec.prompt_tokens >= spec.long_input_tokens else "short",
                           prompt, answer))
        if spec.num_requests is not None and len(out) >= spec.num_requests:
            break
    if out:
        t0 = out[0].time_s
        out = [Arrival(a.time_s - t0, a.class_name, a.prompt_tokens, a.answer_tokens) for a in out]
    return out


def compress(arrivals: list[Arrival], rate_multiplier: float) -> list[Arrival]:
    """The same requests, arriving `rate_multiplier` times as fast (a sweep's load axis)."""
    return [Arrival(a.time_s / rate_multiplier, a.class_name, a.prompt_tokens, a.answer_tokens)
            for a in arrivals]


def burstiness_stats(times: np.ndarray, window_s: float = 10.0) -> dict:
    """Mean rate, coefficient of variation of inter-arrival gaps, and peak over mean windowed rate."""
    times = np.sort(np.asarray(times, dtype=float))
    span = float(times[-1] - times[0]) if len(times) > 1 else 0.0
    gaps = np.diff(times)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0
    mean_rate = (len(times) - 1) / span if span > 0 else 0.0
    peak_ratio = 0.0
    if span > 0:
        edges = np.arange(times[0], times[-1] + window_s, window_s)
        counts, _ = np.histogram(times, bins=edges)
        window_rates = counts / window_s
        peak_ratio = float(window_rates.max() / window_rates.mean()) if window_rates.mean() > 0 else 0.0
    return {"num_requests": int(len(times)), "span_s": span, "mean_rate": mean_rate,
            "interarrival_cv": cv, "peak_to_mean_rate": peak_ratio, "window_s": window_s}
