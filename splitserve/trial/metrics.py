"""From each request's timeline to the numbers a buyer compares.

A `RequestRecord` is what the load generator saw: when the request was due, when it was
sent, when each token arrived (seconds after the trial's start), how it ended. Everything
here is a pure function of records, so every metric can be checked on hand-made timelines.

Definitions (also in docs/benchmarks.md):
- TTFT: first token arrival - send time. Client lag: send time - scheduled time.
- inter-token gaps: differences of consecutive token arrival times; TPOT: (last - first) / (n - 1).
- a stream that froze and then failed (timed out, was cut) has one more gap: from its last
  token to the failure. A frozen stream is the worst pause a user sees.
- a pause is a gap longer than the pause threshold; time stalled sums those whole gaps.
- a request is *complete* if it ended without error with every token it asked for, and *good*
  if it is complete and meets every SLO: TTFT, its own gap percentile, its longest gap, end-to-end.
- TTFT percentiles count a request that failed before its first token as infinitely late, so an
  arrangement cannot improve its TTFT by failing its slowest requests.
- attainment: good / all requests; goodput: attainment x offered rate, where the offered rate
  is (requests - 1) / scheduled span of the arrivals: the same denominator for every arrangement
  replaying the same plan (a drowned arrangement's long makespan must not lower its goodput).
- per class: each request is judged by its class's SLO (the global one where the class sets
  none); a deadline that is None is not checked. A request whose client gave up (its class's
  patience) is "abandoned": a failure of its own kind, apart from server errors and timeouts.
- recovered: requests retried on another instance or whose KV transfer failed and was
  recomputed, but which completed; counted apart from terminal failures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from splitserve.trial.spec import SLO

FAILURE_KINDS = ("http_error", "timeout", "connection_error", "cancelled", "truncated",
                 "probe_stopped", "abandoned")
FROZEN_FAILURES = ("timeout", "cancelled", "connection_error", "probe_stopped")  # ended mid-stream
KV_OK_OUTCOMES = ("ok", "success")


@dataclass(slots=True)
class RequestRecord:
    index: int
    class_name: str
    num_prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_tokens: int = 0                      # the server's count (usage) when it gives one
    finished_s: float | None = None
    finish_reason: str | None = None
    error_kind: str | None = None            # http_error | timeout | connection_error | cancelled
    error_message: str | None = None
    http_status: int | None = None
    kv_transfer: dict | None = None          # {bytes, seconds, outcome, retries} from the server
    retries: int = 0
    token_timing: str = "chunk"              # "token": the server named each chunk's token ids
    prefill: str | None = None               # "local" (on its decode instance) | "remote", from the server


@dataclass(slots=True)
class RequestMetrics:
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    gap_percentile_s: float
    longest_pause_s: float
    num_pauses: int
    stalled_s: float
    client_lag_s: float
    failure: str | None
    kv_failed: bool

    @property
    def complete(self) -> bool:
        return self.failure is None


def percentile(values, q: float) -> float | None:
    values = np.asarray(list(values), dtype=float)
    return float(np.percentile(values, q)) if values.size else None


def stream_gaps(rec: RequestRecord) -> np.ndarray:
    """Inter-token gaps, plus the freeze from the last token to a mid-stream failure."""
    times = list(rec.token_times_s)
    if times and rec.error_kind in FROZEN_FAILURES and rec.finished_s is not None and rec.finished_s > times[-1]:
        times.append(rec.finished_s)
    return np.diff(times) if len(times) > 1 else np.zeros(0)  # [num_gaps]


def slo_of(rec: RequestRecord, slo: SLO, class_slos: dict[str, SLO] | None) -> SLO:
    return (class_slos or {}).get(rec.class_name, slo)


def request_metrics(rec: RequestRecord, slo: SLO, pause_threshold_s: float) -> RequestMetrics:
    times = rec.token_times_s
    gaps = stream_gaps(rec)
    sent = rec.sent_s if rec.sent_s is not None else rec.scheduled_s
    end = times[-1] if times else rec.finished_s
    pauses = gaps[gaps > pause_threshold_s]
    kv_failed = bool(rec.kv_transfer) and str(rec.kv_transfer.get("outcome", "ok")) not in KV_OK_OUTCOMES
    failure = rec.error_kind
    if failure is None and max(rec.num_tokens, len(times)) < rec.max_tokens:
        failure = "truncated"
    return RequestMetrics(
        ttft_s=times[0] - sent if times else None,
        tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        e2e_s=end - sent if end is not None and rec.sent_s is not None else None,  # never sent: no e2e
        gap_percentile_s=float(np.percentile(gaps, slo.gap_percentile)) if gaps.size else 0.0,
        longest_pause_s=float(gaps.max()) if gaps.size else 0.0,
        num_pauses=int(pauses.size),
        stalled_s=float(pauses.sum()),
        client_lag_s=sent - rec.scheduled_s,
        failure=failure,
        kv_failed=kv_failed)


def _within(value: float | None, limit: float | None) -> bool:
    return limit is None or (value is not None and value <= limit)


def is_good(m: RequestMetrics, slo: SLO) -> bool:
    return (m.complete and m.ttft_s is not None and m.e2e_s is not None and _within(m.ttft_s, slo.ttft_s)
            and _within(m.gap_percentile_s, slo.gap_s) and _within(m.longest_pause_s, slo.max_pause_s)
            and _within(m.e2e_s, slo.e2e_s))


def abandoned_work(records: list[RequestRecord]) -> dict:
    """What the server spent on requests whose client gave up, as the client saw it: their prompt
    tokens (prefilled, when a first token came back; at most prefilled, when none did) and the
    answer tokens it received before disconnecting (decoded; the server may have decoded a few more)."""
    gone = [r for r in records if r.error_kind == "abandoned"]
    started = [r for r in gone if r.token_times_s]
    return {"num_requests": len(gone),
            "prompt_tokens_prefilled": sum(r.num_prompt_tokens for r in started),
            "prompt_tokens_maybe_prefilled": sum(r.num_prompt_tokens for r in gone if not r.token_times_s),
            "tokens_decoded": sum(max(r.num_tokens, len(r.token_times_s)) for r in gone),
            "source": "client"}


def server_aborted_work(counters: dict) -> dict | None:
    """The server's own count of the work spent on aborted requests (splitserve's /metrics), from
    the counters' change over a run; None for a server that does not expose it."""
    keys = {kind: f'splitserve_aborted_tokens_total{{kind="{kind}"}}' for kind in ("prompt", "generated")}
    if not any(k in counters for k in keys.values()):
        return None
    return {"prompt_tokens_prefilled": counters.get(keys["prompt"], 0.0),
            "tokens_decoded": counters.get(keys["generated"], 0.0)}


