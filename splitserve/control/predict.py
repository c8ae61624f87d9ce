"""Predict one arrangement on one workload: build its instances from a profile, simulate, score.

The workload comes from a trial spec (the same arrival times as the trial: the spec's seed
spawns the same arrival stream; lengths are drawn from the same distributions) or from a
trial's results.json (its exact plan). Scores follow trial/metrics.py's definitions: TTFT,
each request's gap percentile and longest gap, end to end, and attainment = the share of
requests meeting all four.
"""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass

import numpy as np

from splitserve.config import parse_size
from splitserve.control.profile_file import Profile
from splitserve.control.simulator import MAX_QUEUED_REQUESTS, Instance, InstanceSpec, Simulation, SimRequest
from splitserve.coordinator.disagg_policy import POLICIES, DisaggPolicy, check_disagg_args, disagg_policy_from_args
from splitserve.trial.metrics import prefill_counts
from splitserve.trial.spec import SLO, TrialSpec
from splitserve.trial.workload import spec_shapes

DEFAULT_KV_CACHE_BYTES = 1 << 30  # serve's --kv-cache-memory default, per engine


DISAGG_FLAGS = (("--local-prefill-max-tokens", "local_prefill_max_tokens"),  # serve flag, DisaggSpec field
                ("--prefill-queue-max-tokens", "prefill_queue_max_tokens"),
                ("--local-prefill-chunk-tokens", "local_prefill_chunk_tokens"),
                ("--slo-ttft-s", "slo_ttft_s"), ("--slo-gap-s", "slo_gap_s"))


@dataclass(slots=True, frozen=True)
class DisaggSpec:
    """A separated arrangement's `serve --disagg-policy` and its settings (None: serve's default)."""

    policy: str = "always"
    local_prefill_max_tokens: int | None = None
    prefill_queue_max_tokens: int | None = None
    local_prefill_chunk_tokens: int | None = None
    slo_ttft_s: float | None = None  # auto's targets (serve takes them for --adaptive alone otherwise)
    slo_gap_s: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--disagg-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check_disagg_args(self._args(256, 16, 1))  # serve's own checks, naming the flag

    def _args(self, budget: int, block_size: int, threads: int) -> argparse.Namespace:
        return argparse.Namespace(disagg_policy=self.policy, profile=None, threads_per_instance=threads,
                                  max_num_batched_tokens=budget, block_size=block_size,
                                  **{field: getattr(self, field) for _, field in DISAGG_FLAGS})

    def serve_args(self) -> list[str]:
        if self.policy == "always":
            return []
        out = ["--disagg-policy", self.policy]
        for flag, field in DISAGG_FLAGS:
            value = getattr(self, field)
            if value is not None and (self.policy == "auto" or not field.startswith("slo")):
                out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return out

    def build(self, budget: int, block_size: int, threads: int, steps) -> tuple[DisaggPolicy, int | None]:
        """The coordinator's policy object as serve builds it, `auto` weighing `steps`, and the
        decode instances' local-prefill chunk (None under `always`, as serve leaves it)."""
        args = self._args(budget, block_size, threads)
        policy = disagg_policy_from_args(args, steps=steps)
        return policy, args.local_prefill_chunk_tokens


