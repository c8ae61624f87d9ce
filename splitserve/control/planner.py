"""Plan before buying: every arrangement that fits N cores, simulated on one workload, ranked.

Arrangements (as DistServe searches placements and Dynamo sizes pools from a profile):
  colocated  k instances x t threads (k * t = N), whole prefill or chunked with each budget;
  separated  x prefill instances of tp threads + y decode instances of td threads
             (x * tp + y * td = N; thread counts that divide N or are powers of two), once per
             disaggregation policy asked for (serve --disagg-policy; 1P1D-1t/1t-auto).
Each is simulated at the spec's rate (times a multiplier) and scored with the spec's SLOs;
its capacity is the highest rate at which attainment still meets the target. The ranking
puts arrangements that meet the target first, by capacity, then the rest by attainment.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.control.predict import (DEFAULT_KV_CACHE_BYTES, Arrangement, DisaggSpec, capacity, name_of,
                                        offered_rate, predict)
from splitserve.control.profile_file import SPEED_BAND_ENDS, Profile
from splitserve.control.simulator import InstanceSpec, SimRequest
from splitserve.trial.spec import SLO

DEFAULT_BUDGETS = (64, 128, 256, 512, 1024)
MAX_INSTANCES = 64
NEAR_TIE = 0.10  # capacities closer than this are not told apart (published simulators: 3-12% error)
CAPACITY_HEADROOM = 8.0  # capacity searches stop at this many times the planned rate (see predict.capacity)


def thread_options(cores: int) -> list[int]:
    return sorted({t for t in range(1, cores + 1) if cores % t == 0 or t & (t - 1) == 0})


def enumerate_arrangements(cores: int, budgets=DEFAULT_BUDGETS, transport: str = "shm",
                           max_instances: int = MAX_INSTANCES, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                           prefill_budget: int = 256, threads: list[int] | None = None,
                           kv_total_bytes: int | None = None,
                           disagg: tuple[DisaggSpec, ...] = (DisaggSpec(),)) -> list[Arrangement]:
    """threads: the per-instance thread counts to consider (default: divisors of `cores` and powers of two).
    kv_total_bytes: one KV pool per arrangement split between its instances (the trial's
    `kv_cache_memory`), instead of kv_cache_bytes for every instance. disagg: the policies each
    separated arrangement is tried with."""

    def kv(instances: tuple) -> int:
        return kv_total_bytes // len(instances) if kv_total_bytes else kv_cache_bytes

    if cores < 1:
        raise ValueError(f"--cores: must be >= 1, got {cores}")
    if not budgets or any(b < 1 for b in budgets):
        raise ValueError(f"--budgets: token budgets must be >= 1, got {list(budgets)}")
    options = thread_options(cores) if not threads else sorted(t for t in set(threads) if 1 <= t <= cores)
    if not options:
        raise ValueError(f"--threads: no per-instance thread count in {threads} fits {cores} cores")
    out = []
    for t in (t for t in options if cores % t == 0):
        k = cores // t
        if k > max_instances:
            continue
        for policy, budget in [("whole", 256)] + [("chunked", b) for b in budgets]:
            instances = (InstanceSpec("colocated", t, policy, budget),) * k
            out.append(Arrangement(name_of(instances), instances, transport, kv(instances)))
    for tp in options:
        for td in options:
            for x in range(1, cores // tp + 1):
                rest = cores - x * tp
                if rest < td or rest % td or x + rest // td > max_instances:
                    continue
                instances = ((InstanceSpec("prefill", tp, "chunked", prefill_budget),) * x
                             + (InstanceSpec("decode", td, "chunked", prefill_budget),) * (rest // td))
                out += [Arrangement(name_of(instances, d.policy), instances, transport, kv(instances), d)
                        for d in disagg]
    return out


@dataclass(slots=True)
class Candidate:
    arrangement: Arrangement
    predicted: dict
    capacity_multiplier: float | None = None

    @property
    def attainment(self) -> float:
        return self.predicted["attainment"]


def evaluate(arrangements: list[Arrangement], profile: Profile, requests: list[SimRequest], slo: SLO,
             target: float, rate_multiplier: float = 1.0, with_capacity: bool = True,
             class_slos: dict[str, SLO] | None = None) -> list[Candidate]:
    """class_slos: each request class's own deadlines (the spec's `slo:` per class), as the trial
    judges them; `slo` judges the classes without one."""
    out = []
    for arr in arrangements:
        cand = Candidate(arr, predict(arr, profile, requests, slo, rate_multiplier, class_slos))
        if with_capacity:
            cand.capacity_multiplier = capacity(arr, profile, requests, slo, target, first=rate_multiplier,
                                                steps=5, max_multiplier=CAPACITY_HEADROOM * rate_multiplier,
                                                class_slos=class_slos)
        out.append(cand)
    return rank(out, target)


def rank(candidates: list[Candidate], target: float) -> list[Candidate]:
    def key(c: Candidate):
        passes = c.attainment >= target
        return (passes, round((c.capacity_multiplier or 0.0) if passes else c.attainment, 6), c.attainment,
                -c.predicted["slo_usage_p99"], -c.arrangement.cores, -len(c.arrangement.instances))
    return sorted(candidates, key=key, reverse=True)


def speed_band_capacities(ranked: list[Candidate], profile: Profile, requests: list[SimRequest], slo: SLO,
                          target: float, rate_multiplier: float = 1.0,
                          class_slos: dict[str, SLO] | None = None) -> dict[str, dict]:
    """The pick's and the best other-kind arrangement's capacity (rate multipliers) again with every
    step as slow as the profile's watched step ran at its 90th percentile and as fast as at its
    10th (profile_file.speed_band): what the same plan predicts at the slow and the fast minutes
    the profile saw. Not an interval of the prediction's error; the host's drift alone. {} without
    a band or capacities."""
    band = profile.speed_band
    if not band or not ranked or ranked[0].capacity_multiplier is None:
        return {}
    best = ranked[0]
    other = _best(ranked, "separated" if best.arrangement.kind == "colocated" else "colocated")
    out = {}
    for c in (best, other):
        if c is None or c.capacity_multiplier is None:
            continue
        out[c.arrangement.name] = {
            end: capacity(c.arrangement, profile.slowed(band[q]), requests, slo, target, first=c.capacity_multiplier,
                          steps=5, max_multiplier=CAPACITY_HEADROOM * rate_multiplier, class_slos=class_slos)
            for end, q in SPEED_BAND_ENDS if end != "median"}
    return out


def _band_sentence(name: str, band: dict | None, caps: dict | None, base_rate: float) -> str:
    if not band or not caps:
        return ""

    def rps(m):
        return "nothing" if m is None else f"{m * base_rate:.2f} req/s"
    return (f"At the speeds the profile's watched step ran ({band['readings']} readings over {band['span_s']:.0f} s: "
            f"x{band['p10']:.2f}-x{band['p90']:.2f} the step model, median x{band['p50']:.2f}), {name}'s capacity "
            f"would be {rps(caps['slow'])} at the slow end and {rps(caps['fast'])} at the fast end.")


def _is_floor(c: Candidate, rate_multiplier: float) -> bool:
    return c.capacity_multiplier is not None and c.capacity_multiplier >= CAPACITY_HEADROOM * rate_multiplier


def _best(candidates: list[Candidate], kind: str) -> Candidate | None:
    return next((c for c in candidates if c.arrangement.kind == kind), None)


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def recommendation(ranked: list[Candidate], target: float, base_rate: float, rate_multiplier: float,
                   band: dict | None = None, band_caps: dict | None = None) -> dict:
    best = ranked[0]
    rate = base_rate * rate_multiplier
    p = best.predicted
    parts = [f"{best.arrangement.name} ({' '.join(best.arrangement.serve_args())})"]
    if best.attainment >= target:
        cap = best.capacity_multiplier
        parts.append(f"meets every deadline for {best.attainment:.0%} of requests at {rate:.2f} req/s "
                     f"(target {target:.0%})"
                     + (f" and keeps meeting the target up to {'at least' if _is_floor(best, rate_multiplier) else 'about'}"
                        f" {cap * base_rate:.2f} req/s "
                        f"({cap / rate_multiplier:.1f}x this rate)" if cap else ""))
    else:
        parts.append(f"comes closest but misses the target: {best.attainment:.0%} of requests meet every "
                     f"deadline at {rate:.2f} req/s (target {target:.0%}); no arrangement of these cores "
                     "meets it at this rate")
    reason = [f"Recommended: {parts[0]}: it {parts[1]}."]
    if not best.arrangement.launchable_with_serve:
        reason.append("Its prefill and decode instances use different thread counts, which `splitserve serve` "
                      "cannot launch alone (one --threads-per-instance): start the engines with `splitserve "
                      "engine --threads-per-instance N` and a --topology file.")
    colo, sep = _best(ranked, "colocated"), _best(ranked, "separated")
    other = sep if best.arrangement.kind == "colocated" else colo
    if other is not None:
        o = other.predicted
        why = (f"The best {other.arrangement.kind} arrangement, {other.arrangement.name}, predicts "
               f"{other.attainment:.0%} (TTFT p99 {_fmt_s(o['ttft_s']['p99'])}, longest pause p99 "
               f"{_fmt_s(o['longest_pause_s']['p99'])}, capacity "
               f"{'>= ' if _is_floor(other, rate_multiplier) else ''}{(other.capacity_multiplier or 0) * base_rate:.2f}"
               " req/s) against "
               f"TTFT p99 {_fmt_s(p['ttft_s']['p99'])} and longest pause p99 {_fmt_s(p['longest_pause_s']['p99'])}")
        if o.get("worst_slo"):
            why += f"; it misses mostly on {o['worst_slo']}"
        reason.append(why + ".")
    if len(ranked) > 1 and best.capacity_multiplier and ranked[1].capacity_multiplier:
        runner = ranked[1]
        gap = best.capacity_multiplier / runner.capacity_multiplier - 1
        if gap < NEAR_TIE and runner.attainment >= target:
            reason.append(f"The runner-up, {runner.arrangement.name}, is within {gap:.0%} on capacity: closer than "
                          f"the model's error (about {NEAR_TIE:.0%}), so run a trial of both before choosing.")
    sentence = _band_sentence(best.arrangement.name, band, (band_caps or {}).get(best.arrangement.name), base_rate)
    if sentence:
        reason.append(sentence)
    busiest = max(p["utilization"].items(), key=lambda kv: kv[1], default=None)
    if busiest:
        reason.append(f"Busiest instance of {best.arrangement.name}: {busiest[0]} at {busiest[1]:.0%}.")
    return {"name": best.arrangement.name, "serve_args": best.arrangement.serve_args(), "reason": " ".join(reason)}


def plan_document(ranked: list[Candidate], profile: Profile, requests: list[SimRequest], slo: SLO, target: float,
                  rate_multiplier: float, cores: int, spec_name: str, spec_path: str | None,
                  band_caps: dict | None = None) -> dict:
    """band_caps: speed_band_capacities' answer (rate multipliers at the profile's slow and fast ends)."""
    base = offered_rate(requests)
    band_caps = band_caps or {}
    return {
        "format": "splitserve-plan/1", "spec": spec_name, "spec_path": spec_path, "cores": cores,
        "num_requests": len(requests), "rate_multiplier": rate_multiplier,
        "spec_rate_rps": base, "rate_rps": base * rate_multiplier, "target_attainment": target,
        "slo": {"ttft_s": slo.ttft_s, "gap_s": slo.gap_s, "gap_percentile": slo.gap_percentile,
                "max_pause_s": slo.max_pause_s, "e2e_s": slo.e2e_s},
        "arrangements": [{**c.arrangement.describe(), "predicted": c.predicted,
                          "capacity_multiplier": c.capacity_multiplier,
                          "capacity_rps": c.capacity_multiplier * base if c.capacity_multiplier else None,
                          "capacity_is_floor": _is_floor(c, rate_multiplier),
                          **({"capacity_band_rps": {end: m * base if m else None
                                                    for end, m in band_caps[c.arrangement.name].items()}}
                             if c.arrangement.name in band_caps else {})}
                         for c in ranked],
        "speed_band": profile.speed_band,
        "recommendation": recommendation(ranked, target, base, rate_multiplier, profile.speed_band, band_caps),
        "step_times_beside_neighbours": profile.contention_note(
            sorted({i.threads for c in ranked if len(c.arrangement.instances) > 1 for i in c.arrangement.instances})),
        "host_work": (f"the serving stack's CPU outside engine steps ({profile.host_work.per_request_s * 1e3:.2f} ms a "
                      f"request, {profile.host_work.per_token_s * 1e3:.3f} ms a streamed token, "
                      f"{profile.host_work.idle_cores:.3f} core idle) is taken from the engines' cores"
                      if profile.host_work else "not profiled: the engines are simulated with all the cores")
                     + ("; arrangements the profile's served pass ran (" + ", ".join(
                         f"{n} x {t} thread(s)" for t, (n, _) in sorted(profile.served.items()))
                        + ") use its steps, which ran beside that work, and none is added" if profile.served else ""),
        "profile": profile.raw,
    }