def _pcts(values, qs=(50, 90, 99)) -> dict:
    return {f"p{q}": percentile(values, q) for q in qs}


def failed_as_infinite(values: list[float], num_failed: int, qs=(50, 90, 99)) -> dict:
    """Percentiles with `num_failed` values at +infinity: a request that never got its first token
    is later than any that did. Interpolating towards infinity gives infinity, never NaN."""
    pool = sorted(values) + [float("inf")] * num_failed
    out = {}
    for q in qs:
        if not pool:
            out[f"p{q}"] = None
            continue
        with np.errstate(invalid="ignore"):
            v = float(np.percentile(pool, q))
        out[f"p{q}"] = float("inf") if np.isnan(v) else v
    out["num_failed"] = num_failed
    return out


def scheduled_span(records: list[RequestRecord]) -> float:
    times = [r.scheduled_s for r in records]
    return max(times) - min(times) if times else 0.0


def offered_rate(records: list[RequestRecord]) -> float | None:
    span = scheduled_span(records)
    return (len(records) - 1) / span if span > 0 else None


def _group(records, per, good, idx: list[int], span: float | None = None) -> dict:
    failures: dict[str, int] = {}
    for i in idx:
        if per[i].failure is not None:
            failures[per[i].failure] = failures.get(per[i].failure, 0) + 1
    complete = [i for i in idx if per[i].complete]
    return {
        "num_requests": len(idx),
        "attainment": sum(good[i] for i in idx) / len(idx) if idx else 0.0,
        "num_good": int(sum(good[i] for i in idx)),
        # good requests per second of the plan's span: the class's share of the goodput
        **({"goodput_rps": sum(good[i] for i in idx) / span} if span else {}),
        "ttft_s": failed_as_infinite([per[i].ttft_s for i in idx if per[i].ttft_s is not None],
                                     sum(per[i].ttft_s is None and not per[i].complete for i in idx)),
        "longest_pause_s": _pcts([per[i].longest_pause_s for i in idx]),
        "failures": failures,
        # completed, but only after the server recovered them: not failures, not invisible either
        "recovered": {"retried": sum(records[i].retries > 0 for i in complete),
                      "kv_recomputed": sum(per[i].kv_failed for i in complete)},
        "prefill": prefill_counts([records[i] for i in idx]),
    }


def prefill_counts(records: list[RequestRecord]) -> dict:
    """Where the server said each prompt was prefilled; a request it said nothing about (colocated,
    `--disagg-policy always`, or failed before routing) is counted in neither."""
    return {"local": sum(r.prefill == "local" for r in records),
            "remote": sum(r.prefill == "remote" for r in records)}