@dataclass(slots=True, frozen=True)
class Arrangement:
    name: str
    instances: tuple[InstanceSpec, ...]
    transport: str = "shm"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    disagg: DisaggSpec = DisaggSpec()  # separated arrangements: where each prompt is prefilled

    @property
    def cores(self) -> int:
        return sum(i.threads for i in self.instances)

    @property
    def kind(self) -> str:
        return "separated" if any(i.role != "colocated" for i in self.instances) else "colocated"

    @property
    def launchable_with_serve(self) -> bool:
        return len({i.threads for i in self.instances}) == 1

    def serve_args(self) -> list[str]:
        """The `splitserve serve` arguments that launch it (equal threads per instance only)."""
        first = self.instances[0]
        threads = {i.threads for i in self.instances}
        args = (["--instances", str(len(self.instances))] if self.kind == "colocated" else
                ["--prefill", str(sum(i.role == "prefill" for i in self.instances)),
                 "--decode", str(sum(i.role == "decode" for i in self.instances)), "--kv-transport", self.transport])
        if len(threads) == 1:
            args += ["--threads-per-instance", str(first.threads)]
        if self.kv_cache_bytes != DEFAULT_KV_CACHE_BYTES:
            args += ["--kv-cache-memory", str(self.kv_cache_bytes)]
        if self.kind == "separated":
            args += self.disagg.serve_args()
        return args + ["--prefill-policy", first.policy, "--max-num-batched-tokens", str(first.budget)]

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "cores": self.cores, "transport": self.transport,
                **({"disagg_policy": self.disagg.policy} if self.kind == "separated" else {}),
                "instances": [{"role": i.role, "threads": i.threads, "policy": i.policy, "budget": i.budget,
                               "max_num_seqs": i.max_num_seqs} for i in self.instances],
                "serve_args": self.serve_args(), "launchable_with_serve": self.launchable_with_serve}


def _flag(args: list[str], name: str, default: str | None) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else default


