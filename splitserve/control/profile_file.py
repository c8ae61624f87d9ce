"""profile.json: what `splitserve profile` measured, or what someone wrote by hand for other hardware.

    {"format": "splitserve-profile/1",
     "model": {"name": "...", "kv_bytes_per_token": 46080, "block_size": 16, "max_model_len": 8192},
     "machine": {"cpu_model": "...", "num_cores": 2, ...},          # free-form, for the reader
     "threads": {"1": {"samples": [{"kind": "prefill", "prefill_tokens": 512, "prefill_attn_ktok2": 131.1,
                                    "decode_seqs": 0, "decode_kv_tokens": 0, "seconds": [0.9, 0.95]}, ...],
                       "step_model": {"overhead_s": ..., ...},      # fitted; or alone, by hand
                       "contended": {"samples": [...], "step_model": {...},   # optional: the same steps
                                     "neighbours": {"count": 1, ...}},        # beside busy engines
                       "drift": {"prompt_tokens": 128, "began_unix": 1.8e9,      # optional: one step timed
                                 "readings": [[0.4, 0.31], ...]},    # through the pass ([s since it began, seconds])
                       "served": {"instances": 2, "step_model": {...}, "samples": [...], ...}},  # optional
                 "2": {...}},
     "serial_fraction": 0.3,                                         # optional (Amdahl, for other thread counts)
     "kv_transfer": {"shm": {"latency_s": 0.002, "gb_per_s": 3.1}, "tcp": {...}},
     "startup_s": {"load_model": [...], "engine": [...]},            # optional
     "host_contention": {"factor": 1.15},                            # optional: bench/host_contention.py
     "fit_statistic": "fastest",                                     # optional: or "median" (of each step's repeats)
     "contended_fit_statistic": "median",                            # optional: the same for steps beside busy engines
     "host_work": {"idle_cores": 0.0, "per_request_s": 0.011, "per_token_s": 0.00076},  # optional: host_work.py
     "trial_calibration": {"source": "...", "threads": {"1": {"step_model": {...}, "num_steps": 900}}}}  # optional

Samples are the truth when present: the step model is refitted from them on load. A hand-written
profile gives `step_model` alone. `trial_calibration` (written by `python -m splitserve.control.compare
... --calibrate-out`) holds, per thread count, the step model refitted on a trial's own engine steps
with this profile as the prior; it replaces that thread count's model, and `host_contention` is then
not applied, since a trial's steps already ran beside their neighbours.

`contended` (since issue 28 part 3) holds a thread count's steps timed while other engine processes
ran steps on the rest of the cores (`splitserve profile` measures it when the box holds a second
instance of that many threads). An arrangement of several instances, each on its own cores of one
host, is simulated with these step times (Profile.instance_models); a profile without them (every
profile before it) falls back to its lone step times and `host_contention`, and says so
(contention_note).

`drift` (since session 35) is one lone prompt step timed before every item of a thread count's
lone pass: on a VM whose speed moves minute to minute a lone 128-token prompt step took 340-524 ms
within four minutes, idle (session 34, bench/speed_probe.py). `speed_band` reads every thread
count's readings against that count's step model (fitted on the fastest repeats) as factors, and
gives their 10th, 50th and 90th percentiles: the planner's capacity at both ends
(planner.speed_band_capacities) is what the same plan predicts at the slow and the fast minutes
the profile itself saw.

`served` (session 39, control/served_pass.py) holds the steps of `instances` instances of that
thread count (the arrangement that fills the profiled host's cores) that `serve` ran under streaming
chat traffic, refitted with the profiled model as the prior: the steps a trial's engines take, with
the frontend and a client on the same cores. An arrangement of exactly that many instances of that
thread count is simulated with them (Profile.serves), with no neighbour factor and no host work on
top; a trial calibration drops them.

`host_work` (issue 28 item 3, control/host_work.py) is the CPU the serving stack spends outside
the engines' steps: the frontend, the coordinator, the engines' loops between steps and the
trial's client, as a rate at idle plus CPU seconds per request and per streamed token. The
simulator takes those cores from the engines' (control/simulator.py). A trial calibration drops
it too: a trial's steps ran beside that work already. Every mistake raises ProfileError naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
from dataclasses import dataclass, field

from splitserve.control.stepmodel import COEFFICIENTS, StepModel, StepModels, StepShape, fit_step_model
from splitserve.stepfeatures import prefill_attn_ktok2

FORMAT = "splitserve-profile/1"
SAMPLE_FIELDS = ("prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens")


class ProfileError(ValueError):
    """A malformed profile; the message names the field and the fix."""


@dataclass(slots=True, frozen=True)
class TransferModel:
    latency_s: float
    gb_per_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / (self.gb_per_s * 1e9)


@dataclass(slots=True, frozen=True)
class HostWork:
    """CPU the serving stack takes from the host outside engine steps (control/host_work.py)."""

    idle_cores: float = 0.0     # cores busy with nothing in flight
    per_request_s: float = 0.0  # CPU seconds per request
    per_token_s: float = 0.0    # CPU seconds per streamed token

    def load(self, requests_per_s: float, tokens_per_s: float) -> float:
        """Cores this work keeps busy at these rates."""
        return self.idle_cores + requests_per_s * self.per_request_s + tokens_per_s * self.per_token_s


@dataclass(slots=True)
class Profile:
    model_name: str
    kv_bytes_per_token: int
    block_size: int
    steps: StepModels
    transfer: dict[str, TransferModel]
    machine: dict
    raw: dict
    host_contention: float = 1.0  # a step beside a busy instance on the same host takes this many times longer
    contended: dict[int, StepModel] = field(default_factory=dict)  # threads -> steps beside busy engines
    host_work: HostWork | None = None  # the stack's CPU outside engine steps, when profiled
    speed_band: dict | None = None  # the lone passes' watched step against the model (speed_band())
    # threads -> (instances, steps of that many instances served under chat traffic: served_pass.py)
    served: dict[int, tuple[int, StepModel]] = field(default_factory=dict)

    def serves(self, threads: list[int]) -> bool:
        """Whether the profile's served pass ran exactly this arrangement of instances: as many
        instances as it served, each of the thread count it served them with."""
        return (bool(threads) and len(set(threads)) == 1 and threads[0] in self.served
                and self.served[threads[0]][0] == len(threads))

    def instance_models(self, threads: list[int]) -> tuple[list[StepModel], float]:
        """Each instance's step model and the simulator's neighbour factor, for an arrangement of
        instances with these thread counts on one host. One instance: its lone steps. Several: the
        steps measured beside busy engines when the profile has them for every instance's thread
        count, with no factor on top (they ran beside neighbours already); otherwise the lone steps,
        slowed by host_contention whenever a neighbour is busy (1.0 where it was not measured).
        Before all of these: the served pass's steps, where it served this arrangement (serves()),
        with no factor either (the simulator then adds no host work: it ran beside them too)."""
        if self.serves(threads):
            return [self.served[threads[0]][1]] * len(threads), 1.0
        if len(threads) > 1 and all(t in self.contended for t in threads):
            return [self.contended[t] for t in threads], 1.0
        return [self.steps.for_threads(t) for t in threads], self.host_contention

    def contention_note(self, threads: list[int]) -> str:
        """What instance_models does for arrangements of several instances with these thread
        counts, in words (the plan prints it)."""
        if threads and self.serves(threads):
            return (f"{len(threads)} instance(s) of {threads[0]} thread(s) use the steps the profile's served pass "
                    f"timed under chat traffic (the serving stack and a client beside them)")
        if not threads:
            return "every arrangement is one instance, timed alone as profiled"
        have = sorted(t for t in set(threads) if t in self.contended)
        lack = sorted(t for t in set(threads) if t not in self.contended)
        factor = (f"x{self.host_contention:.2f} (the profile's host_contention) while a neighbour is busy"
                  if self.host_contention != 1.0 else "with no contention modelled (no host_contention either)")
        if not lack:
            return (f"arrangements of several instances use step times measured beside busy engines "
                    f"({', '.join(map(str, have))} thread(s))")
        if not have:
            return ("the profile has no step times measured beside busy engines (profiled before they were, or "
                    f"on too few cores): arrangements of several instances use the lone step times {factor}")
        return (f"step times beside busy engines exist for {', '.join(map(str, have))} thread(s) only: an "
                f"arrangement with a {', '.join(map(str, lack))}-thread instance uses the lone step times {factor}")

    @property
    def speed_units_per_s(self) -> float | None:
        """The host-speed benchmark the profile ran when it started (machine.speed_units_per_s; the
        trial records the same before each probe), or None in profiles made before it."""
        value = self.machine.get("speed_units_per_s")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None

    def slowed(self, factor: float) -> "Profile":
        """The profile as the same box would measure it running `factor` times slower: every step
        model (lone and contended) and the host work's CPU times `factor`; transfers as they are."""
        if not factor > 0:
            raise ValueError(f"a speed factor must be positive, got {factor}")
        host = self.host_work
        return dataclasses.replace(
            self, steps=StepModels({t: m.scaled(factor) for t, m in self.steps.by_threads.items()},
                                   self.steps.serial_fraction),
            contended={t: m.scaled(factor) for t, m in self.contended.items()},
            served={t: (n, m.scaled(factor)) for t, (n, m) in self.served.items()},
            host_work=None if host is None else HostWork(host.idle_cores * factor, host.per_request_s * factor,
                                                         host.per_token_s * factor))

    def transfer_s(self, transport: str, num_tokens: int) -> float:
        if transport not in self.transfer:
            raise ProfileError(f"kv_transfer.{transport}: the profile has no figures for this transport "
                               f"(it has {sorted(self.transfer) or 'none'}); profile it or add latency_s and gb_per_s")
        return self.transfer[transport].seconds(num_tokens * self.kv_bytes_per_token)


