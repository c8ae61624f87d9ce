"""One trial: plan the workload once, then replay it against each arrangement, repeat after repeat.

The plan (arrival times, classes, prompt token ids, answer lengths) is fixed by the seed
before the first request is sent. Each (arrangement, repeat) is one launch of its server,
pinned to the same cores, with the same warm-up; on it the trial runs, in this order:
  1. the capacity search (capacity.py), when the spec has `capacity:` or the run is the
     calibration: the reference of a `rate: {fraction_of_capacity}` spec, first in repeat 0;
  2. the fixed-rate run: the whole plan at the spec's rate (or its share of the reference's
     capacity), the same rate for every arrangement;
  3. with --sweep, the plan compressed by each of the sweep's multipliers.
Repeats rotate the order (ABCD, BCDA, CDAB, ...) so no arrangement always runs first, on a
cold machine, or last, on a warm one. With `tune:`, the colocated grid is tried after the
first launch (tuning.py); the best setting joins the trial. With `capacity.budget_s` the
searches and the fixed-rate run's length follow the time budget (budget.py).
Within one launch every replay gets its own prompt text (the server's prefix cache must not
remember the last one): the fixed-rate run always replays the plan itself, the k-th probe and
the k-th sweep step the same other text in every launch, so arrangements see identical requests.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from splitserve.trial.arrangements import Endpoint, LaunchError, launched
from splitserve.trial.arrivals import Arrival, generate_arrivals
from splitserve.trial.budget import SEARCH_SHARE, Budget
from splitserve.trial.capacity import Probe, search_capacity
from splitserve.trial.client import counter_deltas, http_tokenizer, run_load, scrape_counters
from splitserve.trial.engine_steps import step_counts, steps_since
from splitserve.trial.faults import fault_outcomes, inject_fault
from splitserve.trial.idle import wait_idle
from splitserve.trial.method import search_settings
from splitserve.trial.metrics import RequestRecord, is_good, request_metrics, server_aborted_work, slo_of, summarize
from splitserve.trial.mix_timeline import add_attainment_after, fetch_role_timeline
from splitserve.trial.resources import (arrangement_resources, check_equal, core_set, read_affinity,
                                        with_kv_split)
from splitserve.trial.results import arrangement_kind
from splitserve.trial.sidebyside import run_repeat, watched_run
from splitserve.trial.tuning import tune_colocated
from splitserve.trial.spec import Arrangement, SpecError, TrialSpec
from splitserve.trial.workload import (PlannedRequest, PromptSource, content_stream, plan_requests, probe_length,
                                      recut, tiled, workload_streams)

STOP_MARGIN = 0.25  # a fitted probe stops once its share good cannot reach the target minus this

Progress = Callable[[str, int], Callable[[RequestRecord], None]]  # (label, total) -> per-request callback


@dataclass(slots=True)
class RunResult:
    rate_multiplier: float
    summary: dict
    records: list[RequestRecord]
    server_counters: dict
    repeat: int = 0
    purpose: str = "fixed"                 # fixed | sweep | probe | tune


@dataclass(slots=True)
class ArrangementResult:
    name: str
    runs: list[RunResult] = field(default_factory=list)
    error: str | None = None
    capacity: list[dict] = field(default_factory=list)   # one search per repeat
    launches: list[dict] = field(default_factory=list)   # per repeat: affinity read back, kv split

    @property
    def main_run(self) -> RunResult | None:
        """The first repeat's fixed-rate run, or the first run of any kind."""
        return next((r for r in self.runs if r.purpose == "fixed"), self.runs[0] if self.runs else None)


def local_tokenizer(model: str | None):
    from splitserve.models.loader import load_tokenizer  # imported late: it pulls in transformers

    tokenizer, _ = load_tokenizer(model)
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def rotation(names: list[str], repeat: int) -> list[str]:
    """Repeat r runs the arrangements starting from the r-th: ABCD, BCDA, CDAB, ..."""
    k = repeat % len(names) if names else 0
    return names[k:] + names[:k]


