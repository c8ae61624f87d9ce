"""The verdict follows the measurement, and the reports render from a results document alone."""
import json

from splitserve.trial import report
from splitserve.trial.metrics import RequestRecord, summarize
from splitserve.trial.report import table, write_html, write_json
from splitserve.trial.runner import ArrangementResult, RunResult
from splitserve.trial.spec import parse_spec
from splitserve.trial.results import results_document

SPEC = parse_spec({
    "workload": {"classes": {"chat": {"prompt_tokens": 8, "answer_tokens": 4}}},
    "arrivals": {"pattern": "constant", "rate": 1.0, "num_requests": 4},
    "slo": {"ttft_s": 1.0, "gap_s": 0.3, "max_pause_s": 1.0, "e2e_s": 5.0},
    "pause_threshold_s": 0.3,
    "arrangements": [{"name": "colocated-whole", "serve": ["--prefill-policy", "whole"], "cores": 2},
                     {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1"], "cores": 2},
                     {"name": "colocated-x2", "serve": ["--instances", "2"], "cores": 2}]})


def stream(index, start, gaps):
    times = [start + 0.2]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(index, "chat", 8, len(times), float(index), sent_s=start, token_times_s=times)


def run_of(records):
    return RunResult(1.0, summarize(records, SPEC.slo, SPEC.pause_threshold_s), records, {})


def document(stalls_colocated: bool):
    smooth = [stream(i, float(i), [0.1, 0.1, 0.1]) for i in range(4)]
    stalled = [stream(i, float(i), [0.1, 2.0, 0.1]) for i in range(4)]
    slow_first = [stream(i, float(i), [0.1, 0.1, 0.1]) for i in range(4)]
    for r in slow_first:  # separated: first tokens late (prefill on one thread)
        r.token_times_s = [t + 1.5 for t in r.token_times_s]
    results = [ArrangementResult("colocated-whole", [run_of(stalled if stalls_colocated else smooth)]),
               ArrangementResult("1P1D", [run_of(smooth if stalls_colocated else slow_first)]),
               ArrangementResult("colocated-x2", error="server exited with code 2 before it was ready")]
    return results_document(SPEC, None, results, sweep=False)


def test_verdict_says_separate_when_colocated_streams_stall():
    doc = document(stalls_colocated=True)
    assert "Separate prefill: yes at this rate: 1P1D met more deadlines than colocated-whole" in doc["verdict"]
    assert "colocated-x2" in doc["verdict"]  # the arrangement that failed to start is named


def test_verdict_says_colocated_when_separation_only_delays_first_tokens():
    doc = document(stalls_colocated=False)
    assert "Separate prefill: no at this rate: colocated-whole met more deadlines than 1P1D" in doc["verdict"]
    assert "its p99 TTFT was" in doc["verdict"]  # the cost it names is one it measured


def test_equal_attainment_and_goodput_is_no_verdict_for_separation():
    smooth = [stream(i, float(i), [0.1, 0.1, 0.1]) for i in range(4)]
    results = [ArrangementResult("colocated-whole", [run_of(smooth)]), ArrangementResult("1P1D", [run_of(smooth)])]
    doc = results_document(SPEC, None, results, sweep=False)
    assert "met about as many deadlines" in doc["verdict"]
    assert "Separate prefill: not at this load" in doc["verdict"]


def test_no_verdict_when_every_arrangement_drowned():
    stalled = [stream(i, float(i), [0.1, 2.0, 0.1]) for i in range(4)]
    results = [ArrangementResult("colocated-whole", [run_of(stalled)]), ArrangementResult("1P1D", [run_of(stalled)])]
    doc = results_document(SPEC, None, results, sweep=False)
    assert "no verdict from an overloaded run" in doc["verdict"]
    assert "Warning: every arrangement met fewer than half its deadlines" in doc["verdict"]
    assert "Separate prefill: yes" not in doc["verdict"]


def test_reports_render_from_the_document(tmp_path):
    doc = document(stalls_colocated=True)
    write_json(doc, tmp_path / "results.json")
    assert json.loads((tmp_path / "results.json").read_text())["verdict"] == doc["verdict"]
    write_html(doc, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "exited with code 2" in page and page.count("data:image/png;base64,") == 4
    assert table(doc).row_count >= 10


def test_a_trial_whose_searches_held_nothing_still_renders(tmp_path):
    from splitserve.trial.capacity import spread

    doc = document(stalls_colocated=True)
    for a in doc["arrangements"]:
        a["runs"] = [dict(r, purpose="probe") for r in a["runs"]]   # probes only: no whole-plan run
        a["capacity"] = [{"repeat": 0, "capacity_rps": None, "failed_rps": 1.0, "stopped_by": "floor",
                          "probes": [{"multiplier": 1.0, "attainment": 0.25, "offered_rate_rps": 1.0,
                                      "seconds": 4.0}]}]
        a["capacity_rps"] = spread([None])
    write_html(doc, tmp_path / "report.html")
    assert "stopped by floor" in (tmp_path / "report.html").read_text()
    assert table(doc).row_count >= 10


def test_attainment_by_phase_leaves_a_phase_no_request_reached_blank():
    cell = dict(report.ROWS)["attainment by phase"]
    summary = {"by_phase": [{"phase": 0, "attainment": 0.92, "num_requests": 24},
                            {"phase": 1, "attainment": 0.0, "num_requests": 0}]}
    assert cell(summary) == "#1 92%, #2 -"
