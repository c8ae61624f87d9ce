"""Every trial metric on hand-made timelines, with the expected numbers worked out by hand."""
import pytest

from splitserve.trial.metrics import RequestRecord, is_good, request_metrics, summarize
from splitserve.trial.spec import SLO

SLO_ = SLO(ttft_s=1.0, gap_s=0.8, e2e_s=5.0, max_pause_s=1.0, gap_percentile=99)
THRESHOLD = 0.3


def rec(index, sent, times, max_tokens, scheduled=None, **kw):
    return RequestRecord(index=index, class_name=kw.pop("class_name", "chat"), num_prompt_tokens=10,
                         max_tokens=max_tokens, scheduled_s=sent if scheduled is None else scheduled,
                         sent_s=sent, token_times_s=list(times), num_tokens=kw.pop("num_tokens", len(times)), **kw)


def paused_stream():
    # due at 0.0, sent 0.1 late; gaps 0.1, 0.1, 0.7, 0.1
    return rec(0, 0.1, [0.6, 0.7, 0.8, 1.5, 1.6], 5, scheduled=0.0)


def test_per_request_metrics_on_a_stream_with_one_pause():
    m = request_metrics(paused_stream(), SLO_, THRESHOLD)
    assert m.ttft_s == pytest.approx(0.5)
    assert m.tpot_s == pytest.approx(0.25)            # (1.6 - 0.6) / 4
    assert m.e2e_s == pytest.approx(1.5)
    assert m.longest_pause_s == pytest.approx(0.7)
    assert m.num_pauses == 1
    assert m.stalled_s == pytest.approx(0.7)
    assert m.client_lag_s == pytest.approx(0.1)
    # gaps sorted [.1 .1 .1 .7]; p99 by linear interpolation: .1 + 0.97 * .6
    assert m.gap_percentile_s == pytest.approx(0.682)
    assert m.failure is None and is_good(m, SLO_)


def test_two_pauses_add_to_time_stalled_and_a_long_one_breaks_the_pause_slo():
    r = rec(1, 0.0, [0.2, 0.6, 0.7, 2.0], 4)          # gaps .4 .1 1.3
    m = request_metrics(r, SLO_, THRESHOLD)
    assert (m.num_pauses, m.stalled_s, m.longest_pause_s) == (2, pytest.approx(1.7), pytest.approx(1.3))
    assert not is_good(m, SLO_)


def test_fewer_tokens_than_asked_is_truncated_and_never_good():
    m = request_metrics(rec(2, 0.0, [0.1, 0.2], 4), SLO_, THRESHOLD)
    assert m.failure == "truncated"
    assert not is_good(m, SLO_)


def test_server_count_of_tokens_counts_when_chunks_merge_tokens():
    # two chunks, but usage says 4 tokens were generated: complete, not truncated
    m = request_metrics(rec(3, 0.0, [0.1, 0.2], 4, num_tokens=4), SLO_, THRESHOLD)
    assert m.failure is None


def test_error_kind_wins_over_truncation_and_a_failed_kv_transfer_is_flagged():
    err = request_metrics(rec(4, 0.0, [], 4, error_kind="http_error", finished_s=0.2), SLO_, THRESHOLD)
    assert err.failure == "http_error" and err.ttft_s is None
    kv = request_metrics(rec(5, 0.0, [0.1, 0.2], 2, kv_transfer={"outcome": "failed", "retries": 1}),
                         SLO_, THRESHOLD)
    assert kv.kv_failed and kv.failure is None  # recomputed: the answer itself was complete


def test_summary_counts_good_requests_goodput_interruptions_and_failures():
    records = [
        paused_stream(),                                               # good
        rec(1, 0.5, [1.0, 1.1], 4),                                    # truncated
        rec(2, 0.2, [], 4, error_kind="http_error", finished_s=0.3),   # HTTP error
        rec(3, 2.0, [3.5, 3.6, 3.7], 3),                               # TTFT 1.5 > 1.0
    ]
    s = summarize(records, SLO_, THRESHOLD, slo_scales=(0.5, 1.0, 2.0))
    assert s["num_good"] == 1 and s["attainment"] == pytest.approx(0.25)
    # scheduled at 0, .5, .2, 2.0: offered 3 gaps over 2 s; goodput = attainment x offered rate
    assert s["duration_s"] == pytest.approx(2.0) and s["makespan_s"] == pytest.approx(3.7)
    assert s["offered_rate_rps"] == pytest.approx(1.5)
    assert s["goodput_rps"] == pytest.approx(0.25 * 1.5)
    assert s["interrupted_share"] == pytest.approx(1 / 3)           # streams with >1 token: 3, paused: 1
    assert s["failures"]["truncated"] == 1 and s["failures"]["http_error"] == 1
    assert s["failures"]["timeout"] == 0
    # TTFTs .5 .5 1.5, and the HTTP error never got a first token: it counts as infinitely late
    assert s["ttft_s"]["p50"] == pytest.approx(1.0) and s["ttft_s"]["p99"] == float("inf")
    assert s["ttft_s"]["num_failed"] == 1
    assert s["stalled_s_total"] == pytest.approx(0.7)
    assert s["client_lag_s"]["max"] == pytest.approx(0.1)
    # x0.5: request 0's p99 gap .682 > .4 fails; x2: request 3's TTFT 1.5 <= 2 passes
    assert [c["attainment"] for c in s["attainment_vs_slo_scale"]] == [0.0, 0.25, 0.5]
    assert s["by_class"]["chat"]["num_requests"] == 4


