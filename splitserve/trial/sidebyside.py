"""Arrangements measured side by side: every server up at once, probes interleaved, one curve each.

Each repeat launches every arrangement's server once (the same pinned cores and KV memory as a
launch one at a time), plus the colocated tuning grid's points in the first repeat. Then rounds:
in round k every arrangement still searching gets one probe, in an order that rotates by one
each round (ABC, BCA, CAB, ...), and every probe of round k replays the same requests (content
stream k), so slow drift of the machine's speed hits all arrangements alike and the ratio's
bootstrap can pair them. Round 0 probes everyone at the same rate; after it, each arrangement
probes where its own fitted curve's capacity interval narrows most (curve.next_rate). While one
server is probed the others sit idle: their CPU during each probe is measured and kept.

An arrangement stops when its interval is narrower than `capacity.precision` or it has had
`capacity.max_probes` probes; all stop when the search's share of the budget is spent. The tuning
grid is searched the same way for TUNE_ROUNDS rounds; the best colocated setting then continues
(as `colocated-best`, its probes kept, on the same request sets as the others) and the other
points stop. A grid point is best only when its capacity interval lies above the base's; within
noise of it, the base stays. Every probe is watched
(hostwatch.py): one where other processes took more than the threshold of the cores is redone
once. Between probes a short fixed CPU benchmark records the machine's speed.

Where memory cannot hold every server at once, each arrangement is launched alone in rotating
order and searched to the end before the next (the report says so): the same probes, the same
request sets per round, but drift between launches is not shared. The estimate counts each
server's frontend, each engine and its whole KV cache as resident (the worst case), against 90% of
the memory available when the repeat starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time

import numpy as np
import psutil

from splitserve.trial import curve
from splitserve.trial.arrangements import LaunchError, launched
from splitserve.trial.engine_steps import decode_step_median
from splitserve.trial.method import grid_arrangements, search_settings
from splitserve.trial.resources import arrangement_resources, with_kv_split

TUNE_ROUNDS = 2
SEARCH_FRACTION = 0.8          # of capacity.budget_s; the fixed-rate runs get the rest
# Resident memory beside the KV cache, measured on the bundled model (2026-12-02, psutil RSS): a
# server's frontend ~380 MB, each engine ~500-620 MB (torch, the model, the KV pages touched so far)
FRONTEND_BYTES = 400 << 20
ENGINE_BYTES = 512 << 20
DISTURBED_SHARE = 0.10
PROBE_OVERHEAD_S = 10.0        # per probe beyond its arrivals: drain, speed benchmark, settle (a guess, 2-core box)
MIN_AFFORDED_PROBES = 5        # fewer probes per arrangement rarely bracket the crossing
REDO_STREAM = 500_000          # a redone run's content stream: past any probe's tiles (run + 10_000 k)

try:  # the watched host (issue 25 part 3); a trial without it runs unwatched and says so
    from splitserve.trial.hostwatch import HostWatch, speed_benchmark
except ImportError:  # pragma: no cover - the module ships with the trial
    HostWatch = speed_benchmark = None


@dataclasses.dataclass
class Search:
    """One arrangement's fitted search: its probes' outcomes and where to probe next."""

    name: str
    multiplier: float
    probes: list = dataclasses.field(default_factory=list)
    found: curve.Capacity | None = None
    done: bool = False
    halved: bool = False       # a tuning point stopped by successive halving: out of the running
    rps_per_multiplier: float | None = None

    def add(self, run, round_index: int, target: float, precision: float, grow: float, rng) -> None:
        rate = run.summary.get("offered_rate_rps") or run.rate_multiplier
        self.rps_per_multiplier = rate / run.rate_multiplier
        outcomes = run.summary.get("outcomes") or {}
        self.probes.append(curve.ProbeOutcomes(rate, dict(zip(outcomes.get("index", []), outcomes.get("good", []))),
                                               round_index, dict(zip(outcomes.get("index", []),
                                                                     outcomes.get("class", [])))))
        self.found = curve.capacity(self.probes, target, rng)
        if self.found.kind == "point" and self.found.width() < precision:
            self.done = True
        else:
            self.multiplier = curve.next_rate(self.probes, self.found, grow, precision) / self.rps_per_multiplier

    def rank(self) -> tuple[float, float]:
        """The score, then the share of all its decided requests good (probes at the same rates)."""
        n = sum(p.n for p in self.probes)
        return self.score(), (sum(p.k for p in self.probes) / n if n else 0.0)

    def score(self) -> float:
        """For ranking the tuning grid: the crossing, a lower bound as is, an upper bound below it."""
        if self.found is None or self.found.estimate is None:
            return 0.0
        return self.found.estimate * (0.5 if self.found.kind == "at_most" else 1.0)


def affordable_probes(cap, num_arrangements: int, num_grid: int = 0) -> float:
    """Probes per arrangement the search's share of budget_s pays for: each probe takes its
    probe_seconds of arrivals plus PROBE_OVERHEAD_S (the drain, the speed benchmark, the wait for
    the server to drop the last run); the grid's probes (grid_probes) take their share first."""
    per_probe = (cap.probe_seconds or 30.0) + PROBE_OVERHEAD_S
    rounds = cap.budget_s * SEARCH_FRACTION / (per_probe * max(num_arrangements, 1))
    return max(rounds - grid_probes(num_grid) / max(num_arrangements, 1), 0.0)