def _number(value, path: str, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{path}: expected a number, got {value!r}")
    if value < minimum or (strict and value <= minimum):
        raise ProfileError(f"{path}: must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)


def _mapping(value, path: str) -> dict:
    if not isinstance(value, dict):
        raise ProfileError(f"{path}: expected a mapping, got {value!r}")
    return value


def _step_model(raw, path: str) -> StepModel:
    raw = _mapping(raw, path)
    unknown = set(raw) - set(COEFFICIENTS)
    if unknown:
        raise ProfileError(f"{path}.{sorted(unknown)[0]}: unknown coefficient; known are {list(COEFFICIENTS)}")
    for name in ("overhead_s", "per_prefill_token_s"):
        if name not in raw:
            raise ProfileError(f"{path}.{name}: required field is missing")
    return StepModel(**{k: _number(v, f"{path}.{k}") for k, v in raw.items()})


FIT_STATISTICS = ("fastest", "median")  # which repeat of each profiled step a model is fitted on
# Steps timed beside busy engines vary with what the neighbour runs at that moment (a prompt chunk
# or a decode): that spread is the contention, not noise to shed, so their model is fitted on each
# step's median repeat (the fastest caught the neighbour between its chunks: session 31, a 256-token
# chunk 738 ms fastest against 778-1,033 ms typical).
CONTENDED_FIT_STATISTIC = "median"


def _thread_model(entry: dict, path: str, statistic: str = "fastest") -> StepModel:
    """One thread count's step model: refitted from its samples when present, else as written."""
    if "samples" in entry:
        return fit_step_model(*step_samples(entry["samples"], f"{path}.samples", statistic)).model
    if "step_model" in entry:
        return _step_model(entry["step_model"], f"{path}.step_model")
    raise ProfileError(f"{path}: give samples (measured) or step_model (coefficients)")


def step_samples(raw, path: str = "samples", statistic: str = "fastest") -> tuple[list[StepShape], list[float]]:
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"{path}: expected a non-empty list of step samples")
    shapes, seconds = [], []
    for i, s in enumerate(raw):
        p = f"{path}[{i}]"
        s = _mapping(s, p)
        times = s.get("seconds")
        if not isinstance(times, list) or not times:
            raise ProfileError(f"{p}.seconds: expected a non-empty list of measured step times")
        times = [_number(t, f"{p}.seconds", strict=True) for t in times]
        values = {k: _number(s.get(k, 0), f"{p}.{k}") for k in SAMPLE_FIELDS}
        shapes.append(StepShape(int(values["prefill_tokens"]), values["prefill_attn_ktok2"],
                                int(values["decode_seqs"]), int(values["decode_kv_tokens"])))
        # The fastest repeat by default: other processes' load only ever adds time, so on a shared
        # machine the minimum is the instance's own cost (the median still moved 3-5x when two
        # repeats of three were hit; all repeats stay in the file). A profile taken quiet may ask
        # for the median repeat (`fit_statistic: median`): a trial's steps are typical ones, and a
        # quiet prompt step's median runs 1.05-1.14x its fastest (docs/benchmarks.md, "Planner").
        seconds.append(min(times) if statistic == "fastest" else statistics.median(times))
    return shapes, seconds


def parse_profile(doc, source: str = "profile") -> Profile:
    doc = _mapping(doc, source)
    if doc.get("format") != FORMAT:
        raise ProfileError(f"{source}: format must be {FORMAT!r}, got {doc.get('format')!r}; "
                           "write it with `splitserve profile` or copy the layout from docs/benchmarks.md")
    model = _mapping(doc.get("model"), "model")
    kv_bytes = model.get("kv_bytes_per_token")
    if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes <= 0:
        raise ProfileError(f"model.kv_bytes_per_token: a positive whole number of bytes, got {kv_bytes!r}")
    block_size = model.get("block_size", 16)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ProfileError(f"model.block_size: a positive whole number, got {block_size!r}")
    threads = _mapping(doc.get("threads"), "threads")
    if not threads:
        raise ProfileError("threads: profile at least one thread count")
    statistic = doc.get("fit_statistic", "fastest")
    if statistic not in FIT_STATISTICS:
        raise ProfileError(f"fit_statistic: one of {list(FIT_STATISTICS)}, got {statistic!r}")
    contended_statistic = doc.get("contended_fit_statistic", CONTENDED_FIT_STATISTIC)
    if contended_statistic not in FIT_STATISTICS:
        raise ProfileError(f"contended_fit_statistic: one of {list(FIT_STATISTICS)}, got {contended_statistic!r}")
    models, contended, served = {}, {}, {}
    for key, entry in threads.items():
        path = f"threads.{key}"
        try:
            count = int(key)
        except ValueError:
            raise ProfileError(f"{path}: a thread count must be a whole number, got {key!r}") from None
        if count < 1:
            raise ProfileError(f"{path}: a thread count must be >= 1")
        entry = _mapping(entry, path)
        models[count] = _thread_model(entry, path, statistic)
        if entry.get("contended") is not None:
            contended[count] = _thread_model(_mapping(entry["contended"], f"{path}.contended"), f"{path}.contended",
                                             contended_statistic)
        if entry.get("served") is not None:
            raw = _mapping(entry["served"], f"{path}.served")
            instances = _number(raw.get("instances"), f"{path}.served.instances", minimum=1)
            if instances != int(instances):
                raise ProfileError(f"{path}.served.instances: a whole number, got {instances}")
            served[count] = (int(instances), _step_model(raw.get("step_model"), f"{path}.served.step_model"))
    serial = doc.get("serial_fraction")
    if serial is not None and not 0 <= _number(serial, "serial_fraction") <= 1:
        raise ProfileError(f"serial_fraction: a fraction in [0, 1], got {serial}")
    transfer = {}
    for name, entry in _mapping(doc.get("kv_transfer", {}), "kv_transfer").items():
        entry = _mapping(entry, f"kv_transfer.{name}")
        transfer[name] = TransferModel(_number(entry.get("latency_s"), f"kv_transfer.{name}.latency_s"),
                                       _number(entry.get("gb_per_s"), f"kv_transfer.{name}.gb_per_s", strict=True))
    contention = 1.0
    if doc.get("host_contention") is not None:
        entry = _mapping(doc["host_contention"], "host_contention")
        contention = _number(entry.get("factor"), "host_contention.factor", minimum=1.0)
    if doc.get("trial_calibration") is not None:
        calibrated = _mapping(_mapping(doc["trial_calibration"], "trial_calibration").get("threads"),
                              "trial_calibration.threads")
        for key, entry in calibrated.items():
            path = f"trial_calibration.threads.{key}"
            if not key.isdigit() or int(key) not in models:
                raise ProfileError(f"{path}: calibrates a thread count the profile has no model for "
                                   f"(it has {sorted(models)})")
            models[int(key)] = _step_model(_mapping(entry, path).get("step_model"), f"{path}.step_model")
        contention, contended, served = 1.0, {}, {}  # a trial's steps ran beside their neighbours already
    host_work = None
    if doc.get("host_work") is not None and doc.get("trial_calibration") is None:
        entry = _mapping(doc["host_work"], "host_work")
        host_work = HostWork(*(_number(entry.get(k, 0.0), f"host_work.{k}")
                               for k in ("idle_cores", "per_request_s", "per_token_s")))
    band = speed_band(threads, models)
    return Profile(model_name=str(model.get("name", "unknown")), kv_bytes_per_token=kv_bytes,
                   block_size=block_size, steps=StepModels(models, serial), transfer=transfer,
                   machine=doc.get("machine") or {}, raw=doc, host_contention=contention,
                   contended=contended, host_work=host_work, speed_band=band, served=served)


MIN_DRIFT_READINGS = 8  # fewer and a 10th percentile is one reading
# where a plan is predicted again on the band: the slow end (the watched step's 90th percentile),
# the median and the fast end (its 10th)
SPEED_BAND_ENDS = (("slow", "p90"), ("median", "p50"), ("fast", "p10"))


def speed_band(threads: dict, models: dict[int, StepModel]) -> dict | None:
    """Every thread count's `drift` readings against its own (lone, uncalibrated) step model's time
    for that step: {"p10", "p50", "p90"} of the factors, "readings" and the seconds from the first
    to the last (the passes placed by their `began_unix`; without it, each on its own clock); None
    without MIN_DRIFT_READINGS (profiles made before session 35 have none)."""
    factors, times = [], []
    for key, entry in threads.items():
        drift = entry.get("drift")
        if drift is None:
            continue
        path = f"threads.{key}.drift"
        drift = _mapping(drift, path)
        n = drift.get("prompt_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ProfileError(f"{path}.prompt_tokens: a positive whole number of tokens, got {n!r}")
        readings = drift.get("readings")
        if not isinstance(readings, list):
            raise ProfileError(f"{path}.readings: a list of [seconds since start, step seconds], got {readings!r}")
        began = _number(drift.get("began_unix", 0.0), f"{path}.began_unix")  # 0: one pass's own clock
        modelled = models[int(key)].step_s(n, prefill_attn_ktok2(0, n))
        for i, r in enumerate(readings):
            if not isinstance(r, list) or len(r) != 2:
                raise ProfileError(f"{path}.readings[{i}]: [seconds since start, step seconds], got {r!r}")
            at = _number(r[0], f"{path}.readings[{i}][0]")
            seconds = _number(r[1], f"{path}.readings[{i}][1]", strict=True)
            times.append(began + at)
            if modelled > 0:
                factors.append(seconds / modelled)
    if len(factors) < MIN_DRIFT_READINGS:
        return None
    q = statistics.quantiles(factors, n=10, method="inclusive")
    return {"p10": q[0], "p50": statistics.median(factors), "p90": q[-1], "readings": len(factors),
            "span_s": max(times) - min(times)}


def load_profile(path: str | pathlib.Path) -> Profile:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ProfileError(f"profile {str(path)!r} not found; measure one with `splitserve profile --out {path}`")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid JSON ({exc})") from None
    return parse_profile(doc, str(path))
