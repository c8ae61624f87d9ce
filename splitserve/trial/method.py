"""How a trial measures, beside what it replays: capacity search, load relative to the machine,
the colocated tuning grid. Read from the spec like the rest (errors name the field).

    capacity:                 # the headline: the highest rate each arrangement holds within the SLOs
      probe_requests: 24      # at least this many requests per probe (the plan's first N, compressed)
      probe_seconds: 30       # and at least this long a span of arrivals at the probed rate
      precision: 0.1          # stop bisecting when the passing and failing rates are within 10%
      max_probes: 8           # per arrangement and repeat
      budget_s: 480           # all searches together; the probes per search follow from it
      method: fitted          # fitted (sidebyside.py, curve.py) or bisect (capacity.py)
      phase: 2                # a phased plan: probe this phase (default: the whole plan, never its first requests)
    arrivals:
      rate: {fraction_of_capacity: 0.7, reference: colocated-chunked, nominal: 0.5,
             probe_seconds: 40}   # calibration probes (without a capacity: section): >= 40 s of arrivals
    tune:                     # colocated knobs to try; the best setting joins as `colocated-best`
      base: colocated-chunked
      max_num_batched_tokens: [64, 256]
      instances_x_threads: [1x2, 2x1]
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from splitserve.trial.section import Section, SpecError


@dataclass(slots=True)
class RelativeRate:
    """The fixed-rate run's load as a share of one arrangement's measured capacity. The arrivals
    are laid out at `nominal` requests/s, then compressed or stretched to that share."""

    fraction_of_capacity: float
    reference: str
    nominal: float = 1.0
    # how the calibration probes when the spec has no `capacity:` section (that section's settings
    # win when it has one): a probe of a few requests compressed into a burst is held at rates a
    # steady stream is not, so a spec can ask for longer probes
    probe_requests: int | None = None
    probe_seconds: float | None = None


@dataclass(slots=True)
class CapacitySpec:
    probe_requests: int = 24
    probe_seconds: float | None = None     # a probe's arrivals span at least this long (real time)
    precision: float = 0.1
    max_probes: int = 8
    grow: float = 2.0
    budget_s: float | None = None
    min_multiplier: float = 0.1            # the lowest rate searched, as a share of the nominal rate
    phase: int | None = None               # a phased plan's probes replay this phase (1-based), else all of it
    method: str = "fitted"                 # fitted: one curve from every request (sidebyside.py); bisect: capacity.py


@dataclass(slots=True)
class TuneSpec:
    base: str
    max_num_batched_tokens: list[int] = field(default_factory=list)
    instances_x_threads: list[tuple[int, int]] = field(default_factory=list)


def read_relative_rate(sec: Section) -> RelativeRate:
    rate = RelativeRate(fraction_of_capacity=sec.float("fraction_of_capacity", positive=True),
                        reference=sec.str("reference"),
                        nominal=sec.float("nominal", default=1.0, positive=True),
                        probe_requests=sec.int("probe_requests", default=None, minimum=4),
                        probe_seconds=sec.float("probe_seconds", default=None, positive=True))
    sec.finish()
    if rate.fraction_of_capacity > 1.5:
        raise SpecError(f"{sec.path}fraction_of_capacity: {rate.fraction_of_capacity} is far beyond what the "
                        "reference holds; give a share such as 0.7 (1.0 = at capacity)")
    return rate


def search_settings(spec) -> CapacitySpec:
    """How capacity probes run: the spec's `capacity:` section, else the calibration's own probe
    settings from `arrivals.rate` (a relative rate), else the defaults."""
    if spec.capacity is not None:
        return spec.capacity
    rel, default = spec.arrivals.relative_rate, CapacitySpec()
    if rel is None:
        return default
    return replace(default, probe_requests=rel.probe_requests or default.probe_requests,
                   probe_seconds=rel.probe_seconds)


def read_capacity(sec: Section) -> CapacitySpec | None:
    if sec.empty:
        sec.finish()
        return None
    cap = CapacitySpec(probe_requests=sec.int("probe_requests", default=24, minimum=4),
                       probe_seconds=sec.float("probe_seconds", default=None, positive=True),
                       precision=sec.float("precision", default=0.1, positive=True),
                       max_probes=sec.int("max_probes", default=8, minimum=2),
                       grow=sec.float("grow", default=2.0, positive=True),
                       budget_s=sec.float("budget_s", default=None, positive=True),
                       min_multiplier=sec.float("min_multiplier", default=0.1, positive=True),
                       method=sec.str("method", default="fitted"),
                       phase=sec.int("phase", default=None, minimum=1))
    sec.finish()
    if cap.method not in ("fitted", "bisect"):
        raise SpecError(f"capacity.method: fitted (a curve fitted to every probe's requests, the arrangements "
                        f"side by side) or bisect (grow-then-bisect, one arrangement after another), got {cap.method!r}")
    if cap.grow <= 1.0:
        raise SpecError(f"capacity.grow: the factor the rate grows by while probes pass, > 1, got {cap.grow}")
    return cap


_GRID_POINT = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")


def read_tune(sec: Section) -> TuneSpec | None:
    if sec.empty:
        sec.finish()
        return None
    tune = TuneSpec(base=sec.str("base"))
    for v in sec.list("max_num_batched_tokens"):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f"tune.max_num_batched_tokens: whole numbers >= 1, got {v!r}")
        tune.max_num_batched_tokens.append(v)
    for v in sec.list("instances_x_threads"):
        m = _GRID_POINT.match(str(v))
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise SpecError(f"tune.instances_x_threads: write each point as INSTANCESxTHREADS (e.g. 2x1), got {v!r}")
        tune.instances_x_threads.append((int(m.group(1)), int(m.group(2))))
    sec.finish()
    if not tune.max_num_batched_tokens and not tune.instances_x_threads:
        raise SpecError("tune: list max_num_batched_tokens and/or instances_x_threads to try")
    return tune


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def grid_arrangements(tune: TuneSpec, base, cores: int | None) -> list:
    """One colocated arrangement per grid point, from the base's serve arguments."""
    if base.serve_args is None or "--prefill" in base.serve_args or "--decode" in base.serve_args:
        raise SpecError(f"tune.base: {base.name!r} must be a colocated `serve` arrangement")
    budgets = tune.max_num_batched_tokens or [None]
    shapes = tune.instances_x_threads or [None]
    out = []
    for budget in budgets:
        for shape in shapes:
            args, label = list(base.serve_args), []
            if budget is not None:
                args = _set_flag(_set_flag(args, "--prefill-policy", "chunked"), "--max-num-batched-tokens",
                                 str(budget))
                label.append(f"{budget}tok")
            if shape is not None:
                if cores is not None and shape[0] * shape[1] != cores:
                    raise SpecError(f"tune.instances_x_threads: {shape[0]}x{shape[1]} uses {shape[0] * shape[1]} "
                                    f"cores, the arrangements {cores}; every point must use the same cores")
                args = _set_flag(_set_flag(args, "--instances", str(shape[0])), "--threads-per-instance",
                                 str(shape[1]))
                label.append(f"{shape[0]}x{shape[1]}")
            out.append(replace(base, name=f"{base.name}@{'-'.join(label)}", serve_args=args, grid_point=True))
    return out