def grid_probes(num_grid: int) -> int:
    """Probes the tuning grid's points take: every point in the first round, then (successive
    halving) the better half of the colocated settings, the base among them, in the rest."""
    if num_grid <= 0:
        return 0
    survivors = max(math.ceil((num_grid + 1) / 2) - 1, 0)   # grid points beside the base
    return num_grid + survivors * (TUNE_ROUNDS - 1)


def budget_warning(cap, num_arrangements: int, num_grid: int = 0) -> str | None:
    probes = affordable_probes(cap, num_arrangements, num_grid)
    if probes >= MIN_AFFORDED_PROBES:
        return None
    return (f"budget_s {cap.budget_s:g} affords about {probes:.0f} probes per arrangement "
            f"({num_arrangements} arrangements, {cap.probe_seconds or 30:g} s probes); intervals will be "
            f"wide, or bounds only. About {MIN_AFFORDED_PROBES} need budget_s >= "
            f"{budget_for(cap, num_arrangements, num_grid):.0f}")


def budget_for(cap, num_arrangements: int, num_grid: int = 0, probes: int | None = None) -> float:
    """The budget_s that affords `probes` (MIN_AFFORDED_PROBES) per arrangement."""
    per_probe = (cap.probe_seconds or 30.0) + PROBE_OVERHEAD_S
    rounds = (probes or MIN_AFFORDED_PROBES) + grid_probes(num_grid) / max(num_arrangements, 1)
    return rounds * per_probe * max(num_arrangements, 1) / SEARCH_FRACTION


def memory_needed(arrangements, spec) -> int:
    total = 0
    for arr in arrangements:
        res = arrangement_resources(with_kv_split(arr, spec.kv_cache_memory))
        total += FRONTEND_BYTES + (res.num_instances or 1) * ENGINE_BYTES + (res.kv_total or 0)
    return total


def tuning_points(trial) -> list:
    """The grid's points, less the one identical to the base (the base itself is searched)."""
    spec = trial.spec
    if spec.tune is None:
        return []
    from splitserve.trial.tuning import _flags

    base = next(a for a in trial.arrangements if a.name == spec.tune.base)
    return [p for p in grid_arrangements(spec.tune, base, spec.cores) if _flags(p.serve_args) != _flags(base.serve_args)]


