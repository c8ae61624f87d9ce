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


# ---- a rolling update (`restart: all`) ----------------------------------------------------------

def test_a_rolling_restart_fault_is_read_and_mixed_or_unknown_ones_are_refused():
    spec = parse_spec(base_spec(faults=[{"at_s": 3, "restart": "all"},
                                        {"at_s": 4, "restart": "all", "drain_deadline_s": 5}]))
    assert [(f.at_s, f.restart, f.kill, f.drain_deadline_s) for f in spec.faults] == [
        (3, "all", None, 60.0), (4, "all", None, 5.0)]
    cases = [
        ([{"at_s": 2, "restart": "everything"}], r"faults\[0\].restart: must be one of 'all'"),
        ([{"at_s": 2, "restart": "all", "kill": "decode"}], "not both"),
        ([{"at_s": 2, "restart": "all", "restart_after_s": 1}], "not both"),
        ([{"at_s": 2, "restart": "all", "drain_deadline_s": 0}], r"faults\[0\].drain_deadline_s"),
        ([{"at_s": 12, "restart": "all"}], r"faults\[0\].at_s"),
        ([{"at_s": 2, "restart": "all", "when": 1}], r"faults\[0\]"),
    ]
    for bad, match in cases:
        with pytest.raises(SpecError, match=match):
            parse_spec(base_spec(faults=bad))


def fake_admin(monkeypatch, refuse: str | None = None) -> list:
    """A server whose admin API lists three instances (one dead) and restarts what it is asked."""
    import httpx

    asked = []
    rows = [{"id": "prefill-0", "role": "prefill", "alive": True, "draining": False},
            {"id": "decode-9", "role": "decode", "alive": False, "draining": False},
            {"id": "decode-0", "role": "decode", "alive": True, "draining": False}]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"instances": rows})
        engine_id = request.url.path.split("/")[3]
        asked.append((engine_id, json.loads(request.content)))
        if engine_id == refuse:
            return httpx.Response(409, json={"error": {"message": "not serving"}})
        return httpx.Response(200, json={"id": engine_id, "replacement": f"{engine_id}.r1", "role": "x",
                                         "ready_s": 1.0, "seconds": 2.0, "resumed_requests": 1, "exit_code": 0})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    return asked


def test_a_rolling_restart_asks_for_every_serving_instance_in_turn(monkeypatch):
    import asyncio
    import time

    asked = fake_admin(monkeypatch)
    fault = FaultSpec(at_s=0.01, restart="all", drain_deadline_s=7.0)
    event = asyncio.run(faults.inject_fault("http://127.0.0.1:9", fault, time.perf_counter()))
    assert asked == [("prefill-0", {"drain_deadline_s": 7.0}), ("decode-0", {"drain_deadline_s": 7.0})]
    assert event["error"] is None and [i["replacement"] for i in event["instances"]] == ["prefill-0.r1", "decode-0.r1"]
    assert event["began_s"] <= event["instances"][0]["requested_s"] <= event["ended_s"]


def test_a_refused_restart_stops_the_update_and_says_why(monkeypatch):
    import asyncio
    import time

    asked = fake_admin(monkeypatch, refuse="prefill-0")
    event = asyncio.run(faults.inject_fault("http://127.0.0.1:9", FaultSpec(at_s=0.01, restart="all"),
                                            time.perf_counter()))
    assert [a for a, _ in asked] == ["prefill-0"] and event["instances"] == []
    assert "restart of prefill-0 refused: HTTP 409" in event["error"] and event["ended_s"] is not None


