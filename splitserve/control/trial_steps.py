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
    cpu ratio    cpu_seconds / predicted   the engine thread's CPU time in the step: where the
                                           model ratio is high and this one is not, the step
                                           waited for a core that another process held
                                           (the frontend, the client, a neighbour); only for
                                           1-thread instances (on more, the other threads'
                                           work is not in it); older engines give none
    on-CPU share sum(cpu_seconds) / sum(seconds) over the same steps

Both are given as the median over steps and as the ratio of the sums (time-weighted: what the
instance's busy time was against what the model says), over all steps and apart for steps that
carry prompt tokens and decode-only steps: on the AVX2 box the two came apart (chat-only, session
8: decode-only steps 0.97-1.01 of the profile, prompt steps 1.25-1.73).

The step model refitted on a trial's own steps, with the profile as its prior (`refit`: the mix
controller's online fit), says what the arrangement's steps took in that trial; simulating with
it (`with_models`) separates the capacity error that step time explains from the one the
simulator's scheduling model leaves, and `calibration` writes it into a profile for later plans.
"""
from __future__ import annotations

import dataclasses
import statistics

from splitserve.control.online_stepmodel import OnlineStepModel
from splitserve.control.online_stepmodel import StepSample as OnlineSample
from splitserve.control.profile_file import Profile
from splitserve.control.stepmodel import StepModel, StepModels, StepShape
from splitserve.protocol import STEP_SAMPLE_FIELDS

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


# the fields a run's steps must name to be read (older trials' steps lack cpu_seconds: read as 0)
_NEEDED = STEP_SAMPLE_FIELDS[:STEP_SAMPLE_FIELDS.index("loop_seconds") + 1]


def instance_steps(threads_by_role: dict[str, int], runs: list[dict]):
    """(role, threads, shape, model seconds, loop seconds, cpu seconds) of every step the runs kept,
    for the instances whose role the arrangement has (runs without steps, or of another layout,
    give none). Rows are read by the run's own field names, so older trials' steps still count. The
    CPU time is 0 (unknown) where the engine ran on more than one thread: the engine thread's CPU
    time says whether a step waited for a core only where that thread ran the whole model."""
    for run in runs:
        steps = (run.get("summary") or {}).get("engine_steps") or {}
        fields = list(steps.get("fields") or ())
        if not set(_NEEDED) <= set(fields):
            continue
        at = [fields.index(f) for f in _NEEDED]
        cpu_at = fields.index("cpu_seconds") if "cpu_seconds" in fields else None
        for inst in (steps.get("instances") or {}).values():
            threads = threads_by_role.get(inst.get("role"))
            if threads is None:
                continue
            for row in inst.get("samples") or []:
                p, attn, d, kv, seconds, loop = (row[i] for i in at)
                cpu = row[cpu_at] if cpu_at is not None and threads == 1 else 0.0
                yield inst["role"], threads, StepShape(int(p), float(attn), int(d), int(kv)), seconds, loop, cpu


def step_ratios(profile: Profile, threads_by_role: dict[str, int], runs: list[dict]) -> dict | None:
    """Over every run's `engine_steps`: the model and loop ratios, all steps together and split by
    role and by kind (steps with prompt tokens, decode-only steps). None without enough steps."""
    groups: dict[str, tuple[list[float], list[float], list[float], list[float]]] = {}

    def add(key: str, seconds: float, loop: float, cpu: float, predicted: float) -> None:
        model, loops, cpus, preds = groups.setdefault(key, ([], [], [], []))
        model.append(seconds)
        loops.append(loop)
        cpus.append(cpu)
        preds.append(predicted)

    for role, threads, shape, seconds, loop, cpu in instance_steps(threads_by_role, runs):
        predicted = profile.steps.for_threads(threads).predict(shape)
        kind = "prefill" if shape.prefill_tokens else "decode"
        for key in ("all", f"role:{role}", f"kind:{kind}", f"threads:{threads}:kind:{kind}"):
            add(key, seconds, loop, cpu, predicted)
    if "all" not in groups:
        return None
    out = {}
    for key, (model, loops, cpus, preds) in groups.items():
        entry = {"model": _summary(model, preds), "loop": _summary(loops, preds), "cpu": _summary(cpus, preds)}
        timed = [(c, m) for c, m in zip(cpus, model) if c > 0 and m > 0]
        # the share of the steps' wall time their engine thread was on a core (None: no CPU times)
        entry["on_cpu_share"] = (sum(c for c, _ in timed) / sum(m for _, m in timed)
                                 if len(timed) >= MIN_STEPS else None)
        if entry["model"] is not None:
            out[key] = entry
    return out or None


def run_speed(profile: Profile, instance_threads: list[int], threads_by_role: dict[str, int],
              run: dict) -> float | None:
    """One run's steps against the step models the simulator gives this arrangement (its instances'
    thread counts: the lone model for one instance, the contended ones for several where profiled):
    the time-weighted ratio of measured to modelled seconds, or None under MIN_STEPS steps. How fast
    the box stepped during that run, as its own engines saw it: on a VM whose speed moves minute to
    minute (session 34: 0.86-1.54x the profile within an hour) a run's miss reads as that minute's
    step time when the simulation at this speed lands where the run did, and as scheduling when
    it does not."""
    models, _ = profile.instance_models(instance_threads)
    by_threads = dict(zip(instance_threads, models))
    measured = predicted = 0.0
    count = 0
    for _role, threads, shape, seconds, _loop, _cpu in instance_steps(threads_by_role, [run]):
        p = by_threads[threads].predict(shape)
        if seconds > 0 and p > 0:
            measured, predicted, count = measured + seconds, predicted + p, count + 1
    return measured / predicted if count >= MIN_STEPS else None


def trial_samples(threads_by_role: dict[str, int], runs: list[dict]) -> dict[int, list[OnlineSample]]:
    """Every run's measured steps by thread count: the engine loop's turn where it was measured (what
    the instance's time went to), the model's own seconds otherwise."""
    out: dict[int, list[OnlineSample]] = {}
    for _, threads, shape, seconds, loop, _cpu in instance_steps(threads_by_role, runs):
        out.setdefault(threads, []).append(OnlineSample(shape, loop if loop > 0 else seconds))
    return out


def refit(profile: Profile, samples: dict[int, list[OnlineSample]]) -> dict[int, OnlineStepModel]:
    """Per thread count with enough steps, the step model refitted on the trial's steps with the
    profile's model as the prior (online_stepmodel.py, the mix controller's own fit): where the
    trial's steps speak (chat-sized prompts, its decode batches) they decide; elsewhere (prompts far
    longer than it ran) the profile's shape holds."""
    out = {}
    for threads, measured in sorted(samples.items()):
        online = OnlineStepModel(profile.steps.for_threads(threads))
        online.refit(measured)
        if online.ready:
            out[threads] = online
    return out