class Trial:
    def __init__(self, spec: TrialSpec, out_dir: pathlib.Path, progress: Progress | None = None,
                 on_update: Callable[["Trial"], None] | None = None):
        self.spec = spec
        check_named(spec)
        self.out_dir = pathlib.Path(out_dir)
        self.progress = progress
        self.on_update = on_update        # after every run: results.json is written as it goes
        check_equal(spec)
        self.resources = {a.name: arrangement_resources(with_kv_split(a, spec.kv_cache_memory))
                          for a in spec.arrangements}
        self.cpus = core_set(spec.cores)
        arrival_rng, self.content_rng = workload_streams(spec.seed)
        self.arrivals: list[Arrival] = generate_arrivals(spec.arrivals, arrival_rng)
        if not self.arrivals:
            raise ValueError("the arrivals section produced no requests; lengthen duration_s or raise rate")
        self.plan: list[PlannedRequest] | None = None
        self.source: PromptSource | None = None
        self._recuts: dict[int, list[PlannedRequest]] = {}
        rel = spec.arrivals.relative_rate
        self.main_multiplier: float | None = None if rel else 1.0
        self.calibration: dict | None = None
        self.tuning: dict | None = None
        # a grid point's probe, kept for the arrangement it joins as: its search starts at that rate
        self.tuning_probes: dict[str, RunResult] = {}
        self.order: list[list[str]] = []
        self.results: dict[str, ArrangementResult] = {}
        self.arrangements = list(spec.arrangements)
        if rel:  # the calibration comes first
            self.arrangements.sort(key=lambda a: a.name != rel.reference)
        self.budget = Budget(None, 1, 1.0)
        self.num_fixed: int | None = None   # requests per fixed-rate run (the budget may cut the plan)
        self._adaptive_now = False          # the arrangement under test adapts its mix: read its timeline
        self.side_by_side: list[dict] = []  # the fitted method: per repeat, whether all servers ran at once
        self.rounds: list[dict] = []        # the fitted method: each round's order of probes

    @property
    def phase_starts_s(self) -> list[float] | None:
        if self.spec.arrivals.pattern != "phases":
            return None
        starts, t = [], 0.0
        for phase in self.spec.arrivals.phases:
            starts.append(t)
            t += phase.duration_s
        return starts

    def _ensure_plan(self, endpoint: Endpoint) -> list[PlannedRequest]:
        if self.plan is None:
            tokenize = (http_tokenizer(endpoint.base_url) if self.spec.tokenizer == "server"
                        else local_tokenizer(self.spec.model))
            self.source = PromptSource(tokenize)
            self.plan = plan_requests(self.spec, self.arrivals, self.source, self.content_rng)
        return self.plan

    def plan_for_run(self, run: int) -> list[PlannedRequest]:
        """Replay `run` of a launch: 0 is the plan itself (the fixed-rate run); probes and sweep
        steps get the same requests with other prompt text (content stream `run`)."""
        if run == 0:
            return self.plan
        if run not in self._recuts:
            self._recuts[run] = recut(self.plan, self.spec, self.source, content_stream(self.spec.seed, run))
        return self._recuts[run]

    def run(self, sweep: bool = False, repeat: int = 1, capacity: bool = False) -> list[ArrangementResult]:
        search = capacity or self.spec.capacity is not None
        if search and search_settings(self.spec).method == "fitted":
            for r in range(repeat):
                self.order.append(rotation([a.name for a in self.arrangements], r))
                run_repeat(self, r)
            return [self.results[a.name] for a in self.arrangements if a.name in self.results]
        rel, tune = self.spec.arrivals.relative_rate, self.spec.tune
        grid = len(tune.max_num_batched_tokens or [0]) * len(tune.instances_x_threads or [0]) if tune else 0
        weight = len(self.arrangements) * repeat + (1 if rel else 0) + 0.5 * grid
        self.budget = Budget(self.spec.capacity.budget_s if self.spec.capacity else None, repeat, weight)
        for r in range(repeat):
            names = rotation([a.name for a in self.arrangements], r)
            self.order.append(names)
            i = 0
            while i < len(names):
                arr = next(a for a in self.arrangements if a.name == names[i])
                self._session(arr, r, search, sweep)
                if r == 0 and self.spec.tune and self.tuning is None and self.main_multiplier:
                    self.tuning = tune_colocated(self)
                    if self.tuning.get("joins_as"):
                        names.insert(i + 1, self.tuning["joins_as"])
                        self.budget.weight_left += repeat  # it is launched in every repeat
                    self._notify()
                i += 1
            if rel and self.main_multiplier is None:
                self._no_capacity_to_scale(rel, repeat)
                break
        return [self.results[a.name] for a in self.arrangements if a.name in self.results]

    def _no_capacity_to_scale(self, rel, repeat: int) -> None:
        """Every arrangement calibrated and none held the target at any rate: there is no capacity to
        take a share of, so no fixed-rate run can be made, and a later repeat would spend the same
        minutes of probes on the same answer. Say so, and what to change, instead of repeating."""
        cal = self.calibration or {}
        tried = [probe["multiplier"] for probe in cal.get("probes") or []]
        lowest = min(tried) if tried else None
        cal["note"] = (
            f"no arrangement kept {self.spec.slo.attainment:.0%} of requests good at any rate tried"
            + (f", down to x{lowest:.3g} of the spec's rate" if lowest else "")
            + f" ({', '.join(cal.get('held_nothing') or [])}): there is no capacity to take "
            f"{rel.fraction_of_capacity:g} of, so no fixed-rate run was made"
            + (f" and the other {repeat - 1} repeat(s) were not run" if repeat > 1 else "")
            + ". The SLOs are out of reach for this workload on this machine: loosen them, or leave out "
              "arrivals.rate to compare the arrangements at the spec's own rates (past every capacity)")
        cal["no_capacity"] = True
        self.calibration = cal
        self._notify()

    # --- the fitted method's hooks (sidebyside.py) ---
    def result_for(self, name: str) -> ArrangementResult:
        return self.results.setdefault(name, ArrangementResult(name))

    def start_multiplier(self) -> float:
        """Round 0's rate: the median capacity of an earlier repeat, else the plan's nominal rate."""
        held = [c["capacity_multiplier"] for r in self.results.values() for c in r.capacity
                if c.get("capacity_multiplier")]
        return statistics.median(held) if held else 1.0

    def rename_tuned(self, point: str, name: str) -> None:
        """The tuning grid's winner joins the trial under `name`, keeping its probes."""
        from splitserve.trial.method import grid_arrangements

        base = next(a for a in self.arrangements if a.name == self.spec.tune.base)
        arr = next(a for a in grid_arrangements(self.spec.tune, base, self.spec.cores) if a.name == point)
        tuned = dataclasses.replace(arr, name=name, grid_point=False)
        self.arrangements.insert(1, tuned)
        self.resources[name] = self.resources.pop(point)
        result = self.results.pop(point)
        result.name = name
        self.results[name] = result
        for entry in self.rounds:
            entry["order"] = [name if n == point else n for n in entry["order"]]

    def set_main_multiplier(self) -> float | None:
        """The fixed rate: the spec's, or its share of the reference's fitted capacity."""
        rel = self.spec.arrivals.relative_rate
        if self.main_multiplier is not None or rel is None:
            return self.main_multiplier
        caps = self.results.get(rel.reference)
        cap = caps.capacity[-1] if caps and caps.capacity else None
        if cap is None or not cap.get("estimate_rps") or not cap.get("rps_per_multiplier"):
            return None
        self.main_multiplier = rel.fraction_of_capacity * cap["estimate_rps"] / cap["rps_per_multiplier"]
        self.calibration = {"reference": rel.reference, "fraction_of_capacity": rel.fraction_of_capacity,
                            "capacity_rps": cap["estimate_rps"], "kind": cap["kind"],
                            "rate_multiplier": self.main_multiplier, "held_nothing": [],
                            "note": "" if cap["kind"] == "point" else
                            f"{rel.reference}'s capacity is a bound ({cap['kind'].replace('_', ' ')})"}
        return self.main_multiplier

    def fixed_replay(self, endpoint: Endpoint, name: str, repeat: int, started: float, run: int = 0) -> RunResult:
        """The plan's first requests at the fixed rate; how many follows from the time left. `run`:
        the content stream (0, the plan itself; a redo gets other text, the same requests)."""
        if self.num_fixed is None:
            cap = search_settings(self.spec)
            left = cap.budget_s - (time.monotonic() - started) if cap.budget_s else None
            share = max(left, 0.0) / max(len(self.arrangements), 1) if left is not None else None
            rate = (offered_rate_of(self.plan) or 0.0) * self.main_multiplier
            fits = int(share * rate) + 1 if share is not None else len(self.plan)
            self.num_fixed = max(min(8, len(self.plan)), min(fits, len(self.plan)))
        self._adaptive_now = False
        arr = next((a for a in self.arrangements if a.name == name), None)
        if arr is not None:
            self._adaptive_now = arrangement_kind(arr) == "adaptive"
        return self._replay(endpoint, self.plan_for_run(run)[: self.num_fixed], self.main_multiplier,
                            f"{name} fixed rate (repeat {repeat + 1})", repeat, "fixed")

    def _session(self, arr: Arrangement, repeat: int, search: bool, sweep: bool) -> None:
        """One launch of one arrangement: [capacity search], fixed-rate run, [sweep]."""
        result = self.results.setdefault(arr.name, ArrangementResult(arr.name))
        self._adaptive_now = arrangement_kind(arr) == "adaptive"
        rel = self.spec.arrivals.relative_rate
        # the reference calibrates first; if it holds no rate at all, the next arrangement does
        calibrating = rel is not None and self.main_multiplier is None
        weight = 2.0 if calibrating else 1.0
        share = self.budget.share(weight)
        try:
            with launched(with_kv_split(arr, self.spec.kv_cache_memory), self.spec.model, self.out_dir / "logs",
                          cpus=self.cpus if arr.url is None else None) as endpoint:
                self._ensure_plan(endpoint)
                self._warm_up(endpoint)
                result.launches.append({"repeat": repeat, "processes": read_affinity(endpoint.pid)
                                        if endpoint.pid else [], "cpus": self.cpus if arr.url is None else None})
                if search or calibrating:
                    self._search(endpoint, arr, result, repeat, calibrating,
                                 SEARCH_SHARE * share if share is not None else None)
                if self.main_multiplier is None:
                    return  # no fixed rate yet: the reference held nothing (or never launched)
                if self.num_fixed is None:  # once, after the calibration: the same for every arrangement
                    rate = offered_rate_of(self.plan) * self.main_multiplier
                    self.num_fixed = Budget.fixed_requests(share / weight if share else None, rate, len(self.plan))
                # watched as a side-by-side run is (sidebyside.watched_run): the host's others and steal
                # over the run, a speed benchmark before it and the engine's median decode step, so
                # runs of different launches, repeats or days can be told apart by the machine's state
                # (session 24: the same box stepped 64-token chunks 4-20% slower than the day before, with
                # no steal and nothing else running). Flagged `disturbed`, not redone: the phases'
                # run is the whole plan, and its count of runs is what --repeat asked for.
                watched_run(self, {arr.name: endpoint}, arr.name, lambda _redo: self._replay(
                    endpoint, self.plan_for_run(0)[: self.num_fixed], self.main_multiplier,
                    f"{arr.name} fixed rate (repeat {repeat + 1})", repeat, "fixed"), redo=False)
                self._notify()
                if sweep:
                    target = self.spec.sweep.target_attainment if self.spec.sweep else self.spec.slo.attainment
                    steps = self.spec.sweep.rate_multipliers if self.spec.sweep else [0.5, 1.0, 1.5, 2.0, 3.0]
                    for k, m in enumerate(x for x in steps if x != self.main_multiplier):
                        run = self._replay(endpoint, self.plan_for_run(100 + k), m, f"{arr.name} x{m:g}", repeat,
                                           "sweep")
                        result.runs.append(run)
                        self._notify()
                        if run.summary["attainment"] < target:
                            break  # higher rates only do worse
        except LaunchError as exc:
            result.error = str(exc)
        finally:
            self.budget.spent(weight)
            self._notify()

    def _search(self, endpoint: Endpoint, arr: Arrangement, result: ArrangementResult, repeat: int,
                calibrating: bool, budget: float | None) -> None:
        cap_spec = search_settings(self.spec)
        rel = self.spec.arrivals.relative_rate
        start = self._search_start(result)
        found_runs: list[RunResult] = []

        seeded = self.tuning_probes.pop(arr.name, None) if repeat == 0 else None

        def probe(m: float) -> Probe:
            if seeded is not None and not found_runs and math.isclose(seeded.rate_multiplier, m):
                run = seeded  # the same launch settings and requests, already replayed by the tuning grid
            else:
                run = self._probe(endpoint, arr.name, m, repeat, cap_spec.probe_requests, 1 + len(found_runs))
            found_runs.append(run)
            result.runs.append(run)
            self._notify()
            return Probe(m, run.summary["attainment"], run.summary["offered_rate_rps"], run.summary["wall_s"])

        def beaten(failed: float) -> bool:
            """Another arrangement held `failed` or more in this repeat: this one is out of the running.
            The calibration runs first, so nothing shows yet whether it is a contender: it is narrowed
            like one (a reference whose passing probes are slow, at low rates, costs time here; name a
            strong setting as the reference)."""
            return any(c.get("capacity_multiplier") and c["capacity_multiplier"] >= failed * (1 - 1e-9)
                       for name, other in self.results.items() if name != arr.name
                       for c in other.capacity if c["repeat"] == repeat)

        found = search_capacity(probe, start, self.spec.slo.attainment, cap_spec.precision, cap_spec.grow,
                                cap_spec.max_probes, budget, cap_spec.min_multiplier, beaten)
        result.capacity.append({"repeat": repeat, **found.to_dict()})
        if calibrating:
            held_nothing = (self.calibration or {}).get("held_nothing", [])
            self.calibration = {"reference": arr.name, "fraction_of_capacity": rel.fraction_of_capacity,
                                **found.to_dict(), "held_nothing": held_nothing}
            if found.passed is None:
                lowest = min(p.multiplier for p in found.probes)
                held_nothing.append(arr.name)
                self.calibration["note"] = (
                    f"{', '.join(held_nothing)} kept fewer than {self.spec.slo.attainment:.0%} of requests good at "
                    f"every rate tried, down to x{lowest:.3g} of the nominal rate; the fixed rate follows the "
                    f"first arrangement that holds one")
                return
            self.main_multiplier = rel.fraction_of_capacity * found.passed.multiplier
            self.calibration["rate_multiplier"] = self.main_multiplier
            if held_nothing:
                self.calibration["note"] = (f"{', '.join(held_nothing)} held no rate tried, so the fixed rate is "
                                            f"{rel.fraction_of_capacity:g} x {arr.name}'s capacity instead")

    def _search_start(self, result: ArrangementResult) -> float:
        """Where a search starts: this arrangement's own capacity in an earlier repeat, else the highest
        rate any arrangement has held so far (the reference's capacity at least). A passing probe at a
        low rate is the slowest kind (it must replay all its requests), a failing one stops early, so
        starting high and halving costs less than growing from the weakest arrangement's rate."""
        own = [c["capacity_multiplier"] for c in result.capacity if c.get("capacity_multiplier")]
        if own:
            return statistics.median(own)
        held = [c["capacity_multiplier"] for r in self.results.values() for c in r.capacity
                if c.get("capacity_multiplier")]
        rel = self.spec.arrivals.relative_rate
        if self.main_multiplier is not None and rel is not None:
            held.append(self.main_multiplier / rel.fraction_of_capacity)
        seeded = self.tuning_probes.get(result.name)
        if seeded is not None and seeded.summary["attainment"] >= self.spec.slo.attainment:
            held.append(seeded.rate_multiplier)  # the tuned setting held its grid probe's rate
        return max(held) if held else 1.0

    def _probe(self, endpoint: Endpoint, name: str, multiplier: float, repeat: int, num: int,
               run: int, fitted: bool = False) -> RunResult:
        """The plan's first `num` requests at `multiplier` (more when `capacity.probe_seconds` asks
        for a longer span, the plan repeated if need be), stopped as soon as it cannot pass: once
        more requests than the target allows are bad, finished or not (a watchdog judges streams
        in flight: no first token within the TTFT SLO, a pause past max_pause_s, past e2e_s).
        `fitted`: the probe is one point of a fitted curve, not a pass/fail: it stops only once its
        share good can no longer reach STOP_MARGIN below the target (a rate far past the capacity),
        and its outcomes are the requests decided (finished, or judged bad in flight): a request
        never sent, or cut off undecided, is not an outcome."""
        cap = search_settings(self.spec)
        base = self.plan_for_run(run)
        if self.phase_starts_s is not None:
            # a phased plan is probed whole (or on the phase the spec names): its first requests are
            # its first phase only, and a plan that opens with its hardest phase held nothing there
            base = phase_plan(base, self.phase_starts_s, cap.phase)
            num = max(num, len(base))
        count = probe_length(base, multiplier, num, cap.probe_seconds)
        plan = tiled(base, count, lambda p, k: recut(p, self.spec, self.source,
                                                     content_stream(self.spec.seed, run + 10_000 * k)))
        slo, class_slos = self.spec.slo, self.spec.class_slos
        floor = slo.attainment - STOP_MARGIN if fitted else slo.attainment
        allowed_bad = int((1.0 - floor) * len(plan) + 1e-9)
        stop, live, bad, finished = asyncio.Event(), {}, set(), set()
        on_progress = self.progress(f"{name} probe x{multiplier:.3g}", len(plan)) if self.progress else None

        def judge(index: int) -> None:
            bad.add(index)
            if len(bad) > allowed_bad:
                stop.set()

        def on_done(rec: RequestRecord) -> None:
            finished.add(rec.index)
            own = slo_of(rec, slo, class_slos)
            if not is_good(request_metrics(rec, own, self.spec.pause_threshold_s), own):
                judge(rec.index)
            if on_progress:
                on_progress(rec)

        async def watchdog(t0: float) -> None:
            while not stop.is_set() and len(finished) < len(plan):
                now = time.perf_counter() - t0
                for index, rec in list(live.items()):
                    if index in finished or index in bad or rec.sent_s is None:
                        continue
                    if _past_deadline(rec, slo_of(rec, slo, class_slos), now):
                        judge(index)
                await asyncio.sleep(0.1)

        e2es = [s.e2e_s for s in class_slos.values()]
        timeout = self.spec.request_timeout_s if None in e2es else min(self.spec.request_timeout_s, max(e2es) + 1.0)
        run = self._replay(endpoint, plan, multiplier, None, repeat, "probe", timeout, on_done, stop,
                           [watchdog], live)
        decided = [r for r in run.records if r.index in finished or r.index in bad]
        run.summary["outcomes"] = {"index": [r.index for r in decided],
                                   "good": [r.index not in bad for r in decided],
                                   "class": [r.class_name for r in decided]}
        run.summary["num_decided"] = len(decided)
        return run

    def _warm_up(self, endpoint: Endpoint) -> None:
        """Same warm-up for every launch: the first few planned requests, one at a time, with
        their own prompt text (content stream -1), so no measured replay starts on cached prompts."""
        if self.plan is None:
            return
        warm_plan = recut(self.plan[: self.spec.warmup_requests], self.spec, self.source,
                          content_stream(self.spec.seed, -1))
        for req in warm_plan:
            warm = dataclasses.replace(req, send_at_s=0.0, max_tokens=min(req.max_tokens, 8))
            asyncio.run(run_load(endpoint.base_url, [warm], self.spec.request_timeout_s, endpoint.model))

    def _replay(self, endpoint: Endpoint, plan: list[PlannedRequest], multiplier: float, label: str | None,
                repeat: int, purpose: str, timeout_s: float | None = None, on_done=None,
                stop: asyncio.Event | None = None, watchers=(), live=None) -> RunResult:
        timed = [dataclasses.replace(r, send_at_s=r.send_at_s / multiplier) for r in plan]
        if on_done is None and self.progress and label:
            on_done = self.progress(label, len(timed))
        idle = wait_idle(endpoint.base_url)   # nothing left running from a run that stopped early
        before = scrape_counters(endpoint.base_url)
        steps_before = step_counts(endpoint.base_url)
        fault_events: list[dict] = []
        faults = self.spec.faults if purpose == "fixed" else []

        def scheduled(fault):
            async def run(t0: float) -> None:
                fault_events.append(await inject_fault(endpoint.base_url, fault, t0, multiplier))
            return run

        started, started_wall = time.monotonic(), time.time()
        records = asyncio.run(run_load(endpoint.base_url, timed, timeout_s or self.spec.request_timeout_s,
                                       endpoint.model, on_done, [*(scheduled(f) for f in faults), *watchers],
                                       stop, live))
        wall = time.monotonic() - started
        counters = counter_deltas(before, scrape_counters(endpoint.base_url))
        engine_steps = steps_since(endpoint.base_url, steps_before)
        phases = [t / multiplier for t in self.phase_starts_s] if self.phase_starts_s else None
        summary = summarize(records, self.spec.slo, self.spec.pause_threshold_s, phase_starts_s=phases,
                            class_slos=self.spec.class_slos)
        if faults:
            fault_events.sort(key=lambda e: e["at_s"])
            summary["faults"] = fault_outcomes(fault_events, records, self.spec.slo, self.spec.pause_threshold_s,
                                               self.spec.class_slos)
        summary["abandoned_work"]["server"] = server_aborted_work(counters)
        summary["rate_multiplier"] = multiplier
        summary["wall_s"] = wall
        summary["stopped_early"] = bool(stop is not None and stop.is_set())
        summary["idle_before"] = idle
        if engine_steps is not None:
            summary["engine_steps"] = engine_steps
        if self._adaptive_now:
            summary["role_timeline"] = fetch_role_timeline(endpoint.base_url, started_wall)
            add_attainment_after(summary["role_timeline"], records, self.spec.slo, self.spec.pause_threshold_s,
                                 self.spec.class_slos)
        return RunResult(multiplier, summary, records, counters, repeat, purpose)

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update(self)