def test_slo_misses_during_a_rolling_restart_are_counted_beside_the_rest_of_the_run():
    strict = SLO(ttft_s=0.5, gap_s=5, e2e_s=20, max_pause_s=5)
    late = rec(2, 2.5)
    late.token_times_s = [3.4, 3.5, 3.6, 3.7]  # a first token 0.9 s after it was sent: an SLO miss
    records = [
        rec(0, 0.0),                       # over before the restart
        rec(1, 1.8),                       # in flight when it began (2.0): during it
        late,                              # during, late
        rec(3, 4.0, tokens=0, error="http_error"),  # during, failed
        rec(4, 7.0),                       # after it ended (6.0)
    ]
    update = {"at_s": 2.0, "restart": "all", "began_s": 2.0, "ended_s": 6.0, "error": None,
              "instances": [{"id": "e0", "resumed_requests": 1}, {"id": "e1", "resumed_requests": 0}]}
    [row] = fault_outcomes([update], records, strict, 0.5)
    assert (row["lost_in_flight"], row["failed_after"]) == (0, 1)
    assert (row["requests_during"], row["slo_missed_during"]) == (3, 2)
    assert (row["requests_outside"], row["slo_missed_outside"]) == (2, 0)
    assert (row["seconds"], row["num_restarted"], row["resumed_requests"]) == (4.0, 2, 1)
    assert row["recovery_s"] == pytest.approx(5.0)  # the first request sent after the failure: at 7.0
    from splitserve.trial.report import fault_cell
    assert fault_cell([row]).startswith("restart all (2 instances in 4.0 s): 0 / 1 / 5.0 s; SLO missed by 2 of 3")
    [row] = fault_outcomes([{**update, "began_s": None, "ended_s": None, "error": "no instance serves"}],
                           records, strict, 0.5)
    assert fault_cell([row]) == "not injected (no instance serves)"


@pytest.mark.timeout(420)
def test_a_trial_restarts_every_instance_under_load_and_fails_nothing(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny", arch="llama")
    spec = {
        "name": "update", "seed": 3, "model": str(model), "warmup_requests": 1,
        "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 16, "max": 48},
                                          "answer_tokens": 16}}},
        "arrivals": {"pattern": "constant", "rate": 3.0, "duration_s": 6},
        "slo": {"ttft_s": 10.0, "gap_s": 2.0, "max_pause_s": 5.0, "e2e_s": 60.0},
        "request_timeout_s": 120,
        "faults": [{"at_s": 1.0, "restart": "all"}],
        "arrangements": [{"name": "one", "serve": [
            "--instances", "1", "--threads-per-instance", "1", "--kv-cache-memory", "8MiB", "--log-level", "warning"]}],
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out)]) == 0
    [arr] = json.loads((out / "results.json").read_text())["arrangements"]
    assert arr["error"] is None, arr["error"]
    summary = arr["runs"][0]["summary"]
    [update] = summary["faults"]
    assert update["error"] is None, update
    [done] = update["instances"]
    assert (done["id"], done["replacement"]) == ("engine-0", "engine-0.r1")
    assert update["seconds"] > 0 and update["requests_during"] >= 1
    requests = arr["runs"][0]["requests"]
    assert update["requests_during"] + update["requests_outside"] == len(requests)
    # a rolling restart fails nothing: every answer complete, none lost in flight
    assert all(r["error_kind"] is None and r["num_tokens"] == 16 for r in requests), requests
    assert (update["lost_in_flight"], update["failed_after"]) == (0, 0)
    assert "restart all (1 instance in" in (out / "report.html").read_text()


# ---- a coordinator restart (`restart: coordinator`) ---------------------------------------------

def test_a_coordinator_restart_fault_is_read_and_takes_no_drain_deadline():
    spec = parse_spec(base_spec(faults=[{"at_s": 3, "restart": "coordinator"}]))
    assert [(f.at_s, f.restart, f.kill) for f in spec.faults] == [(3, "coordinator", None)]
    with pytest.raises(SpecError, match=r"faults\[0\].drain_deadline_s: a coordinator restart drains nothing"):
        parse_spec(base_spec(faults=[{"at_s": 3, "restart": "coordinator", "drain_deadline_s": 5}]))
    with pytest.raises(SpecError, match="not both"):
        parse_spec(base_spec(faults=[{"at_s": 3, "restart": "coordinator", "kill": "any"}]))