def run_repeat(trial, repeat: int) -> None:
    """One repeat of the fitted method: the searches, then the fixed-rate runs."""
    spec = trial.spec
    named = list(trial.arrangements)
    grid = tuning_points(trial) if repeat == 0 else []
    launches = named + grid
    for arr in grid:
        trial.resources[arr.name] = arrangement_resources(with_kv_split(arr, spec.kv_cache_memory))
    needed, free = memory_needed(launches, spec), psutil.virtual_memory().available
    together = needed <= 0.9 * free   # the whole KV cache counted resident: a worst case
    if not together:
        grid, launches = [], named
    trial.side_by_side.append({"repeat": repeat, "together": together, "memory_needed_bytes": needed,
                               "memory_available_bytes": free, "launched": [a.name for a in launches]})
    cap = search_settings(spec)
    budget_s = cap.budget_s * SEARCH_FRACTION if cap.budget_s else None
    if repeat == 0 and cap.budget_s:
        warning = budget_warning(cap, len(named), len(grid))
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if together:
            endpoints = _launch_all(trial, stack, launches, repeat)
            started = time.monotonic()   # the budget is replay time: the launches are not in it
            searches = _rounds(trial, endpoints, grid, repeat, budget_s)
        else:  # one at a time, the reference first; the tuning grid needs its points side by side
            endpoints, searches = {}, {}
            rel = spec.arrivals.relative_rate
            order = sorted(_rotated(named, repeat), key=lambda a: not (rel and a.name == rel.reference))
            for arr in order:
                with contextlib.ExitStack() as alone:
                    ep = _launch(trial, alone, arr, repeat)
                    if ep is None:
                        continue
                    left = None if budget_s is None else budget_s / len(order)   # the same search time each
                    searches.update(_rounds(trial, {arr.name: ep}, [], repeat, left))
                    _record(trial, {arr.name: searches[arr.name]}, repeat)
                    if trial.set_main_multiplier() is not None:
                        _watched_fixed(trial, {arr.name: ep}, arr.name, repeat, started)
            return
        _record(trial, searches, repeat)
        if trial.set_main_multiplier() is not None:
            for name in _rotated([a.name for a in trial.arrangements], repeat):
                if name in endpoints:
                    _watched_fixed(trial, endpoints, name, repeat, started)


def _rotated(items, k):
    k = k % len(items) if items else 0
    return items[k:] + items[:k]


def _launch_all(trial, stack, arrangements, repeat) -> dict:
    """Start every server at once (loading the model is mostly waiting on imports and files, so
    the launches overlap), then warm each up in turn. Each server's stop is registered as soon as it
    is up, so an interrupted launch still stops every server it started."""
    from concurrent.futures import ThreadPoolExecutor

    managers = {a.name: launched(with_kv_split(a, trial.spec.kv_cache_memory), trial.spec.model,
                                 trial.out_dir / "logs", cpus=trial.cpus if a.url is None else None)
                for a in arrangements}

    def enter(name):
        try:
            ep = managers[name].__enter__()
        except BaseException as exc:  # noqa: BLE001 - handed back to the main thread below
            return exc
        stack.push(managers[name].__exit__)   # a deque append: safe from a thread
        return ep

    with ThreadPoolExecutor(max_workers=len(managers) or 1) as pool:
        got = dict(zip(managers, pool.map(enter, managers)))
    endpoints = {}
    for arr in arrangements:
        ep = got[arr.name]
        if isinstance(ep, LaunchError):
            trial.result_for(arr.name).error = str(ep)
            continue
        if isinstance(ep, BaseException):
            raise ep
        _ready(trial, arr, ep, repeat)
        endpoints[arr.name] = ep
    return endpoints


def _ready(trial, arr, ep, repeat) -> None:
    trial._ensure_plan(ep)
    trial._warm_up(ep)
    from splitserve.trial.resources import read_affinity

    trial.result_for(arr.name).launches.append({"repeat": repeat, "processes": read_affinity(ep.pid) if ep.pid
                                                else [], "cpus": trial.cpus if arr.url is None else None})


def _launch(trial, stack, arr, repeat):
    result = trial.result_for(arr.name)
    try:
        ep = stack.enter_context(launched(with_kv_split(arr, trial.spec.kv_cache_memory), trial.spec.model,
                                          trial.out_dir / "logs", cpus=trial.cpus if arr.url is None else None))
    except LaunchError as exc:
        result.error = str(exc)
        return None
    _ready(trial, arr, ep, repeat)
    return ep


