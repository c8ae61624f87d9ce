"""`splitserve trial SPEC --dry-run`: the plan, in seconds, without starting a server.

Prompt lengths, classes and arrival times are exact (the same seeded streams as a real run);
only the prompt text is not tokenized by the model's tokenizer, and no text is printed.
"""
from __future__ import annotations

import dataclasses
import html
from dataclasses import replace

import numpy as np

from splitserve.trial.arrivals import burstiness_stats, generate_arrivals
from splitserve.trial.class_report import patience_text, slo_text
from splitserve.trial.method import CapacitySpec, grid_arrangements, search_settings
from splitserve.trial.resources import check_equal, core_set, with_kv_split, arrangement_resources
from splitserve.trial.results import arrangement_kind
from splitserve.trial.runner import check_named, rotation
from splitserve.trial.spec import TrialSpec
from splitserve.trial.workload import PromptSource, plan_requests, workload_streams


def _word_ids(text: str) -> list[int]:
    return [len(w) for w in text.split()]  # lengths are all the plan needs


def describe_plan(spec: TrialSpec, repeat: int = 1, capacity: bool = False, sweep: bool = False) -> str:
    check_named(spec)
    check_equal(spec)
    cpus = core_set(spec.cores)
    arrival_rng, content_rng = workload_streams(spec.seed)
    arrivals = generate_arrivals(spec.arrivals, arrival_rng)
    if not arrivals:
        raise ValueError("the arrivals section produced no requests; lengthen duration_s or raise rate")
    plan = plan_requests(spec, arrivals, PromptSource(_word_ids), content_rng)
    b = burstiness_stats(np.asarray([p.send_at_s for p in plan]))
    lines = [f"trial {spec.name} (seed {spec.seed}): {len(plan)} requests over {b['span_s']:.1f} s "
             f"(mean {b['mean_rate']:.3f} req/s, inter-arrival CV {b['interarrival_cv']:.2f}, "
             f"peak/mean over {b['window_s']:g} s windows {b['peak_to_mean_rate']:.1f})"]
    for name in sorted({p.class_name for p in plan}):
        reqs = [p for p in plan if p.class_name == name]
        prompts = np.asarray([p.num_prompt_tokens for p in reqs])
        answers = np.asarray([p.max_tokens for p in reqs])
        lines.append(f"  class {name}: {len(reqs)} requests, prompt tokens p50 {np.median(prompts):.0f} "
                     f"(min {prompts.min()}, max {prompts.max()}), answer tokens p50 {np.median(answers):.0f} "
                     f"(max {answers.max()}); first at {reqs[0].send_at_s:.1f} s")
    slo = spec.slo
    lines.append(f"SLOs: TTFT <= {slo.ttft_s} s, p{slo.gap_percentile:g} gap <= {slo.gap_s} s, longest pause <= "
                 f"{slo.max_pause_s} s, end-to-end <= {slo.e2e_s} s; a rate is held when >= {slo.attainment:.0%} "
                 f"of requests meet all of them")
    for name, cls in spec.classes.items():
        if cls.slo_overrides is not None or cls.patience or cls.priority is not None:
            own = {"slo": dataclasses.asdict(spec.class_slos[name]),
                   "patience": dataclasses.asdict(cls.patience) if cls.patience else None, "priority": cls.priority}
            lines.append(f"  class {name}: {html.unescape(slo_text(own['slo']))}{html.unescape(patience_text(own))}")
    rel = spec.arrivals.relative_rate
    if rel:
        laid_out = ("the phases' own rates" if spec.arrivals.pattern == "phases" else f"{rel.nominal:g} req/s")
        when = ("measured side by side with the others" if (capacity or spec.capacity is not None)
                and (spec.capacity or CapacitySpec()).method == "fitted" else "measured first")
        lines.append(f"rate: {rel.fraction_of_capacity:g} x the capacity of {rel.reference}, {when} "
                     f"(arrivals laid out at {laid_out}, then scaled together)")
        if spec.capacity is None and (rel.probe_requests or rel.probe_seconds):
            cal = search_settings(spec)
            lines.append(f"  calibration probes: {_probed_requests(spec, cal)}")
    else:
        lines.append("rate: as written in the spec (x1)")
    lines.append(f"arrangements, pinned to cores {cpus}; KV cache {spec.kv_cache_memory} per arrangement, "
                 f"split between its instances:")
    arrangements = list(spec.arrangements)
    if rel:
        arrangements.sort(key=lambda a: a.name != rel.reference)
    for arr in arrangements:
        res = arrangement_resources(with_kv_split(arr, spec.kv_cache_memory))
        launch = (" ".join(arr.serve_args) if arr.serve_args is not None else
                  " ".join(arr.command) if arr.command else arr.url)
        if arr.network is not None:
            launch += f"\n      across hosts of a network bed: {arr.network.describe()}"
        lines.append(f"  {arr.name} [{arrangement_kind(arr)}]: {res.describe()}\n      {launch}")
    if spec.tune:
        base = next(a for a in spec.arrangements if a.name == spec.tune.base)
        points = grid_arrangements(spec.tune, base, spec.cores)
        fitted = (capacity or spec.capacity is not None) and (spec.capacity or CapacitySpec()).method == "fitted"
        how = ("searched side by side with the others for 2 rounds (the weaker half stops after the first); the "
               "best continues as colocated-best, its probes kept, unless it is the base" if fitted else
               "one probe each at the lowest rate the reference fails (the base's own setting reuses its probe); "
               "the best joins as colocated-best unless it is the base")
        lines.append(f"tune: {len(points)} colocated settings, {how}: {', '.join(p.name for p in points)}")
        arrangements.insert(1, replace(base, name="colocated-best"))
    search = capacity or spec.capacity is not None
    if search:
        cap = spec.capacity or CapacitySpec()
        probes = f"probes of {_probed_requests(spec, cap)}"
        if cap.method == "fitted":
            lines.append(f"capacity (fitted, side by side): every server launched at once per repeat; rounds of "
                         f"{probes}, one per arrangement in rotating order on identical requests; one curve fitted "
                         f"to every probed request per arrangement, probed until its 90% interval is narrower than "
                         f"{cap.precision:.0%}, at most {cap.max_probes} probes"
                         + (f"; {cap.budget_s:.0f} s of replay per repeat, 80% the searches, 20% the fixed-rate "
                            f"runs" if cap.budget_s else ""))
    if search and cap.method != "fitted":
        lines.append(f"capacity search per arrangement and repeat: {probes}"
                     + f", grow x{cap.grow:g} then bisect to {cap.precision:.0%}, at most {cap.max_probes} probes"
                     + (f"; {cap.budget_s:.0f} s of replay per repeat shared by every launch, the fixed-rate "
                        f"run cut to what fits at the calibrated rate" if cap.budget_s else ""))
    names = [a.name for a in arrangements]
    for r in range(repeat):
        lines.append(f"repeat {r + 1}: {' -> '.join(rotation(names, r))}")
    replays = len(names) * repeat * (1 + (len(spec.sweep.rate_multipliers) if sweep and spec.sweep else 0))
    budgeted = spec.capacity is not None and spec.capacity.budget_s is not None
    cut = " (or fewer requests: the budget's share at the calibrated rate)" if budgeted else ""
    lines.append(f"fixed-rate replays: {replays}, each up to {len(plan)} requests{cut}, over {b['span_s']:.0f} s at "
                 f"the nominal rate, scaled with the rate, plus the time the last answers take")
    return "\n".join(lines)


def _probed_requests(spec, cap: CapacitySpec) -> str:
    """What one probe replays, as runner.Trial._probe picks it: a phased plan whole (or the phase
    `capacity.phase` names), else the plan's first requests, more when a span is asked for."""
    span = (f", spanning at least {cap.probe_seconds:g} s at the probed rate (the plan repeated if need be)"
            if cap.probe_seconds else "")
    if spec.arrivals.pattern == "phases":
        which = f"phase {cap.phase} of the plan" if cap.phase else "the whole plan, every phase"
        return f"{which} (at least {cap.probe_requests} requests{span})"
    return f"the plan's first {cap.probe_requests} requests" + (f" or more{span}" if span else "")