def arrangement_from_serve_args(name: str, args: list[str], cores: int | None) -> Arrangement:
    """The arrangement a trial launched with `serve` arguments (what compare.py re-simulates)."""
    policy = _flag(args, "--prefill-policy", "chunked")
    budget = int(_flag(args, "--max-num-batched-tokens", "256"))
    seqs = int(_flag(args, "--max-num-seqs", "64"))
    scheduling = _flag(args, "--scheduling-policy", "fcfs")
    num_p, num_d = int(_flag(args, "--prefill", "0")), int(_flag(args, "--decode", "0"))
    roles = ["prefill"] * num_p + ["decode"] * num_d if num_p or num_d else \
        ["colocated"] * int(_flag(args, "--instances", "1"))
    threads = _flag(args, "--threads-per-instance", None)
    per = int(threads) if threads else max((cores or len(roles)) // len(roles), 1)
    kv = _flag(args, "--kv-cache-memory", None)
    return Arrangement(name, tuple(InstanceSpec(r, per, policy, budget, seqs, scheduling) for r in roles),
                       transport=_flag(args, "--kv-transport", "shm"),
                       kv_cache_bytes=parse_size(kv) if kv else DEFAULT_KV_CACHE_BYTES,
                       disagg=disagg_from_serve_args(args))


def disagg_from_serve_args(args: list[str]) -> DisaggSpec:
    """--disagg-policy and its settings (the rest of serve's flags ignored; the SLO targets are
    auto's only under auto)."""
    policy = _flag(args, "--disagg-policy", "always")

    def number(flag: str, field: str):
        value = _flag(args, flag, None)
        if value is None or (field.startswith("slo") and policy != "auto"):
            return None
        return float(value) if field.startswith("slo") else int(value)
    return DisaggSpec(policy, *(number(flag, field) for flag, field in DISAGG_FLAGS))


def requests_from_spec(spec: TrialSpec) -> list[SimRequest]:
    """The requests a trial of `spec` plans (trial/workload.spec_shapes: the same draws, so the
    same classes, send times and lengths as the trial's plan)."""
    out = [SimRequest(s.index, s.send_at_s, s.num_prompt_tokens, s.max_tokens, s.class_name, s.priority or 0)
           for s in spec_shapes(spec)]
    if not out:
        raise ValueError("the spec's arrivals produced no requests; lengthen duration_s or raise rate")
    return out


def requests_from_results(doc: dict) -> list[SimRequest]:
    """A trial's exact plan (results.json `plan`): send times, classes, lengths and (from each
    class) priorities."""
    priority = class_priorities(doc)
    return [SimRequest(p["index"], p["send_at_s"], p["num_prompt_tokens"], p["max_tokens"], p["class"],
                       priority.get(p["class"], 0)) for p in doc["plan"]]


def class_priorities(doc: dict) -> dict[str, int]:
    """Each class's priority in a results.json (0 where it sets none, as the server defaults)."""
    return {name: c.get("priority") or 0 for name, c in (doc.get("classes") or {}).items()}


def tile(requests: list[SimRequest], min_requests: int) -> list[SimRequest]:
    """The workload repeated back to back until it holds at least `min_requests`: a spec written
    for a 2-core box holds too few requests to reach a steady state at a 16-core rate."""
    if len(requests) >= min_requests or len(requests) < 2:
        return requests
    span = max(r.arrival_s for r in requests)
    period = span + span / (len(requests) - 1)  # one mean gap between copies
    copies = -(-min_requests // len(requests))
    return [SimRequest(k * len(requests) + r.index, k * period + r.arrival_s, r.prompt_tokens, r.answer_tokens,
                       r.class_name, r.priority) for k in range(copies) for r in requests]


def offered_rate(requests: list[SimRequest]) -> float:
    last = max(r.arrival_s for r in requests)
    return (len(requests) - 1) / last if last > 0 else float("inf")


def simulate(arrangement: Arrangement, profile: Profile, requests: list[SimRequest],
             rate_multiplier: float = 1.0, max_queued_requests: int = MAX_QUEUED_REQUESTS,
             ) -> tuple[list[SimRequest], list[Instance]]:
    """The arrangement's instances run the requests (their arrival times divided by the
    multiplier); max_queued_requests: the frontend's admission limit per instance, past
    max_num_seqs (serve's --max-queued-requests)."""
    num_blocks = arrangement.kv_cache_bytes // (profile.kv_bytes_per_token * profile.block_size)
    disagg, chunk = None, None
    if arrangement.kind == "separated":
        decode = next(s for s in arrangement.instances if s.role == "decode")
        disagg, chunk = arrangement.disagg.build(decode.budget, profile.block_size, decode.threads, profile.steps)
    # several instances fill the host's cores: their steps as timed beside busy engines, when profiled
    models, contention = profile.instance_models([s.threads for s in arrangement.instances])
    instances = [Instance(f"{s.role}-{i}", s, model, num_blocks, profile.block_size,
                          chunk if s.role == "decode" else None)
                 for i, (s, model) in enumerate(zip(arrangement.instances, models))]
    fresh = [SimRequest(r.index, r.arrival_s / rate_multiplier, r.prompt_tokens, r.answer_tokens, r.class_name,
                        r.priority) for r in requests]
    transport = arrangement.transport
    # the served pass's steps ran beside the serving stack's work: none is added on top of them
    load = 0.0 if profile.serves([s.threads for s in arrangement.instances]) else host_load(profile, fresh)
    sim = Simulation(instances, lambda n: profile.transfer_s(transport, n), contention,
                     max_queued_requests, disagg, load, arrangement.cores)
    return sim.run(fresh), instances


def host_load(profile: Profile, requests: list[SimRequest]) -> float:
    """Cores the profile's host work keeps busy over these requests: their mean rate of requests
    and of streamed tokens over the span they arrive in (0 without host work in the profile)."""
    host = profile.host_work
    if host is None or not requests:
        return 0.0
    first = min(r.arrival_s for r in requests)
    span = max(r.arrival_s for r in requests) - first
    if span <= 0:
        return host.idle_cores
    return host.load(len(requests) / span, sum(r.answer_tokens for r in requests) / span)


def _pct_sorted(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile of an already sorted list."""
    pos, lo, hi = _pct_positions(len(values), q)
    if math.isinf(values[hi]):  # a never-served request is infinitely late: no inf - inf
        return values[hi] if pos > lo else values[lo]
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _pcts(values, qs=(50, 90, 99)) -> dict:
    ordered = sorted(float(v) for v in values)
    return {f"p{q}": (_pct_sorted(ordered, q) if ordered else None) for q in qs}


def _pct_positions(n: int, q: float) -> tuple[float, int, int]:
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    return pos, lo, min(lo + 1, n - 1)


def _gap_scores(requests: list[SimRequest], q: float) -> tuple[np.ndarray, np.ndarray, dict]:
    """Each request's gap percentile `q` and longest gap (0 without gaps), and the p50/p90/p99 of
    every gap: the same numbers as _pct_sorted on sorted lists, from one flat array partitioned
    at the positions read (requests with the same number of gaps as one 2-D array), without a
    Python loop or a full sort over 10,000 requests' gaps."""
    lengths = np.fromiter((len(r.gaps) for r in requests), dtype=np.int64, count=len(requests))
    flat = np.fromiter(itertools.chain.from_iterable(r.gaps for r in requests), dtype=float, count=int(lengths.sum()))
    starts = np.cumsum(lengths) - lengths
    pct, longest = np.zeros(len(requests)), np.zeros(len(requests))
    for length in np.unique(lengths[lengths > 0]).tolist():
        idx = np.flatnonzero(lengths == length)
        pos, lo, hi = _pct_positions(length, q)
        gaps = np.partition(flat[starts[idx, None] + np.arange(length)], sorted({lo, hi, length - 1}), axis=1)
        pct[idx] = gaps[:, lo] + (gaps[:, hi] - gaps[:, lo]) * (pos - lo)
        longest[idx] = gaps[:, -1]
    every = {}
    if len(flat):
        kth = sorted({i for p in (50, 90, 99) for i in _pct_positions(len(flat), p)[1:]})
        flat = np.partition(flat, kth)
        for p in (50, 90, 99):
            pos, lo, hi = _pct_positions(len(flat), p)
            every[f"p{p}"] = float(flat[lo] + (flat[hi] - flat[lo]) * (pos - lo))
    else:
        every = {"p50": None, "p90": None, "p99": None}
    return pct, longest, every


def _deadlines(requests: list[SimRequest], slo: SLO, class_slos: dict[str, SLO] | None) -> dict[str, np.ndarray]:
    """Each request's deadlines under its class's SLO (the global one where its class sets none);
    a deadline of None is not checked (infinite), as trial/metrics.py judges it."""
    own = [(class_slos or {}).get(r.class_name, slo) for r in requests]
    def col(name):
        return np.asarray([math.inf if getattr(s, name) is None else getattr(s, name) for s in own], dtype=float)
    return {name: col(name) for name in ("ttft_s", "gap_s", "max_pause_s", "e2e_s")}


def score(requests: list[SimRequest], instances: list[Instance], slo: SLO,
          class_slos: dict[str, SLO] | None = None) -> dict:
    inf = math.inf
    # a request the simulated cache could never admit never starts: it misses every deadline
    ttft = [r.first_s - r.arrival_s if r.first_s is not None else inf for r in requests]
    e2e = [r.finished_s - r.arrival_s if r.finished_s is not None else inf for r in requests]
    gap_pct, longest, all_gaps = _gap_scores(requests, slo.gap_percentile)
    limit = _deadlines(requests, slo, class_slos)
    checks = {"TTFT": np.asarray(ttft) <= limit["ttft_s"], "inter-token gap": gap_pct <= limit["gap_s"],
              "longest pause": longest <= limit["max_pause_s"], "end-to-end time": np.asarray(e2e) <= limit["e2e_s"]}
    misses = {name: int((~ok).sum()) for name, ok in checks.items()}
    good = np.logical_and.reduce(list(checks.values())).tolist()
    gap_pct, longest = gap_pct.tolist(), longest.tolist()
    duration = max((r.finished_s for r in requests if r.finished_s is not None), default=0.0)
    by_class = {}
    for name in sorted({r.class_name for r in requests}):
        idx = [i for i, r in enumerate(requests) if r.class_name == name]
        by_class[name] = {"num_requests": len(idx), "attainment": sum(good[i] for i in idx) / len(idx),
                          "ttft_s": _pcts([ttft[i] for i in idx]),
                          "prefill": prefill_counts([requests[i] for i in idx])}
    return {"num_requests": len(requests), "attainment": sum(good) / len(requests),
            "goodput_rps": sum(good) / duration if duration > 0 else 0.0, "duration_s": duration,
            "ttft_s": _pcts(ttft), "gap_s": all_gaps, "e2e_s": _pcts(e2e),
            "longest_pause_s": {**_pcts(longest), "max": max(longest)}, "by_class": by_class,
            "prefill": prefill_counts(requests),  # where the disaggregation policy put each prompt
            "utilization": {i.name: round(i.busy_s / duration, 3) if duration > 0 else 0.0 for i in instances},
            "num_preemptions": sum(i.num_preemptions for i in instances),
            "missed": {k: v / len(requests) for k, v in misses.items()},
            # how close the p99 request comes to its deadlines (1.0 = at the limit): the tie-breaker
            "slo_usage_p99": max(_pct_sorted(sorted(ttft), 99) / slo.ttft_s,
                                 _pct_sorted(sorted(gap_pct), 99) / slo.gap_s,
                                 _pct_sorted(sorted(longest), 99) / slo.max_pause_s),
            "worst_slo": max(misses, key=misses.get) if any(misses.values()) else None}


def predict(arrangement: Arrangement, profile: Profile, requests: list[SimRequest], slo: SLO,
            rate_multiplier: float = 1.0, class_slos: dict[str, SLO] | None = None) -> dict:
    done, instances = simulate(arrangement, profile, requests, rate_multiplier)
    return score(done, instances, slo, class_slos)


def capacity(arrangement: Arrangement, profile: Profile, requests: list[SimRequest], slo: SLO,
             target: float, first: float = 1.0, steps: int = 6, max_multiplier: float = 16.0,
             class_slos: dict[str, SLO] | None = None, workload=None) -> float | None:
    """The highest rate multiplier whose attainment meets `target` (bracket by doubling, then bisect).
    Like the trial's sweep, it compresses the same finite workload: a handful of requests can be
    absorbed at any rate, so the search stops at `max_multiplier` (a result equal to it is a floor).
    `workload(m)`, when given, is the request list replayed at multiplier m, its times already
    compressed (a trial's capacity probe replays more of the plan at higher rates)."""
    def ok(m: float) -> bool:
        if workload is not None:
            return predict(arrangement, profile, workload(m), slo, 1.0, class_slos)["attainment"] >= target
        return predict(arrangement, profile, requests, slo, m, class_slos)["attainment"] >= target
    lo, hi = (first, None) if ok(first) else (None, first)
    while lo is None:
        hi /= 2
        if hi < 1 / max_multiplier:
            return None
        lo = hi if ok(hi) else None
    if hi is None:
        hi = min(lo * 2, max_multiplier)
        while hi > lo and ok(hi):
            if hi >= max_multiplier:
                return max_multiplier
            lo, hi = hi, min(hi * 2, max_multiplier)
        if hi <= lo:
            return lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def name_of(instances: tuple[InstanceSpec, ...], disagg_policy: str = "always") -> str:
    """colocated-chunked256-2x1t, colocated-whole-1x2t, 1P1D-1t/1t (prefill threads / decode threads),
    1P1D-1t/1t-auto (its prompts placed by `--disagg-policy auto`)."""
    if all(i.role == "colocated" for i in instances):
        first = instances[0]
        policy = f"chunked{first.budget}" if first.policy == "chunked" else "whole"
        return f"colocated-{policy}-{len(instances)}x{first.threads}t"
    p = [i for i in instances if i.role == "prefill"]
    d = [i for i in instances if i.role == "decode"]
    policy = "" if disagg_policy == "always" else f"-{disagg_policy}"
    return f"{len(p)}P{len(d)}D-{p[0].threads}t/{d[0].threads}t{policy}"

