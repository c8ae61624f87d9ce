"""Scheduled stage failures in a trial (`faults:`): the spec, the judging of lost requests and
recovery on hand-made timelines, and one real replay that kills a decode engine and restarts it."""
import json

import pytest
import yaml

from splitserve.cli import main
from splitserve.trial import faults
from splitserve.trial.faults import fault_outcomes, pick_victim
from splitserve.trial.spec import FaultSpec
from splitserve.trial.metrics import RequestRecord
from splitserve.trial.spec import SLO, SpecError, parse_spec
from tiny_models import write_tiny_checkpoint

SLO_LOOSE = SLO(ttft_s=10, gap_s=5, e2e_s=20, max_pause_s=5)


def base_spec(**extra):
    spec = {"workload": {"classes": {"chat": {"prompt_tokens": 10, "answer_tokens": 4}}},
            "arrivals": {"pattern": "constant", "rate": 1.0, "duration_s": 10},
            "slo": {"ttft_s": 1, "gap_s": 0.5, "max_pause_s": 1, "e2e_s": 5}}
    spec.update(extra)
    return spec


def test_faults_are_read_and_bad_ones_name_the_field():
    spec = parse_spec(base_spec(faults=[{"at_s": 2, "kill": "decode", "restart_after_s": 1},
                                        {"at_s": 5, "kill": "any"}]))
    assert [(f.at_s, f.kill, f.restart_after_s) for f in spec.faults] == [(2, "decode", 1), (5, "any", None)]
    cases = [
        ([{"at_s": 2, "kill": "gpu"}], "faults[0].kill"),
        ([{"at_s": -1, "kill": "decode"}], "faults[0].at_s"),
        ([{"at_s": 2, "kill": "decode", "when": 3}], "faults[0]"),
        ([{"at_s": 12, "kill": "decode"}], "faults[0].at_s"),
        ([{"at_s": 5, "kill": "decode"}, {"at_s": 2, "kill": "any"}], "time order"),
        ([{"at_s": 2, "kill": "decode", "restart_after_s": -1}], "faults[0].restart_after_s"),
    ]
    for faults, field in cases:
        with pytest.raises(SpecError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_spec(base_spec(faults=faults))
    with pytest.raises(SpecError, match="external URL"):
        parse_spec(base_spec(faults=[{"at_s": 2, "kill": "any"}],
                             arrangements=[{"name": "x", "url": "http://127.0.0.1:9"}]))


def test_the_victim_serves_the_named_stage():
    rows = [{"id": "p0", "role": "prefill", "alive": True, "pid": 1},
            {"id": "d0", "role": "decode", "alive": False, "pid": 2},
            {"id": "d1", "role": "decode", "alive": True, "pid": 3}]
    assert pick_victim(rows, "decode")["id"] == "d1"   # the dead one is skipped
    assert pick_victim(rows, "prefill")["id"] == "p0"
    assert pick_victim(rows, "any")["id"] == "p0"
    colocated = [{"id": "e0", "role": "colocated", "alive": True, "pid": 4}]
    assert pick_victim(colocated, "decode")["id"] == "e0"  # colocated instances do both stages
    assert pick_victim([], "any") is None


def rec(index, sent, tokens=4, error=None, finished=None):
    r = RequestRecord(index, "chat", 10, 4, scheduled_s=sent, sent_s=sent)
    r.token_times_s = [sent + 0.1 * (i + 1) for i in range(tokens)]
    r.num_tokens = tokens
    r.error_kind = error
    r.finished_s = finished if finished is not None else (r.token_times_s[-1] if tokens else sent + 0.1)
    return r


def event(killed_s):
    return {"at_s": killed_s, "kill": "decode", "instance": "d0", "killed_s": killed_s}


def test_a_server_that_never_notices_the_kill_ends_the_fault_with_an_error_not_a_hang(monkeypatch):
    import asyncio
    import time

    async def always_alive(http, base_url):
        return {"instances": [{"id": "decode-0", "role": "decode", "pid": 1, "alive": True}]}

    killed = []
    monkeypatch.setattr(faults, "_instances", always_alive)
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(faults, "OUT_OF_ROTATION_TIMEOUT_S", 0.3)
    start = time.perf_counter()
    event = asyncio.run(faults.inject_fault("http://127.0.0.1:9", FaultSpec(at_s=0.01, kill="decode"), start))
    assert killed == [1] and event["out_of_rotation_s"] is None
    assert "still listed decode-0 as alive" in event["error"]
    assert time.perf_counter() - start < 5


def test_lost_requests_and_recovery_on_a_hand_made_timeline():
    records = [
        rec(0, 0.0),                                    # done before the kill
        rec(1, 1.0, tokens=2, error="cancelled", finished=2.5),  # in flight at the kill (2.0): lost
        rec(2, 1.5, tokens=1, finished=1.6),            # truncated before the kill: not this fault's
        rec(3, 2.2, tokens=0, error="http_error"),      # sent after the kill, failed
        rec(4, 3.0, tokens=0, error="http_error"),      # the last failure
        rec(5, 4.5),                                    # the first good one after it: recovered at 4.5
        rec(6, 5.0),
    ]
    [row] = fault_outcomes([event(2.0)], records, SLO_LOOSE, 0.5)
    assert (row["lost_in_flight"], row["failed_after"]) == (1, 2)
    assert row["recovery_s"] == pytest.approx(2.5)
    # nothing failed after the kill: recovered at once; the still-failing end: not recovered
    [row] = fault_outcomes([event(2.0)], records[:3] + records[5:], SLO_LOOSE, 0.5)
    assert (row["failed_after"], row["recovery_s"]) == (0, 0.0)
    [row] = fault_outcomes([event(2.0)], records[:5], SLO_LOOSE, 0.5)
    assert row["failed_after"] == 2 and row["recovery_s"] is None
    # two faults split the timeline at the second kill
    first, second = fault_outcomes([event(2.0), event(2.9)], records, SLO_LOOSE, 0.5)
    assert (first["failed_after"], first["recovery_s"]) == (1, None)  # not before the next kill
    assert (second["failed_after"], second["recovery_s"]) == (1, pytest.approx(1.6))
    # a fault that could not be injected judges nothing
    [row] = fault_outcomes([{"at_s": 2.0, "kill": "decode", "killed_s": None, "error": "x"}], records,
                           SLO_LOOSE, 0.5)
    assert row["recovery_s"] is None and row["lost_in_flight"] == 0


@pytest.mark.timeout(420)
def test_a_trial_kills_the_decode_engine_and_its_replacement_rejoins(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny", arch="llama")
    spec = {
        "name": "fault", "seed": 2, "model": str(model), "warmup_requests": 1,
        "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 16, "max": 48},
                                          "answer_tokens": 24}}},
        "arrivals": {"pattern": "constant", "rate": 6.0, "duration_s": 6},
        "slo": {"ttft_s": 10.0, "gap_s": 2.0, "max_pause_s": 5.0, "e2e_s": 60.0},
        "request_timeout_s": 120,
        "faults": [{"at_s": 2.0, "kill": "decode", "restart_after_s": 0.5}],
        "arrangements": [{"name": "1P1D", "serve": [
            "--prefill", "1", "--decode", "1", "--kv-transport", "shm", "--threads-per-instance", "1",
            "--kv-cache-memory", "8MiB", "--log-level", "warning"]}],
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    [arr] = doc["arrangements"]
    assert arr["error"] is None, arr["error"]
    summary = arr["runs"][0]["summary"]
    [fault] = summary["faults"]
    assert fault["error"] is None, fault
    assert fault["instance"].startswith("decode") and fault["killed_s"] == pytest.approx(2.0, abs=0.5)
    assert fault["out_of_rotation_s"] - fault["killed_s"] < 2.0
    assert fault["replacement"] and fault["rejoined_s"] > fault["restart_requested_s"]
    # every request is accounted for: good, or failed with a kind the summary counts
    requests = arr["runs"][0]["requests"]
    failed = [r for r in requests if r["error_kind"] is not None or r["num_tokens"] < 24]
    assert sum(summary["failures"].values()) == len(failed)
    assert fault["lost_in_flight"] + fault["failed_after"] <= len(failed)
    # the replacement took traffic: requests sent after it joined complete
    after = [r for r in requests if r["sent_s"] > fault["rejoined_s"] + 0.5]
    if after:
        assert all(r["error_kind"] is None and r["num_tokens"] == 24 for r in after)
        assert fault["recovery_s"] is not None
    assert "faults: lost" in (out / "report.html").read_text()