def with_models(profile: Profile, models: dict[int, StepModel]) -> Profile:
    """The profile with these thread counts' step models replaced, and no separate neighbour factor,
    contended steps or host work: steps measured in a trial already ran beside their neighbours and
    the serving stack."""
    by_threads = {**profile.steps.by_threads, **models}
    return dataclasses.replace(profile, steps=StepModels(by_threads, profile.steps.serial_fraction),
                               host_contention=1.0, contended={}, host_work=None, served={})


def calibration(profile: Profile, arrangements: list[tuple[dict[str, int], list[dict]]]) -> dict:
    """`trial_calibration.threads` for a profile: per thread count, the step model refitted on every
    given arrangement's steps together ((threads by role, runs) pairs) with `profile` (uncalibrated)
    as the prior, with how many steps it saw and how well it fits them."""
    pooled: dict[int, list[OnlineSample]] = {}
    for threads_by_role, runs in arrangements:
        for threads, samples in trial_samples(threads_by_role, runs).items():
            pooled.setdefault(threads, []).extend(samples)
    return {str(threads): {"step_model": online.model.to_dict(), "num_steps": online.num_samples,
                           "num_prompt_steps": sum(1 for x in pooled[threads] if x.shape.prefill_tokens),
                           "median_abs_rel_error": online.median_error}
            for threads, online in refit(profile, pooled).items()}