def local_share(counts: dict | None) -> float | None:
    """The share of reported prompts prefilled locally; None when no request reported a placement."""
    if not counts:
        return None
    total = counts.get("local", 0) + counts.get("remote", 0)
    return counts["local"] / total if total else None


def summarize(records: list[RequestRecord], slo: SLO, pause_threshold_s: float,
              slo_scales=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0),
              phase_starts_s: list[float] | None = None, class_slos: dict[str, SLO] | None = None) -> dict:
    """Every number the report shows for one arrangement, as plain JSON-ready data.
    phase_starts_s: when each phase of a `phases` spec starts (in the records' time), for
    attainment per phase. class_slos: each class's own SLO (`slo` judges the classes it lacks)."""
    slos = [slo_of(r, slo, class_slos) for r in records]
    per = [request_metrics(r, s, pause_threshold_s) for r, s in zip(records, slos)]
    good = [is_good(m, s) for m, s in zip(per, slos)]
    rate = offered_rate(records)
    ends = [r.token_times_s[-1] if r.token_times_s else (r.finished_s or r.scheduled_s) for r in records]
    all_gaps = [g for r in records for g in stream_gaps(r)]
    streams = [m for r, m in zip(records, per) if len(r.token_times_s) > 1]
    overall = _group(records, per, good, list(range(len(records))))
    failures = {kind: 0 for kind in FAILURE_KINDS} | overall["failures"]
    kv = [r.kv_transfer for r in records if r.kv_transfer]
    span = scheduled_span(records) * len(records) / (len(records) - 1) if len(records) > 1 else None
    by_class = {name: _group(records, per, good, [i for i, r in enumerate(records) if r.class_name == name],
                             span)
                for name in sorted({r.class_name for r in records})}
    by_phase = []
    if phase_starts_s:
        bounds = list(phase_starts_s) + [float("inf")]
        for n, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            idx = [i for i, r in enumerate(records) if lo <= r.scheduled_s < hi]
            by_phase.append({"phase": n, "start_s": lo, **_group(records, per, good, idx)})
    attainment = sum(good) / len(records) if records else 0.0
    timed = [r.token_timing for r in records if r.token_times_s]
    return {
        "num_requests": len(records),
        "num_good": int(sum(good)),
        "num_complete": sum(m.complete for m in per),
        "attainment": attainment,
        "offered_rate_rps": rate,
        "goodput_rps": attainment * rate if rate is not None else 0.0,
        "duration_s": scheduled_span(records),
        "makespan_s": max(ends, default=0.0),
        "token_timing": "token" if timed and all(t == "token" for t in timed) else "chunk",
        "ttft_s": overall["ttft_s"],
        "tpot_s": _pcts([m.tpot_s for m in per if m.tpot_s is not None]),
        "gap_s": _pcts(all_gaps, (50, 90, 99, 99.9)),
        "e2e_s": _pcts([m.e2e_s for m in per if m.e2e_s is not None]),
        "longest_pause_s": {**_pcts([m.longest_pause_s for m in per]),
                            "max": max((m.longest_pause_s for m in per), default=None)},
        "pauses_per_request": sum(m.num_pauses for m in per) / len(per) if per else 0.0,
        "stalled_s_total": sum(m.stalled_s for m in per),
        "interrupted_share": (sum(m.num_pauses > 0 for m in streams) / len(streams)) if streams else 0.0,
        "client_lag_s": {**_pcts([m.client_lag_s for m in per]),
                         "max": max((m.client_lag_s for m in per), default=None)},
        "failures": failures,
        "recovered": overall["recovered"],
        "retries": sum(r.retries for r in records),
        "kv_transfer": {"num_reports": len(kv),
                        "bytes": sum(int(k.get("bytes", 0)) for k in kv),
                        "seconds": sum(float(k.get("seconds", 0.0)) for k in kv),
                        "retries": sum(int(k.get("retries", 0)) for k in kv),
                        "failed": sum(m.kv_failed for m in per)},
        "by_class": by_class,
        "by_phase": by_phase,
        "abandoned_work": abandoned_work(records),
        "attainment_vs_slo_scale": [
            {"scale": k, "attainment": (sum(is_good(m, s.scaled(k)) for m, s in zip(per, slos)) / len(per))
             if per else 0.0}
            for k in slo_scales],
        "per_request": [{"index": r.index, "good": g, "ttft_s": m.ttft_s, "tpot_s": m.tpot_s,
                         "e2e_s": m.e2e_s, "longest_pause_s": m.longest_pause_s,
                         "num_pauses": m.num_pauses, "stalled_s": m.stalled_s,
                         "client_lag_s": m.client_lag_s, "failure": m.failure}
                        for r, m, g in zip(records, per, good)],
    }
