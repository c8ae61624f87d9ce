"""Service classes in the trial: a deadline per class (falling back to the global SLO), clients
that give up, priority in the body, and good requests per unit of cost."""
import asyncio
import copy
import subprocess
import sys

import pytest

from splitserve.trial.arrangements import free_port, stop_process_group, wait_ready
from splitserve.trial.classes import Patience
from splitserve.trial.client import completion_body, run_load
from splitserve.trial.metrics import RequestRecord, summarize
from splitserve.trial.report import write_html
from splitserve.trial.results import results_document
from splitserve.trial.runner import ArrangementResult, RunResult
from splitserve.trial.spec import SpecError, parse_spec
from splitserve.trial.workload import PlannedRequest

from test_trial_end_to_end import FAKE

RAW = {
    "workload": {"classes": {"chat": {"prompt_tokens": 8, "answer_tokens": 4,
                                      "slo": {"ttft_s": 0.5}, "patience": {"ttft_s": 2, "total_s": 10},
                                      "priority": -1},
                             "document": {"prompt_tokens": 8, "answer_tokens": 4,
                                          "slo": {"ttft_s": None, "gap_s": None, "max_pause_s": None,
                                                  "e2e_s": 60}},
                             "tool": {"prompt_tokens": 8, "answer_tokens": 4}}},
    "arrivals": {"pattern": "constant", "rate": 1.0, "num_requests": 4},
    "slo": {"ttft_s": 1.0, "gap_s": 0.3, "max_pause_s": 1.0, "e2e_s": 5.0},
    "pause_threshold_s": 0.3,
    "price_per_core_hour": 0.5,
    "arrangements": [{"name": "colocated", "serve": ["--instances", "1"], "cores": 2},
                     {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1"], "cores": 2,
                      "cost_per_hour": 2.0}]}


def spec_with(**changes):
    raw = copy.deepcopy(RAW)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = raw
        for key in parents:
            node = node[key]
        node[last] = value
    return parse_spec(raw)


def test_a_class_slo_replaces_only_the_fields_it_writes_and_null_drops_a_deadline():
    spec = spec_with()
    chat, doc, tool = (spec.class_slos[n] for n in ("chat", "document", "tool"))
    assert (chat.ttft_s, chat.gap_s, chat.max_pause_s, chat.e2e_s) == (0.5, 0.3, 1.0, 5.0)
    assert (doc.ttft_s, doc.gap_s, doc.max_pause_s, doc.e2e_s) == (None, None, None, 60.0)
    assert tool == spec.slo                      # no slo: the global one
    assert spec.classes["chat"].patience == Patience(2.0, 10.0) and spec.classes["chat"].priority == -1


