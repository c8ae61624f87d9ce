"""A trial's own engine steps beside the profile: how much slower (or faster) each step ran in the
trial than the profile's step model says the same shape takes.

A trial run keeps the steps its engines measured (trial/engine_steps.py: per instance, shape,
`seconds` for the model's forward and sampling, `loop_seconds` for the engine loop's whole turn
around it). The profile times EngineCore.step alone on an otherwise idle engine, so

    model ratio  seconds / predicted       the machine itself: drift, a neighbour on the other
                                           core, the frequency the host gives this minute
    loop ratio   loop_seconds / predicted  ... plus the engine process's own work around the
                                           step (requests in, outputs out) that the profile
                                           does not see

Both are given as the median over steps and as the ratio of the sums (time-weighted: what the
instance's busy time was against what the model says, the figure capacity answers to), over all
steps and apart for steps that carry prompt tokens and decode-only steps: on the AVX2 box the
two came apart (chat-only, session 8: decode-only steps 0.97-1.01 of the profile, prompt steps
1.25-1.73), so one factor for both would be wrong for either. Re-simulating with the profile's
prompt terms scaled by the prompt steps' ratio and its other terms by the decode steps' ratio
(`scaled_profile`) separates the capacity error that step time explains from the one the
simulator's scheduling model leaves.
"""
from __future__ import annotations

import dataclasses
import statistics

from splitserve.control.profile_file import Profile
from splitserve.control.stepmodel import StepModels, StepShape

MIN_STEPS = 20  # fewer measured steps than this and an arrangement gets no ratio


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _summary(measured: list[float], predicted: list[float]) -> dict | None:
    pairs = [(m, p) for m, p in zip(measured, predicted) if m > 0 and p > 0]
    if len(pairs) < MIN_STEPS:
        return None
    ratios = [m / p for m, p in pairs]
    return {"num_steps": len(pairs), "median": statistics.median(ratios), "p10": _quantile(ratios, 0.1),
            "p90": _quantile(ratios, 0.9), "time_weighted": sum(m for m, _ in pairs) / sum(p for _, p in pairs),
            "measured_s": sum(m for m, _ in pairs)}


SAMPLE_FIELDS = ("prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds", "loop_seconds")


def step_ratios(profile: Profile, threads_by_role: dict[str, int], runs: list[dict]) -> dict | None:
    """Over every run's `engine_steps`: the model and loop ratios, all steps together and split by
    role and by kind (steps with prompt tokens, decode-only steps). None without enough steps."""
    groups: dict[str, tuple[list[float], list[float], list[float]]] = {}

    def add(key: str, seconds: float, loop: float, predicted: float) -> None:
        model, loops, preds = groups.setdefault(key, ([], [], []))
        model.append(seconds)
        loops.append(loop)
        preds.append(predicted)

    for run in runs:
        steps = (run.get("summary") or {}).get("engine_steps") or {}
        fields = steps.get("fields") or []
        if fields[:6] != list(SAMPLE_FIELDS):
            continue
        for inst in (steps.get("instances") or {}).values():
            threads = threads_by_role.get(inst.get("role"))
            if threads is None:
                continue
            model = profile.steps.for_threads(threads)
            for p, attn, d, kv, seconds, loop in inst.get("samples") or []:
                predicted = model.predict(StepShape(int(p), float(attn), int(d), int(kv)))
                kind = "prefill" if p else "decode"
                for key in ("all", f"role:{inst['role']}", f"kind:{kind}", f"threads:{threads}:kind:{kind}"):
                    add(key, seconds, loop, predicted)
    if "all" not in groups:
        return None
    out = {}
    for key, (model, loops, preds) in groups.items():
        entry = {"model": _summary(model, preds), "loop": _summary(loops, preds)}
        if entry["model"] is not None:
            out[key] = entry
    return out or None


def trial_factors(ratios: dict | None) -> tuple[float, float] | None:
    """(prompt steps' factor, decode-only steps' factor): each kind's time-weighted loop ratio (the
    model's own where no loop turn was measured); a kind without enough steps takes the other's."""
    if not ratios:
        return None

    def factor(key: str) -> float | None:
        entry = ratios.get(key)
        chosen = entry and (entry.get("loop") or entry.get("model"))
        return chosen["time_weighted"] if chosen else None
    return _factor_pair(factor("kind:prefill"), factor("kind:decode"), factor("all"))


def _factor_pair(prefill: float | None, decode: float | None, overall: float | None) -> tuple[float, float] | None:
    prefill, decode = prefill or decode or overall, decode or prefill or overall
    return (prefill, decode) if prefill and decode else None


def scaled_profile(profile: Profile, prefill_factor: float, decode_factor: float | None = None) -> Profile:
    """The profile with its prompt terms (per prompt token, attention, the panel pass) `prefill_factor`
    times as long and its other terms (overhead, decodes) `decode_factor` times (the same factor when
    only one is given), and no separate neighbour factor: a ratio measured in the trial already
    holds whatever the neighbour cost."""
    decode_factor = prefill_factor if decode_factor is None else decode_factor
    if not prefill_factor > 0 or not decode_factor > 0:
        raise ValueError(f"step time factors must be > 0, got {prefill_factor} and {decode_factor}")

    by_threads = {t: m.scaled_by_kind(prefill_factor, decode_factor) for t, m in profile.steps.by_threads.items()}
    return dataclasses.replace(profile, steps=StepModels(by_threads, profile.steps.serial_fraction),
                               host_contention=1.0)


def calibration(profile: Profile, arrangements: list[tuple[dict[str, int], list[dict]]]) -> dict:
    """Per thread count, the prompt-step and decode-step factors of every given arrangement's
    measured steps together ((threads by role, runs) pairs), against `profile` (uncalibrated):
    what `parse_profile` applies when a profile carries it as `trial_calibration.threads`."""
    pooled: dict[str, tuple[list[float], list[float]]] = {}
    for threads_by_role, runs in arrangements:
        for key, (measured, predicted) in _kind_times(profile, threads_by_role, runs).items():
            m, p = pooled.setdefault(key, ([], []))
            m.extend(measured)
            p.extend(predicted)
    out = {}
    for threads in sorted({key.split(":")[1] for key in pooled}, key=int):
        entry = {}
        for kind in ("prefill", "decode"):
            summary = _summary(*pooled.get(f"threads:{threads}:kind:{kind}", ([], [])))
            if summary:
                entry[kind], entry[f"{kind}_steps"] = summary["time_weighted"], summary["num_steps"]
        pair = _factor_pair(entry.get("prefill"), entry.get("decode"), None)
        if pair:
            out[threads] = {**entry, "prefill": pair[0], "decode": pair[1]}
    return out


def _kind_times(profile: Profile, threads_by_role: dict[str, int], runs: list[dict]) -> dict:
    """threads:N:kind:K -> (measured seconds, predicted seconds) per step: the loop turn where it was
    measured, the model's own time otherwise."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for run in runs:
        steps = (run.get("summary") or {}).get("engine_steps") or {}
        if (steps.get("fields") or [])[:6] != list(SAMPLE_FIELDS):
            continue
        for inst in (steps.get("instances") or {}).values():
            threads = threads_by_role.get(inst.get("role"))
            if threads is None:
                continue
            model = profile.steps.for_threads(threads)
            for p, attn, d, kv, seconds, loop in inst.get("samples") or []:
                measured, predicted = out.setdefault(f"threads:{threads}:kind:{'prefill' if p else 'decode'}", ([], []))
                measured.append(loop if loop > 0 else seconds)
                predicted.append(model.predict(StepShape(int(p), float(attn), int(d), int(kv))))
    return out