def test_a_coordinator_restart_waits_until_the_same_engines_serve_again(monkeypatch):
    import asyncio
    import time

    import httpx

    # restarting (503, then no answer), then serving: first with another decode pid (not kept), then the same
    health = iter([(503, 12), (None, 0), (200, 99), (200, 12)])
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.method == "POST":
            return httpx.Response(202, json={"status": "restarting", "failed_requests": 2, "restart": 1, "engines": [
                {"id": "prefill-0", "role": "prefill", "pid": 11}, {"id": "decode-0", "role": "decode", "pid": 12}]})
        if request.url.path == "/metrics":  # the old process (0 restarts) once, then the new one
            counted = 0 if asked.count("/metrics") == 1 else 1
            return httpx.Response(200, text=f"# HELP x\nsplitserve_coordinator_restarts_total {counted}.0\n")
        status, pid = next(health, (200, 12))
        if status is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status, json={"instances": [{"id": "prefill-0", "pid": 11, "alive": True},
                                                          {"id": "decode-0", "pid": pid, "alive": True}]})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    monkeypatch.setattr(faults, "ADMIN_POLL_S", 0.001)
    event = asyncio.run(faults.inject_fault("http://127.0.0.1:9", FaultSpec(at_s=0.01, restart="coordinator"),
                                            time.perf_counter()))
    assert asked == ["/admin/coordinator/restart", "/metrics"] + ["/metrics", "/health"] * 4
    assert event["error"] is None and event["failed_requests"] == 2
    assert [(i["id"], i["kept"]) for i in event["instances"]] == [("prefill-0", True), ("decode-0", True)]
    assert event["began_s"] < event["ended_s"]
    from splitserve.trial.report import fault_cell
    [row] = fault_outcomes([event], [], SLO_LOOSE, 0.5)
    assert fault_cell([row]).startswith("restart coordinator (2 of 2 engines kept, serving again after ")
    assert "the server ended 2 in flight): 0 / 0 / 0.0 s" in fault_cell([row])


@pytest.mark.timeout(420)
def test_a_trial_restarts_the_coordinator_under_load_and_counts_what_it_cost(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny", arch="llama")
    spec = {
        "name": "coordinator", "seed": 3, "model": str(model), "warmup_requests": 1,
        "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 16, "max": 48},
                                          "answer_tokens": 16}}},
        "arrivals": {"pattern": "constant", "rate": 3.0, "duration_s": 6},
        "slo": {"ttft_s": 10.0, "gap_s": 2.0, "max_pause_s": 5.0, "e2e_s": 60.0},
        "request_timeout_s": 120,
        "faults": [{"at_s": 1.0, "restart": "coordinator"}],
        "arrangements": [{"name": "one", "serve": [
            "--instances", "1", "--threads-per-instance", "1", "--kv-cache-memory", "8MiB", "--log-level", "warning"]}],
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out)]) == 0
    [arr] = json.loads((out / "results.json").read_text())["arrangements"]
    assert arr["error"] is None, arr["error"]
    summary = arr["runs"][0]["summary"]
    [restart] = summary["faults"]
    assert restart["error"] is None, restart
    [kept] = restart["instances"]
    assert (kept["id"], kept["kept"]) == ("engine-0", True)
    assert restart["seconds"] > 0 and restart["failed_requests"] >= 0
    requests = arr["runs"][0]["requests"]
    assert restart["requests_during"] + restart["requests_outside"] == len(requests)
    failed = [r for r in requests if r["error_kind"] is not None]
    # what failed was in flight or sent while it restarted; everything sent after it served again completed
    assert restart["lost_in_flight"] + restart["failed_after"] == len(failed), (restart, failed)
    assert all(r["num_tokens"] == 16 for r in requests if r["error_kind"] is None)
    assert not [r for r in failed if r["sent_s"] >= restart["ended_s"]], failed
    print(f"coordinator restart in a trial: serving again after {restart['seconds']:.1f} s, {len(requests)} "
          f"requests, {restart['lost_in_flight']} lost in flight, {restart['failed_after']} failed after, "
          f"the server ended {restart['failed_requests']}")
    assert "restart coordinator (1 of 1 engines kept" in (out / "report.html").read_text()