def _rounds(trial, endpoints, grid, repeat, budget_s) -> dict[str, Search]:
    spec, cap = trial.spec, search_settings(trial.spec)
    target = spec.slo.attainment
    rng = np.random.default_rng(spec.seed)
    start = trial.start_multiplier()
    searches = {name: Search(name, start) for name in endpoints}
    grid_names = {a.name for a in grid}
    spent, k = 0.0, 0
    while True:
        active = [n for n in _rotated(list(endpoints), k) if not searches[n].done
                  and len(searches[n].probes) < cap.max_probes]
        if not active:
            break
        expected = sum((_last_wall(trial, n) or (cap.probe_seconds or 30.0)) for n in active)
        if budget_s is not None and k > 0 and spent + expected > budget_s:
            break
        trial.rounds.append({"repeat": repeat, "round": k, "order": active})
        for name in active:
            run, wall = _watched_probe(trial, endpoints, name, searches[name].multiplier, repeat, k)
            spent += wall
            searches[name].add(run, k, target, cap.precision, cap.grow, rng)
            trial._notify()
        k += 1
        if grid and trial.tuning is None:
            _halve_grid(trial, searches, grid_names, k)
            if k == TUNE_ROUNDS:
                _pick_tuned(trial, searches, endpoints, grid_names)
    if grid and trial.tuning is None:   # the budget ended the search inside the tuning rounds
        _pick_tuned(trial, searches, endpoints, grid_names)
    return searches


def _last_wall(trial, name):
    runs = [r for r in trial.result_for(name).runs if r.purpose == "probe"]
    return runs[-1].summary["wall_s"] if runs else None


def _watched_probe(trial, endpoints, name, multiplier, repeat, k):
    cap, ep = search_settings(trial.spec), endpoints[name]

    def replay(redo):
        # a redo gets other prompt text for the same requests: the prefix cache must not remember it
        run = trial._probe(ep, name, multiplier, repeat, cap.probe_requests, 1 + k + redo * REDO_STREAM, fitted=True)
        run.summary["round"] = k
        return run
    return watched_run(trial, endpoints, name, replay)


def _watched_fixed(trial, endpoints, name, repeat, started):
    """The fixed-rate run under the same watch as a probe (issue 25: the check guards them too)."""
    watched_run(trial, endpoints, name, lambda redo: trial.fixed_replay(endpoints[name], name, repeat, started,
                                                                         redo * REDO_STREAM))
    trial._notify()


def watched_run(trial, endpoints, name, replay, redo: bool = True):
    """One run (a probe or a fixed-rate run), watched; redone once when other processes took the
    cores (redo=False: flagged `disturbed` only, as a fixed-rate run launched alone is). The idle
    servers' CPU during it is measured: side by side means they must sleep while another is probed.
    Also kept: the engine's median decode-only step, a symptom of a slow engine the host reading may
    miss (quote.step_check puts it beside the arrangement's median)."""
    idle = {n: _tree(e.pid) for n, e in endpoints.items() if n != name and e.pid}
    wall = 0.0
    for attempt in (0, 1):
        speed = speed_benchmark() if speed_benchmark else None
        cpu0 = {n: _cpu_s(procs) for n, procs in idle.items()}
        watch = HostWatch(lambda: [os.getpid(), *(e.pid for e in endpoints.values() if e.pid)],
                          threshold=DISTURBED_SHARE) if HostWatch else None
        if watch:
            watch.start()
        run = replay(attempt)
        reading = watch.stop() if watch else None
        run.summary["host"] = reading.to_json() if reading else None
        run.summary["speed_units_per_s"] = speed
        run.summary["idle_cpu_share"] = {n: (_cpu_s(procs) - cpu0[n]) / max(run.summary["wall_s"], 1e-9)
                                         for n, procs in idle.items()}
        run.summary["attempt"] = attempt
        run.summary["decode_step_median_s"] = decode_step_median(run.summary.get("engine_steps"))
        wall += run.summary["wall_s"]
        disturbed = bool(reading and reading.disturbed)
        run.summary["disturbed"] = disturbed
        if not disturbed or attempt == 1 or not redo:
            break
        run.purpose = f"{run.purpose}-disturbed"  # kept for the record, not fitted nor compared
        trial.result_for(name).runs.append(run)
    trial.result_for(name).runs.append(run)
    return run, wall