def test_summary_sums_kv_transfer_reports_and_retries():
    records = [rec(0, 0.0, [0.1], 1, kv_transfer={"bytes": 1000, "seconds": 0.25, "outcome": "ok", "retries": 0}),
               rec(1, 0.0, [0.1], 1, kv_transfer={"bytes": 500, "seconds": 0.5, "outcome": "failed", "retries": 2},
                   retries=2)]
    s = summarize(records, SLO_, THRESHOLD)
    assert s["kv_transfer"] == {"num_reports": 2, "bytes": 1500, "seconds": pytest.approx(0.75), "retries": 2,
                                "failed": 1}
    assert s["kv_transfer"]["failed"] == 1 and s["retries"] == 2
    # both completed: recovered, not failed
    assert sum(s["failures"].values()) == 0
    assert s["recovered"] == {"retried": 1, "kv_recomputed": 1}


def test_a_stream_that_freezes_and_times_out_shows_the_freeze_as_a_pause():
    # tokens until 0.3, then nothing until the client gave up at 5.0
    frozen = rec(0, 0.0, [0.1, 0.2, 0.3], 10, error_kind="timeout", finished_s=5.0)
    m = request_metrics(frozen, SLO_, THRESHOLD)
    assert m.longest_pause_s == pytest.approx(4.7) and m.num_pauses == 1
    s = summarize([frozen], SLO_, THRESHOLD)
    assert s["gap_s"]["p99"] > 4.0 and s["interrupted_share"] == 1.0
    cut = rec(1, 0.0, [0.1, 0.2], 10, error_kind="cancelled", finished_s=2.2)
    assert request_metrics(cut, SLO_, THRESHOLD).longest_pause_s == pytest.approx(2.0)


def test_ttft_percentiles_count_requests_that_failed_before_their_first_token():
    ok = [rec(i, 0.0, [0.1, 0.2], 2) for i in range(8)]
    failed = [rec(8 + i, 0.0, [], 2, error_kind="timeout", finished_s=30.0) for i in range(2)]
    s = summarize(ok + failed, SLO_, THRESHOLD)
    # 2 of 10 never answered: the p90 and p99 first token never came
    assert s["ttft_s"]["p50"] == pytest.approx(0.1)
    assert s["ttft_s"]["p90"] == float("inf") and s["ttft_s"]["p99"] == float("inf")
    assert s["ttft_s"]["num_failed"] == 2
    assert summarize(ok, SLO_, THRESHOLD)["ttft_s"]["p99"] == pytest.approx(0.1)


def test_goodput_divides_by_the_scheduled_span_the_same_for_every_arrangement():
    fast = [rec(i, float(i), [i + 0.1, i + 0.2], 2) for i in range(5)]
    # same plan, every answer late but within the SLOs' e2e: a longer makespan
    slow = [rec(i, float(i), [i + 0.9, i + 4.0], 2) for i in range(5)]
    loose = SLO(ttft_s=1.0, gap_s=5.0, e2e_s=5.0, max_pause_s=5.0)
    a, b = summarize(fast, loose, 10.0), summarize(slow, loose, 10.0)
    assert a["attainment"] == b["attainment"] == 1.0
    assert a["goodput_rps"] == b["goodput_rps"] == pytest.approx(1.0)   # 4 gaps over 4 s


def test_retried_and_recomputed_requests_are_reported_per_class_apart_from_failures():
    records = [rec(0, 0.0, [0.1, 0.2], 2, retries=1),
               rec(1, 0.0, [0.1, 0.2], 2, class_name="document",
                   kv_transfer={"outcome": "failed", "retries": 1}),
               rec(2, 0.0, [0.1], 2, class_name="document", error_kind="cancelled", finished_s=0.5,
                   kv_transfer={"outcome": "failed"})]
    s = summarize(records, SLO_, THRESHOLD)
    assert s["by_class"]["chat"]["recovered"] == {"retried": 1, "kv_recomputed": 0}
    assert s["by_class"]["document"]["recovered"] == {"retried": 0, "kv_recomputed": 1}
    assert s["by_class"]["document"]["failures"] == {"cancelled": 1}
    assert s["failures"]["cancelled"] == 1 and sum(s["failures"].values()) == 1
    assert s["kv_transfer"]["failed"] == 2


def test_attainment_per_phase():
    records = [rec(i, float(i), [i + 0.1, i + 0.2], 2) for i in range(4)]
    records[3].token_times_s = [3.1, 9.0]                       # a pause in the second phase
    s = summarize(records, SLO_, THRESHOLD, phase_starts_s=[0.0, 2.0])
    assert [(p["num_requests"], p["attainment"]) for p in s["by_phase"]] == [(2, 1.0), (2, 0.5)]
