"""The trial spec: a YAML file read once into small validated dataclasses.

Every mistake a user can make (an unknown key, an impossible SLO, a missing trace file)
raises `SpecError` naming the field by its dotted path, before any server starts.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

import yaml

from splitserve.trial.classes import (SLO, Patience, arrangement_cost, check_slo, class_slo, read_patience,
                                     read_priority, read_slo_overrides)
from splitserve.trial.method import (CapacitySpec, RelativeRate, TuneSpec, read_capacity, read_relative_rate,
                                    read_tune)
from splitserve.trial.network import Network, read_network
from splitserve.trial.section import Section, SpecError, read_length_dist, LengthDist

ARRIVAL_PATTERNS = ("constant", "poisson", "gamma", "on_off", "phases", "trace")
PHASE_PATTERNS = ("constant", "poisson", "gamma")
TRACE_FORMATS = ("auto", "azure", "burstgpt", "mooncake")
TOKENIZER_SOURCES = ("server", "local")

__all__ = ["SpecError", "TrialSpec", "load_spec", "parse_spec"]


@dataclass(slots=True)
class RequestClass:
    name: str
    prompt_tokens: LengthDist
    answer_tokens: LengthDist
    question: str | None = None  # appended to the document; its tokens count in prompt_tokens
    slo: SLO | None = None       # its own deadlines (global ones where it says nothing); set once read
    slo_overrides: dict | None = None
    patience: Patience | None = None
    priority: int | None = None  # sent in the request body


@dataclass(slots=True)
class Phase:
    duration_s: float
    rate: float
    pattern: str = "poisson"
    burstiness: float = 1.0
    mix: dict[str, float] | None = None   # this phase's class weights; None: workload.mix


@dataclass(slots=True)
class ArrivalSpec:
    pattern: str
    rate: float = 1.0                      # requests/s (constant, poisson, gamma, on_off quiet stream)
    num_requests: int | None = None
    duration_s: float | None = None
    burstiness: float = 1.0                # gamma: coefficient of variation of inter-arrival times
    quiet_class: str | None = None         # on_off: the steady stream
    burst_class: str | None = None         # on_off: the periodic burst
    burst_every_s: float = 30.0
    burst_size: int = 4
    burst_spread_s: float = 1.0
    phases: list[Phase] = field(default_factory=list)
    trace_path: pathlib.Path | None = None
    trace_format: str = "auto"
    time_scale: float = 1.0                # trace: 2.0 replays twice as fast
    sample: float = 1.0                    # trace: keep this fraction of rows
    start_s: float = 0.0                   # trace: skip rows before this offset
    long_input_tokens: int = 1000          # trace: a prompt this long or longer is class "long"
    max_prompt_tokens: int | None = None   # trace: clip prompts (small models, short contexts)
    max_answer_tokens: int | None = None
    relative_rate: RelativeRate | None = None  # rate: {fraction_of_capacity, reference, nominal}


@dataclass(slots=True)
class Arrangement:
    name: str
    serve_args: list[str] | None = None    # `splitserve serve` arguments, launched by the tool
    command: list[str] | None = None       # any server command; "{port}" is substituted
    url: str | None = None                 # an external endpoint, not launched
    cores: int | None = None               # total threads the arrangement uses
    grid_point: bool = False               # made by `tune:`, not written in the spec
    cost_per_hour: float | None = None     # else cores x the spec's price_per_core_hour
    network: Network | None = None         # engines on hosts of a bed, over a shaped link (network.py)


@dataclass(slots=True)
class FaultSpec:
    """`at_s` seconds into the replay, either kill one engine process (SIGKILL) of the running
    arrangement, optionally starting a replacement `restart_after_s` later through POST
    /admin/instances; or (`restart: all`) replace every instance in turn, a rolling update
    through POST /admin/instances/{id}/restart, each drain given `drain_deadline_s`; or (`restart:
    coordinator`) restart `serve` itself in place (POST /admin/coordinator/restart), its engines kept."""

    at_s: float
    kill: str | None = None                # prefill | decode | any (colocated instances do both)
    restart_after_s: float | None = None
    restart: str | None = None             # all: a rolling restart of every serving instance; coordinator
    drain_deadline_s: float = 60.0


@dataclass(slots=True)
class SweepSpec:
    rate_multipliers: list[float]
    target_attainment: float = 0.9


@dataclass(slots=True)
class TrialSpec:
    name: str
    seed: int
    classes: dict[str, RequestClass]
    mix: dict[str, float]
    arrivals: ArrivalSpec
    slo: SLO
    arrangements: list[Arrangement]
    model: str | None = None
    pause_threshold_s: float = 0.5
    warmup_requests: int = 2
    request_timeout_s: float = 300.0
    tokenizer: str = "server"
    sweep: SweepSpec | None = None
    faults: list[FaultSpec] = field(default_factory=list)
    source: pathlib.Path | None = None
    capacity: CapacitySpec | None = None
    tune: TuneSpec | None = None
    kv_cache_memory: str = "1GiB"          # total KV pool per arrangement, split between its instances
    allow_unequal_cores: bool = False
    price_per_core_hour: float | None = None

    @property
    def class_slos(self) -> dict[str, SLO]:
        return {name: cls.slo or self.slo for name, cls in self.classes.items()}

    def cost_per_hour(self, arr: Arrangement) -> float | None:
        from splitserve.trial.resources import arrangement_resources

        return arrangement_cost(arr.cost_per_hour, arrangement_resources(arr).cores or arr.cores,
                                self.price_per_core_hour)

    @property
    def cores(self) -> int | None:
        """The cores every arrangement uses (instances x threads, or `cores`; checked equal when read)."""
        from splitserve.trial.resources import arrangement_resources  # it reads Arrangement from here

        return next((c for c in (arrangement_resources(a).cores for a in self.arrangements) if c), None)

def load_spec(path: str | pathlib.Path) -> TrialSpec:
    path = pathlib.Path(path)
    if not path.is_file():
        raise SpecError(f"spec file {str(path)!r} not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"spec file {path}: not valid YAML: {exc}") from None
    return parse_spec(raw, base_dir=path.parent, source=path)


def parse_spec(raw: object, base_dir: pathlib.Path = pathlib.Path("."),
               source: pathlib.Path | None = None) -> TrialSpec:
    top = Section(raw, "")
    name = top.str("name", default=source.stem if source else "trial")
    seed = top.int("seed", default=0, minimum=0)
    classes, mix = _read_workload(top.section("workload"))
    arrivals = _read_arrivals(top.section("arrivals"), classes, base_dir)
    slo = _read_slo(top.section("slo"))
    allow_unequal = top.bool("allow_unequal_cores", default=False)
    arrangements = _read_arrangements(top.list("arrangements"))
    spec = TrialSpec(
        name=name, seed=seed, classes=classes, mix=mix, arrivals=arrivals, slo=slo,
        arrangements=arrangements,
        model=top.str("model", default=None),
        pause_threshold_s=top.float("pause_threshold_s", default=0.5, positive=True),
        warmup_requests=top.int("warmup_requests", default=2, minimum=0),
        request_timeout_s=top.float("request_timeout_s", default=300.0, positive=True),
        tokenizer=top.choice("tokenizer", TOKENIZER_SOURCES, default="server"),
        sweep=_read_sweep(top.section("sweep", required=False)),
        faults=_read_faults(top.list("faults")),
        source=source,
        capacity=read_capacity(top.section("capacity", required=False)),
        tune=read_tune(top.section("tune", required=False)),
        kv_cache_memory=top.str("kv_cache_memory", default="1GiB"),
        allow_unequal_cores=allow_unequal,
        price_per_core_hour=top.float("price_per_core_hour", default=None, positive=True))
    max_context = top.int("max_context_tokens", default=None, minimum=1)
    top.finish()
    _check_method(spec)
    for cls in spec.classes.values():
        cls.slo = class_slo(slo, cls.slo_overrides, f"workload.classes.{cls.name}.slo.")
    for i, arr in enumerate(spec.arrangements):
        if spec.faults and arr.url is not None:
            raise SpecError(f"faults: arrangements[{i}] ({arr.name}) is an external URL; the trial can only "
                            "kill engines of servers it launches itself (serve or command)")
    last_arrival = spec.arrivals.duration_s
    for i, fault in enumerate(spec.faults):
        if last_arrival is not None and fault.at_s >= last_arrival:
            raise SpecError(f"faults[{i}].at_s: {fault.at_s} s is not before the arrivals end "
                            f"({last_arrival} s); the fault would hit an idle server")
    if max_context is not None:
        for cls in spec.classes.values():
            longest = cls.prompt_tokens.max_value() + cls.answer_tokens.max_value()
            if longest > max_context:
                raise SpecError(
                    f"workload.classes.{cls.name}: prompt_tokens max + answer_tokens max = {longest} "
                    f"exceeds max_context_tokens ({max_context}); shorten the class or raise the limit")
    return spec


def _read_workload(sec: Section) -> tuple[dict[str, RequestClass], dict[str, float]]:
    classes_sec = sec.section("classes")
    classes = {}
    for name in classes_sec.keys():
        c = classes_sec.section(name)
        classes[name] = RequestClass(
            name=name,
            prompt_tokens=read_length_dist(c, "prompt_tokens"),
            answer_tokens=read_length_dist(c, "answer_tokens"),
            question=c.str("question", default=None),
            slo_overrides=(read_slo_overrides(c.section("slo")) if c.raw.get("slo") is not None else None),
            patience=read_patience(c.section("patience", required=False)),
            priority=read_priority(c))
        c.finish()
    if not classes:
        raise SpecError("workload.classes: define at least one request class (e.g. chat, document)")
    mix = _read_mix(sec.section("mix"), classes) if sec.raw.get("mix") else {}
    sec.finish()
    return classes, mix or {name: 1.0 for name in classes}


def _read_phase_mix(p: Section, classes: dict) -> dict[str, float] | None:
    return _read_mix(p.section("mix"), classes) if "mix" in p.raw else None


def _read_mix(sec: Section, classes: dict) -> dict[str, float]:
    """Class weights: every name a defined class, at least one weight positive."""
    mix = {}
    for name in sec.keys():
        if name not in classes:
            raise SpecError(f"{sec.path}{name}: no such class; classes are {sorted(classes)}")
        mix[name] = sec.float(name, minimum=0.0)
    sec.finish()
    if sum(mix.values()) <= 0:
        raise SpecError(f"{sec.path.rstrip('.')}: the weights sum to zero; give at least one class a positive weight")
    return mix


def _read_arrivals(sec: Section, classes: dict, base_dir: pathlib.Path) -> ArrivalSpec:
    pattern = sec.choice("pattern", ARRIVAL_PATTERNS)
    spec = ArrivalSpec(pattern=pattern)
    if pattern in ("constant", "poisson", "gamma", "on_off"):
        if isinstance(sec.raw.get("rate"), dict):
            spec.relative_rate = read_relative_rate(sec.section("rate"))
            spec.rate = spec.relative_rate.nominal
        else:
            spec.rate = sec.float("rate", positive=True)
    if pattern in ("constant", "poisson", "gamma"):
        spec.num_requests = sec.int("num_requests", default=None, minimum=1)
        spec.duration_s = sec.float("duration_s", default=None, positive=True)
        if (spec.num_requests is None) == (spec.duration_s is None):
            raise SpecError(f"arrivals: give exactly one of num_requests or duration_s for pattern {pattern!r}")
    if pattern == "gamma":
        spec.burstiness = sec.float("burstiness", positive=True)
    if pattern == "on_off":
        spec.duration_s = sec.float("duration_s", positive=True)
        spec.quiet_class = sec.choice("quiet_class", tuple(classes))
        spec.burst_class = sec.choice("burst_class", tuple(classes))
        spec.burst_every_s = sec.float("burst_every_s", default=30.0, positive=True)
        spec.burst_size = sec.int("burst_size", default=4, minimum=1)
        spec.burst_spread_s = sec.float("burst_spread_s", default=1.0, minimum=0.0)
        if spec.burst_spread_s >= spec.burst_every_s:
            raise SpecError("arrivals.burst_spread_s: must be shorter than burst_every_s, "
                            "or bursts overlap into one stream")
    if pattern == "phases":
        if isinstance(sec.raw.get("rate"), dict):
            # the phases' rates are the nominal shape; the whole plan is compressed or stretched to
            # this share of the reference's capacity, so their ratios (the changing demand) hold
            if "nominal" in sec.raw["rate"]:
                raise SpecError(f"{sec.path}rate.nominal: with phases, the phases' own rates are the nominal "
                                "load; leave nominal out")
            spec.relative_rate = read_relative_rate(sec.section("rate"))
        for i, raw in enumerate(sec.list("phases")):
            p = Section(raw, f"{sec.path}phases[{i}]")
            phase = Phase(duration_s=p.float("duration_s", positive=True), rate=p.float("rate", positive=True),
                          pattern=p.choice("pattern", PHASE_PATTERNS, default="poisson"),
                          burstiness=p.float("burstiness", default=1.0, positive=True),
                          mix=_read_phase_mix(p, classes))
            p.finish()
            spec.phases.append(phase)
        if not spec.phases:
            raise SpecError("arrivals.phases: list at least one phase")
    if pattern == "trace":
        raw_path = sec.str("path")
        path = pathlib.Path(raw_path)
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise SpecError(f"arrivals.path: trace file {str(path)!r} not found")
        spec.trace_path = path
        spec.trace_format = sec.choice("format", TRACE_FORMATS, default="auto")
        spec.time_scale = sec.float("time_scale", default=1.0, positive=True)
        spec.sample = sec.float("sample", default=1.0, positive=True)
        if spec.sample > 1.0:
            raise SpecError(f"arrivals.sample: a fraction of rows in (0, 1], got {spec.sample}")
        spec.start_s = sec.float("start_s", default=0.0, minimum=0.0)
        spec.duration_s = sec.float("duration_s", default=None, positive=True)
        spec.num_requests = sec.int("num_requests", default=None, minimum=1)
        spec.long_input_tokens = sec.int("long_input_tokens", default=1000, minimum=1)
        spec.max_prompt_tokens = sec.int("max_prompt_tokens", default=None, minimum=1)
        spec.max_answer_tokens = sec.int("max_answer_tokens", default=None, minimum=1)
    sec.finish()
    return spec


def _read_slo(sec: Section) -> SLO:
    slo = SLO(ttft_s=sec.float("ttft_s", positive=True), gap_s=sec.float("gap_s", positive=True),
              e2e_s=sec.float("e2e_s", positive=True), max_pause_s=sec.float("max_pause_s", positive=True),
              gap_percentile=sec.float("gap_percentile", default=99.0, positive=True),
              attainment=sec.float("attainment", default=0.9, positive=True))
    sec.finish()
    return check_slo(slo, "slo.")


DEFAULT_ARRANGEMENTS = [
    {"name": "colocated-whole", "serve": ["--instances", "1", "--threads-per-instance", "2",
                                          "--prefill-policy", "whole"], "cores": 2},
    {"name": "colocated-chunked", "serve": ["--instances", "1", "--threads-per-instance", "2",
                                            "--prefill-policy", "chunked"], "cores": 2},
    {"name": "colocated-chunked-x2", "serve": ["--instances", "2", "--threads-per-instance", "1",
                                               "--prefill-policy", "chunked"], "cores": 2},
    {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1",
                               "--kv-transport", "shm"], "cores": 2},
]


def _read_arrangements(raw_list: list) -> list[Arrangement]:
    raw_list = raw_list or DEFAULT_ARRANGEMENTS
    out = []
    for i, raw in enumerate(raw_list):
        sec = Section(raw, f"arrangements[{i}]")
        arr = Arrangement(name=sec.str("name"), serve_args=sec.str_list("serve", default=None),
                          command=sec.str_list("command", default=None), url=sec.str("url", default=None),
                          cores=sec.int("cores", default=None, minimum=1),
                          cost_per_hour=sec.float("cost_per_hour", default=None, positive=True))
        arr.network = read_network(sec, arr.name, arr.serve_args)
        sec.finish()
        given = [key for key, value in (("serve", arr.serve_args), ("command", arr.command), ("url", arr.url))
                 if value is not None]
        if len(given) != 1:
            raise SpecError(f"arrangements[{i}] ({arr.name}): give exactly one of serve, command or url, "
                            f"got {given or 'none'}")
        if arr.url is not None and not arr.url.startswith(("http://", "https://")):
            raise SpecError(f"arrangements[{i}].url: must start with http:// or https://, got {arr.url!r}")
        if arr.serve_args is not None and "--port" in arr.serve_args:
            raise SpecError(f"arrangements[{i}].serve: leave --port out; the trial picks a free port")
        if arr.command is not None and not any("{port}" in part for part in arr.command):
            raise SpecError(f"arrangements[{i}].command: include a '{{port}}' placeholder for the port")
        out.append(arr)
    names = [a.name for a in out]
    if len(set(names)) != len(names):
        raise SpecError(f"arrangements: names must be unique, got {names}")
    return out  # equal cores and KV memory: resources.check_equal, once the spec is whole


FAULT_TARGETS = ("prefill", "decode", "any")
RESTART_TARGETS = ("all", "coordinator")  # a rolling restart of every instance; serve itself, engines kept


def _read_faults(raw_list: list) -> list[FaultSpec]:
    faults = []
    for i, raw in enumerate(raw_list or []):
        sec = Section(raw, f"faults[{i}]")
        if isinstance(raw, dict) and "restart" in raw:
            if "kill" in raw or "restart_after_s" in raw:
                raise SpecError(f"faults[{i}]: a fault either kills (kill, restart_after_s) or restarts "
                                "(restart, drain_deadline_s), not both; make them two faults")
            fault = FaultSpec(at_s=sec.float("at_s", positive=True), restart=sec.choice("restart", RESTART_TARGETS),
                              drain_deadline_s=sec.float("drain_deadline_s", default=60.0, positive=True))
            if fault.restart == "coordinator" and "drain_deadline_s" in raw:
                raise SpecError(f"faults[{i}].drain_deadline_s: a coordinator restart drains nothing (what is in "
                                "flight ends at once); drain_deadline_s is for restart: all")
        else:
            fault = FaultSpec(at_s=sec.float("at_s", positive=True), kill=sec.choice("kill", FAULT_TARGETS),
                              restart_after_s=sec.float("restart_after_s", default=None, minimum=0.0))
        faults.append(fault)
        sec.finish()
    times = [f.at_s for f in faults]
    if times != sorted(times):
        raise SpecError(f"faults: list them in time order (at_s ascending), got {times}")
    return faults


def _read_sweep(sec: Section) -> SweepSpec | None:
    if sec.empty:
        sec.finish()
        return None
    multipliers = [float(x) for x in sec.list("rate_multipliers")] or [0.5, 1.0, 1.5, 2.0, 3.0]
    if any(m <= 0 for m in multipliers):
        raise SpecError(f"sweep.rate_multipliers: all must be positive, got {multipliers}")
    target = sec.float("target_attainment", default=0.9, positive=True)  # kept for old specs
    if target > 1:
        raise SpecError(f"sweep.target_attainment: a fraction in (0, 1], got {target}")
    sec.finish()
    return SweepSpec(sorted(multipliers), target)


def _check_method(spec: TrialSpec) -> None:
    """Cross-section checks: the reference and the tuning base name arrangements."""
    from splitserve.config import parse_size

    names = [a.name for a in spec.arrangements]
    rel = spec.arrivals.relative_rate
    if rel is not None and rel.reference not in names:
        raise SpecError(f"arrivals.rate.reference: no arrangement named {rel.reference!r}; "
                        f"the spec has {names}")
    if spec.tune is not None and spec.tune.base not in names:
        raise SpecError(f"tune.base: no arrangement named {spec.tune.base!r}; the spec has {names}")
    try:
        parse_size(spec.kv_cache_memory)
    except ValueError as exc:
        raise SpecError(f"kv_cache_memory: {exc}") from None
    from splitserve.trial.resources import check_equal  # it reads Arrangement from here

    check_equal(spec)