def _past_deadline(rec: RequestRecord, slo, now: float) -> bool:
    """A stream in flight that can no longer be good: no first token within the TTFT SLO, a pause
    past max_pause_s, or past e2e_s (deadlines a class drops are not checked)."""
    times, age = rec.token_times_s, now - rec.sent_s
    return ((not times and slo.ttft_s is not None and age > slo.ttft_s)
            or (slo.e2e_s is not None and age > slo.e2e_s)
            or bool(times and slo.max_pause_s is not None and now - times[-1] > slo.max_pause_s))


def phase_plan(plan: list[PlannedRequest], starts: list[float], phase: int | None) -> list[PlannedRequest]:
    """The whole plan, or the requests of one phase (1-based) moved to start at 0."""
    if phase is None:
        return plan
    if phase > len(starts):
        raise SpecError(f"capacity.phase: {phase}, but the plan has {len(starts)} phases")
    start = starts[phase - 1]
    end = starts[phase] if phase < len(starts) else math.inf
    picked = [dataclasses.replace(r, send_at_s=r.send_at_s - start) for r in plan if start <= r.send_at_s < end]
    if not picked:
        raise SpecError(f"capacity.phase: phase {phase} has no requests to probe")
    return picked


def offered_rate_of(plan: list[PlannedRequest]) -> float | None:
    span = plan[-1].send_at_s - plan[0].send_at_s if plan else 0.0
    return (len(plan) - 1) / span if span > 0 else None


def check_named(spec: TrialSpec) -> None:
    """--only or --url may have removed the arrangement the rate or the tuning refers to."""
    names = [a.name for a in spec.arrangements]
    rel = spec.arrivals.relative_rate
    if rel is not None and rel.reference not in names:
        raise SpecError(f"arrivals.rate.reference: {rel.reference!r} is not among the arrangements run "
                        f"({names}); keep it in --only, or give the rate in requests/s")
    if spec.tune is not None and spec.tune.base not in names:
        raise SpecError(f"tune.base: {spec.tune.base!r} is not among the arrangements run ({names}); "
                        "keep it in --only")

