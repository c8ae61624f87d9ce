"""The trial reports, per arrangement and class, the share of prompts the server prefilled on the
decode instance itself (issue 30): read from each answer's `splitserve.prefill`, counted from the
records of the fixed-rate run and summed over the capacity probes, and shown in every report."""
import json
import pathlib

import yaml

from splitserve.coordinator.disagg_policy import Placement
from splitserve.trial.client import _read_report
from splitserve.trial.metrics import RequestRecord, local_share, summarize
from splitserve.trial import report
from splitserve.trial.report import table, write_html
from splitserve.trial.results import results_document
from splitserve.trial.runner import ArrangementResult, RunResult
from splitserve.trial.spec import parse_spec

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

SPEC = parse_spec({
    "workload": {"classes": {"chat": {"prompt_tokens": 8, "answer_tokens": 4},
                             "document": {"prompt_tokens": 400, "answer_tokens": 4}}},
    "arrivals": {"pattern": "constant", "rate": 1.0, "num_requests": 10},
    "slo": {"ttft_s": 1.0, "gap_s": 0.3, "max_pause_s": 1.0, "e2e_s": 5.0},
    "pause_threshold_s": 0.3,
    "arrangements": [{"name": "colocated", "serve": ["--instances", "2"], "cores": 2},
                     {"name": "1P1D-auto", "serve": ["--prefill", "1", "--decode", "1", "--disagg-policy", "auto"],
                      "cores": 2}]})


def record(index, class_name, prefill):
    start = float(index)
    rec = RequestRecord(index, class_name, 8 if class_name == "chat" else 400, 4, start, sent_s=start,
                        token_times_s=[start + 0.2, start + 0.3, start + 0.4, start + 0.5])
    rec.prefill = prefill
    return rec


def run_of(records, purpose="fixed", multiplier=1.0):
    return RunResult(multiplier, summarize(records, SPEC.slo, SPEC.pause_threshold_s), records, {},
                     purpose=purpose)


def mixed(where_chat, where_doc, offset=0):
    return ([record(offset + i, "chat", w) for i, w in enumerate(where_chat)]
            + [record(offset + len(where_chat) + i, "document", w) for i, w in enumerate(where_doc)])


def test_the_answer_report_names_where_the_prompt_was_prefilled():
    for local, expected in ((True, "local"), (False, "remote")):
        rec = RequestRecord(0, "chat", 8, 4, 0.0)
        _read_report({"retries": 0, "prefill": Placement(local, "short").report()}, rec)
        assert rec.prefill == expected
    rec = RequestRecord(0, "chat", 8, 4, 0.0)
    _read_report({"retries": 0, "kv_transfer": {"outcome": "ok", "retries": 0}}, rec)  # `always`: no placement
    assert rec.prefill is None


def test_per_class_local_share_is_counted_from_the_records():
    summary = summarize(mixed(["local", "local", "remote", None], ["remote", "remote"]), SPEC.slo,
                        SPEC.pause_threshold_s)
    chat, doc = summary["by_class"]["chat"]["prefill"], summary["by_class"]["document"]["prefill"]
    assert chat == {"local": 2, "remote": 1}  # the request without a report is in neither
    assert local_share(chat) == 2 / 3 and local_share(doc) == 0.0
    assert local_share({"local": 0, "remote": 0}) is None  # colocated: nothing to share out


def test_the_reports_show_the_share_for_the_fixed_run_and_summed_over_the_probes(tmp_path):
    colocated = mixed([None] * 4, [None] * 2)
    auto_fixed = mixed(["local", "local", "local", "remote"], ["remote", "remote"])
    probes = [run_of(mixed(["local", "remote"], ["remote"]), "probe", 2.0),
              run_of(mixed(["local", "local", "local"], ["remote", "local"], offset=10), "probe", 3.0)]
    results = [ArrangementResult("colocated", [run_of(colocated)]),
               ArrangementResult("1P1D-auto", [run_of(auto_fixed), *probes])]
    doc = results_document(SPEC, None, results, sweep=False)
    auto = doc["arrangements"][1]
    assert auto["probe_prefill_by_class"] == {"chat": {"local": 4, "remote": 1},
                                              "document": {"local": 1, "remote": 2}}
    cells = dict(report.rows(doc))
    assert cells["prefilled locally by class"] == ["-", "chat 75% (3/4), document 0% (0/2)"]
    assert cells["prefilled locally by class (all capacity probes)"] == ["-", "chat 80% (4/5), document 33% (1/3)"]
    assert table(doc).row_count >= 2
    write_html(doc, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "chat 75% (3/4), document 0% (0/2)" in page and "chat 80% (4/5), document 33% (1/3)" in page
    saved = json.loads(json.dumps(doc))  # results.json keeps the counts and each request's placement
    assert saved["arrangements"][1]["runs"][0]["requests"][0]["prefill"] == "local"


def test_the_auto_example_is_the_demo_spec_plus_a_1p1d_auto_arrangement():
    demo = yaml.safe_load((EXAMPLES / "doc_heavy_bursty.yaml").read_text())
    auto = yaml.safe_load((EXAMPLES / "doc_heavy_auto.yaml").read_text())
    extra = auto["arrangements"][-1]
    assert extra["name"] == "1P1D-auto" and "auto" in extra["serve"]
    assert {**auto, "name": demo["name"], "arrangements": auto["arrangements"][:-1]} == demo
    parse_spec(auto)


def test_the_knob_example_is_demand_shift_plus_an_adaptive_server_with_the_threshold_knob():
    base = yaml.safe_load((EXAMPLES / "demand_shift.yaml").read_text())
    knob = yaml.safe_load((EXAMPLES / "demand_shift_knob.yaml").read_text())
    extra, adaptive = knob["arrangements"][-1], base["arrangements"][-1]
    assert extra["name"] == "adaptive-threshold" and adaptive["name"] == "adaptive"
    assert extra["serve"] == adaptive["serve"] + ["--disagg-policy", "threshold"]
    assert {**knob, "name": base["name"], "arrangements": knob["arrangements"][:-1]} == base
    parse_spec(knob)


def test_the_split_knob_example_starts_both_adaptive_servers_separated_and_differs_only_in_the_knob():
    base = yaml.safe_load((EXAMPLES / "demand_shift.yaml").read_text())
    split = yaml.safe_load((EXAMPLES / "demand_shift_knob_split.yaml").read_text())
    by_name = {a["name"]: a for a in split["arrangements"]}
    assert list(by_name) == ["colocated-chunked-x2", "adaptive-1P1D", "adaptive-1P1D-threshold"]
    assert by_name["colocated-chunked-x2"] == base["arrangements"][0]
    plain, knob = by_name["adaptive-1P1D"]["serve"], by_name["adaptive-1P1D-threshold"]["serve"]
    assert plain[:4] == ["--prefill", 1, "--decode", 1] and "--adaptive" in plain
    assert knob == plain + ["--disagg-policy", "threshold"]
    assert {k: v for k, v in split.items() if k not in ("name", "arrangements")} == \
        {k: v for k, v in base.items() if k not in ("name", "arrangements")}
    parse_spec(split)
