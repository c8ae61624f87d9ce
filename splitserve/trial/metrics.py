"""From each request's timeline to the numbers a buyer compares.

A `RequestRecord` is what the load generator saw: when the request was due, when it was
sent, when each token arrived (seconds after the trial's start), how it ended. Everything
here is a pure function of records, so every metric can be checked on hand-made timelines.

Definitions (also in docs/benchmarks.md):
- TTFT: first token arrival - send time. Client lag: send time - scheduled time.
- inter-token gaps: differences of consecutive token arrival times; TPOT: (last - first) / (n - 1).
- a pause is a gap longer than the pause threshold; time stalled sums those whole gaps.
- a request is *complete* if it ended without error with every token it asked for, and *good*
  if it is complete and meets every SLO: TTFT, its own gap percentile, its longest gap, end-to-end.
- attainment: good / all requests; goodput: good / trial duration (start to last finish).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from splitserve.trial.spec import SLO

FAILURE_KINDS = ("http_error", "timeout", "connection_error", "cancelled", "truncated",
                 "kv_transfer_failed")
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


def request_metrics(rec: RequestRecord, slo: SLO, pause_threshold_s: float) -> RequestMetrics:
    times = rec.token_times_s
    gaps = np.diff(times) if len(times) > 1 else np.zeros(0)  # [num_tokens - 1]
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
        e2e_s=end - sent if end is not None else None,
        gap_percentile_s=float(np.percentile(gaps, slo.gap_percentile)) if gaps.size else 0.0,
        longest_pause_s=float(gaps.max()) if gaps.size else 0.0,
        num_pauses=int(pauses.size),
        stalled_s=float(pauses.sum()),
        client_lag_s=sent - rec.scheduled_s,
        failure=failure,
        kv_failed=kv_failed)


def is_good(m: RequestMetrics, slo: SLO) -> bool:
    return (m.complete and m.ttft_s is not None and m.ttft_s <= slo.ttft_s
            and m.gap_percentile_s <= slo.gap_s and m.longest_pause_s <= slo.max_pause_s
            and m.e2e_s is not None and m.e2e_s <= slo.e2e_s)


def _pcts(values, qs=(50, 90, 99)) -> dict:
    return {f"p{q}": percentile(values, q) for q in qs}


def summarize(records: list[RequestRecord], slo: SLO, pause_threshold_s: float,
              slo_scales=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)) -> dict:
    """Every number the report shows for one arrangement, as plain JSON-ready data."""
    per = [request_metrics(r, slo, pause_threshold_s) for r in records]
    good = [is_good(m, slo) for m in per]
    ends = [r.token_times_s[-1] if r.token_times_s else (r.finished_s or r.scheduled_s) for r in records]
    duration = max(ends + [r.scheduled_s for r in records], default=0.0)
    all_gaps = [g for r in records for g in np.diff(r.token_times_s)]
    streams = [m for r, m in zip(records, per) if len(r.token_times_s) > 1]
    failures = {kind: 0 for kind in FAILURE_KINDS}
    for m in per:
        if m.failure is not None:
            failures[m.failure] = failures.get(m.failure, 0) + 1
        if m.kv_failed:
            failures["kv_transfer_failed"] += 1
    kv = [r.kv_transfer for r in records if r.kv_transfer]
    by_class = {}
    for name in sorted({r.class_name for r in records}):
        idx = [i for i, r in enumerate(records) if r.class_name == name]
        by_class[name] = {
            "num_requests": len(idx),
            "attainment": sum(good[i] for i in idx) / len(idx),
            "ttft_s": _pcts([per[i].ttft_s for i in idx if per[i].ttft_s is not None]),
            "longest_pause_s": _pcts([per[i].longest_pause_s for i in idx])}
    return {
        "num_requests": len(records),
        "num_good": int(sum(good)),
        "num_complete": sum(m.complete for m in per),
        "attainment": sum(good) / len(records) if records else 0.0,
        "goodput_rps": sum(good) / duration if duration > 0 else 0.0,
        "duration_s": duration,
        "ttft_s": _pcts([m.ttft_s for m in per if m.ttft_s is not None]),
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
        "retries": sum(r.retries for r in records),
        "kv_transfer": {"num_reports": len(kv),
                        "bytes": sum(int(k.get("bytes", 0)) for k in kv),
                        "seconds": sum(float(k.get("seconds", 0.0)) for k in kv),
                        "retries": sum(int(k.get("retries", 0)) for k in kv)},
        "by_class": by_class,
        "attainment_vs_slo_scale": [
            {"scale": s, "attainment": (sum(is_good(m, slo.scaled(s)) for m in per) / len(per)) if per else 0.0}
            for s in slo_scales],
        "per_request": [{"index": r.index, "good": g, "ttft_s": m.ttft_s, "tpot_s": m.tpot_s,
                         "e2e_s": m.e2e_s, "longest_pause_s": m.longest_pause_s,
                         "num_pauses": m.num_pauses, "stalled_s": m.stalled_s,
                         "client_lag_s": m.client_lag_s, "failure": m.failure}
                        for r, m, g in zip(records, per, good)],
    }