@pytest.mark.parametrize("path,value,field", [
    ("workload__classes__chat__slo", {"ttft_s": 9.0}, "workload.classes.chat.slo.e2e_s"),
    ("workload__classes__chat__slo", {"ttft_s": -1}, "workload.classes.chat.slo.ttft_s"),
    ("workload__classes__chat__slo", {"ttfts": 1}, "workload.classes.chat.slo.ttfts"),
    ("workload__classes__chat__slo", {"gap_s": 2.0}, "workload.classes.chat.slo.max_pause_s"),
    ("workload__classes__chat__slo", {"ttft_s": None, "gap_s": None, "max_pause_s": None, "e2e_s": None},
     "workload.classes.chat.slo"),
    ("workload__classes__chat__patience", {"ttft_s": 5, "total_s": 4}, "workload.classes.chat.patience.total_s"),
    ("workload__classes__chat__patience", {"total": 4}, "workload.classes.chat.patience.total"),
    ("workload__classes__chat__priority", 2**40, "workload.classes.chat.priority"),
    ("workload__classes__chat__priority", "high", "workload.classes.chat.priority"),
    ("price_per_core_hour", -1, "price_per_core_hour"),
])
def test_a_bad_class_setting_names_its_field(path, value, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        spec_with(**{path: value})


def record(index, cls, first_token_s, num=4, gap=0.1, **kw):
    times = [first_token_s + gap * k for k in range(num)] if first_token_s is not None else []
    return RequestRecord(index, cls, 8, 4, float(index), sent_s=float(index),
                         token_times_s=[index + t for t in times], num_tokens=len(times), **kw)


def test_each_request_is_judged_by_its_own_class_slo():
    spec = spec_with()
    # a 0.8 s first token: too late for chat (0.5 s), fine for tool (global 1.0 s) and document (none)
    records = [record(0, "chat", 0.8), record(1, "tool", 0.8), record(2, "document", 3.0, gap=2.0),
               record(3, "chat", 0.2)]
    s = summarize(records, spec.slo, spec.pause_threshold_s, class_slos=spec.class_slos)
    assert {n: g["attainment"] for n, g in s["by_class"].items()} == {"chat": 0.5, "tool": 1.0, "document": 1.0}
    assert s["num_good"] == 3
    # the classes' goodputs add up to the overall goodput
    assert sum(g["goodput_rps"] for g in s["by_class"].values()) == pytest.approx(s["goodput_rps"])
    # judged by the global SLO alone, the 0.8 s chat is good and the document (3 s first token) is not
    alone = summarize(records, spec.slo, spec.pause_threshold_s)["by_class"]
    assert (alone["chat"]["attainment"], alone["document"]["attainment"]) == (1.0, 0.0)


def test_abandoned_requests_are_a_failure_of_their_own_with_the_work_they_cost():
    spec = spec_with()
    records = [record(0, "chat", 0.2), record(1, "chat", None, error_kind="abandoned"),
               record(2, "chat", 0.2, num=2, error_kind="abandoned"), record(3, "chat", 0.2, error_kind="timeout")]
    s = summarize(records, spec.slo, spec.pause_threshold_s, class_slos=spec.class_slos)
    assert s["failures"]["abandoned"] == 2 and s["failures"]["timeout"] == 1
    assert s["abandoned_work"] == {"num_requests": 2, "prompt_tokens_prefilled": 8,
                                   "prompt_tokens_maybe_prefilled": 8, "tokens_decoded": 2, "source": "client"}


def run(records, spec):
    return RunResult(1.0, summarize(records, spec.slo, spec.pause_threshold_s, class_slos=spec.class_slos),
                     records, {})


def test_the_verdict_and_report_say_which_arrangement_serves_which_class_best_and_per_cost(tmp_path):
    spec = spec_with()
    # colocated: chat late, documents fine; 1P1D: chat fine, documents fine
    col = [record(0, "chat", 0.9), record(1, "document", 2.0), record(2, "chat", 0.9), record(3, "document", 2.0)]
    sep = [record(0, "chat", 0.2), record(1, "document", 2.0), record(2, "chat", 0.2), record(3, "document", 2.0)]
    doc = results_document(spec, None, [ArrangementResult("colocated", [run(col, spec)]),
                                        ArrangementResult("1P1D", [run(sep, spec)])], sweep=False)
    assert [a["cost_per_hour"] for a in doc["arrangements"]] == [1.0, 2.0]   # 2 cores x 0.5; stated
    assert "chat: best served by 1P1D (colocated 0%, 1P1D 100% good)" in doc["verdict"]
    assert "document: no clear best" in doc["verdict"]
    # 4 requests over a 4 s span (3 gaps of 1 s, plus one): 2 good documents = 0.5 req/s = 1800 per hour
    assert "document on colocated 1800" in doc["verdict"] and "document on 1P1D 900" in doc["verdict"]
    write_html(doc, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Service classes</h2>" in page and "gives up after no first token in 2.0 s" in page


def test_priority_is_sent_in_the_body_only_when_the_class_sets_one():
    assert completion_body(PlannedRequest(0, "chat", 0.0, [1], 2, priority=-1), None)["priority"] == -1
    assert "priority" not in completion_body(PlannedRequest(0, "chat", 0.0, [1], 2), None)


def test_an_impatient_client_disconnects_and_its_request_is_abandoned_not_timed_out():
    port = free_port()
    # each prompt token takes 1 s to prefill, one at a time: a 3-token prompt's first token comes after 3 s
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--prefill-s-per-token", "1",
                             "--gap-s", "0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, 60, proc)
        plan = [PlannedRequest(0, "chat", 0.0, [5, 6, 7], 5, patience=Patience(ttft_s=0.3)),
                PlannedRequest(1, "chat", 0.0, [5], 20, patience=Patience(total_s=2.5)),
                PlannedRequest(2, "chat", 0.0, [5], 20)]
        records = asyncio.run(run_load(base_url, plan, timeout_s=2.5))
    finally:
        stop_process_group(proc)
    no_first, gave_up_midway, waited = records
    assert no_first.error_kind == "abandoned" and no_first.token_times_s == []
    assert no_first.finished_s - no_first.sent_s < 2.0                        # it left long before 3 s
    assert gave_up_midway.error_kind == "abandoned" and gave_up_midway.token_times_s
    assert waited.error_kind == "timeout"                                     # no patience: a timeout