def _tree(pid):
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _cpu_s(procs) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _halve_grid(trial, searches, grid_names, k):
    """Successive halving before the last tuning round: the better half of the colocated settings
    (base and grid points) go on, so the tuning rounds cost less than a probe of every point each."""
    if k >= TUNE_ROUNDS:
        return
    pool = [n for n in [trial.spec.tune.base, *grid_names] if n in searches and not searches[n].done]
    ranked = sorted(pool, key=lambda n: searches[n].rank(), reverse=True)
    for n in ranked[(len(ranked) + 1) // 2:]:
        if n in grid_names:      # the base is a named arrangement: it is always searched
            searches[n].done = searches[n].halved = True


def _pick_tuned(trial, searches, endpoints, grid_names):
    """After the tuning rounds: the best colocated setting continues, the other grid points stop."""
    base = trial.spec.tune.base
    pool = [base, *grid_names]
    # only the settings that reached the last tuning round: one halved out after failing at a high
    # rate has an upper bound there ("at most 0.95"), which says less, not more, than a lower rate tried
    best = max((n for n in pool if n in searches and not searches[n].halved), key=lambda n: searches[n].rank(),
               default=None)
    # a grid point replaces the base only when its interval lies above the base's: two tuning rounds
    # leave wide intervals, and a point estimate within noise of the base is not a better setting
    if best != base and base in searches and not clearly_above(searches[best].found, searches[base].found):
        best = base
    for n in grid_names:
        if n != best and n in searches:
            searches[n].done = True
    trial.tuning = {"base": base, "method": "fitted", "rounds": TUNE_ROUNDS, "best": best,
                    "points": [{"name": n, **(searches[n].found.to_dict() if searches[n].found else {})}
                               for n in pool if n in searches],
                    "joins_as": "colocated-best" if best in grid_names else None}
    if best in grid_names:
        trial.rename_tuned(best, "colocated-best")
        searches["colocated-best"] = searches.pop(best)
        searches["colocated-best"].name = "colocated-best"
        endpoints["colocated-best"] = endpoints.pop(best)


def clearly_above(found, other) -> bool:
    """found's capacity is above other's beyond both intervals: found's lower end (the point's lo,
    an "at least" bound) over other's upper end (the point's hi, an "at most" bound), or the two
    meeting at one probed rate from either side (curve.meet_apart)."""
    if found is None or other is None:
        return False
    low = {"point": found.lo, "at_least": found.estimate}.get(found.kind)
    high = {"point": other.hi, "at_most": other.estimate}.get(other.kind)
    if low is None or high is None:
        return False
    return low > high or curve.meet_apart(found, other) is not None


def _record(trial, searches, repeat):
    for name, s in searches.items():
        f = s.found or curve.Capacity("none", None)
        result = trial.result_for(name)
        held = f.estimate if f.kind in ("point", "at_least") else None
        result.capacity.append({"repeat": repeat, "method": "fitted", **f.to_dict(), "capacity_rps": held,
                                "capacity_multiplier": held / s.rps_per_multiplier if held and s.rps_per_multiplier
                                else None, "failed_rps": f.estimate if f.kind == "at_most" else f.hi,
                                "stopped_by": "precision" if s.done else "budget_or_max_probes",
                                "rps_per_multiplier": s.rps_per_multiplier,
                                "probes": [{"offered_rate_rps": p.rate, "n": p.n, "good": p.k, "round": p.round}
                                           for p in s.probes]})

