"""A whole trial of ~20 requests against two launched arrangements, and one against an external URL.

The arrangements are the fake OpenAI-compatible server in tests/fake_openai_server.py with
injected faults, so every failure kind the trial counts has a known expected number.
"""
import json
import pathlib
import subprocess
import sys

import pytest
import yaml

from splitserve.cli import main
from splitserve.trial.arrangements import free_port, stop_process_group, wait_ready

FAKE = str(pathlib.Path(__file__).resolve().parent / "fake_openai_server.py")


def fake(*flags):
    return [sys.executable, FAKE, "--port", "{port}", *flags]


def spec_dict(arrangements):
    return {
        "name": "e2e", "seed": 3, "tokenizer": "server", "warmup_requests": 1,
        "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 10, "max": 30},
                                          "answer_tokens": 6},
                                 "document": {"prompt_tokens": 200, "answer_tokens": 6, "question": "Why so?"}},
                     "mix": {"chat": 3, "document": 1}},
        "arrivals": {"pattern": "constant", "rate": 10.0, "num_requests": 20},
        "slo": {"ttft_s": 2.0, "gap_s": 0.5, "max_pause_s": 1.0, "e2e_s": 10.0},
        "pause_threshold_s": 0.2,
        "request_timeout_s": 30,
        "arrangements": arrangements,
    }


def run_trial(tmp_path, spec, *extra):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out), *extra]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(180)
def test_two_arrangements_produce_json_and_html_with_every_failure_counted(tmp_path):
    arrangements = [
        # serial prefill blocks every stream; request numbers 7, 14, 21 get HTTP 500, 9 and 18 stop early
        {"name": "fake-colocated", "command": fake("--serial", "--prefill-s-per-token", "0.001",
                                                   "--fail-every", "7", "--truncate-every", "9"), "cores": 2},
        # every 4th request pauses 0.3 s; every 5th reports a failed (recomputed) KV transfer
        {"name": "fake-1P1D", "command": fake("--pause-every", "4", "--pause-s", "0.3", "--kv-report",
                                              "--kv-fail-every", "5"), "cores": 2},
    ]
    out, doc = run_trial(tmp_path, spec_dict(arrangements))
    assert (out / "report.html").exists()
    page = (out / "report.html").read_text()
    assert "Verdict" in page and page.count("data:image/png;base64,") >= 4

    assert len(doc["plan"]) == 20
    colocated, separated = doc["arrangements"]
    assert (colocated["kind"], separated["kind"]) == ("colocated", "separated")
    for arr in (colocated, separated):
        assert arr["error"] is None
        requests = arr["runs"][0]["requests"]
        # identical requests at identical times for every arrangement
        assert [(r["index"], r["scheduled_s"], r["max_tokens"]) for r in requests] == \
               [(p["index"], p["send_at_s"], p["max_tokens"]) for p in doc["plan"]]
        complete = [r for r in requests if r["error_kind"] is None]
        assert all(len(r["token_times_s"]) in (3, 6) for r in complete)  # 3: truncated at half

    s = colocated["runs"][0]["summary"]
    assert s["failures"]["http_error"] == 3
    assert s["failures"]["truncated"] == 2
    assert s["num_good"] <= 15
    s = separated["runs"][0]["summary"]
    # failed KV transfers that were recomputed completed: recovered, not failures
    assert s["kv_transfer"]["failed"] == 4 and s["retries"] == 4
    assert s["recovered"]["kv_recomputed"] == 4 and sum(s["failures"].values()) == 0
    assert s["kv_transfer"]["num_reports"] == 20
    assert s["interrupted_share"] >= 5 / 20          # requests 4, 8, 12, 16, 20 paused 0.3 s > 0.2 s
    assert s["longest_pause_s"]["max"] >= 0.3
    assert separated["runs"][0]["server_counters"]["splitserve_kv_transfer_failures_total"] == 4
    assert "fake-1P1D" in doc["verdict"] and "fake-colocated" in doc["verdict"]
    # a fixed-rate run launched alone is watched too: the host over the run, the machine's speed
    # before it, flagged (not redone) when others took the cores
    for arr in (colocated, separated):
        assert len(arr["runs"]) == 1
        watched = arr["runs"][0]["summary"]
        assert watched["host"]["available"] and 0 <= watched["host"]["others_share"] <= 1
        assert watched["speed_units_per_s"] > 0 and watched["disturbed"] == watched["host"]["disturbed"]


@pytest.fixture
def external_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc)


@pytest.mark.timeout(120)
def test_trial_against_an_external_endpoint_started_separately(tmp_path, external_server):
    spec = spec_dict([{"name": "unused", "url": "http://127.0.0.1:9"}])
    out, doc = run_trial(tmp_path, spec, "--url", external_server)
    [arr] = doc["arrangements"]
    assert arr["name"] == "external" and arr["kind"] == "external"
    summary = arr["runs"][0]["summary"]
    assert summary["num_requests"] == 20 and summary["num_complete"] == 20
    assert summary["attainment"] > 0.5
    assert (out / "report.html").exists()


@pytest.mark.timeout(120)
def test_sweep_raises_the_rate_until_attainment_drops(tmp_path):
    spec = spec_dict([{"name": "fake", "command": fake("--gap-s", "0.005")}])
    spec["sweep"] = {"rate_multipliers": [1.0, 2.0]}
    out, doc = run_trial(tmp_path, spec, "--sweep")
    [arr] = doc["arrangements"]
    assert [(r["rate_multiplier"], r["purpose"]) for r in arr["runs"]] == [(1.0, "fixed"), (2.0, "sweep")]
    assert arr["runs"][1]["summary"]["offered_rate_rps"] == pytest.approx(20.0)   # 20 requests over 0.95 s at x2


def test_a_server_that_dies_at_start_is_reported_not_fatal(tmp_path):
    spec = spec_dict([{"name": "broken", "command": [sys.executable, "-c", "import sys; sys.exit(3)", "{port}"]},
                      {"name": "fake", "command": fake()}])
    out, doc = run_trial(tmp_path, spec)
    broken, ok = doc["arrangements"]
    assert "exited with code 3" in broken["error"] and broken["runs"] == []
    assert ok["runs"][0]["summary"]["num_requests"] == 20
    assert "broken" in doc["verdict"]


@pytest.mark.timeout(120)
def test_sigterm_to_the_trial_stops_the_server_it_launched(tmp_path):
    import os
    import signal
    import time

    import psutil

    spec = spec_dict([{"name": "fake", "command": fake(), "cores": 2}])
    spec["arrivals"] = {"pattern": "constant", "rate": 1.0, "num_requests": 600}  # ten minutes
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    trial = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "trial", str(path), "--out",
                              str(tmp_path / "out")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(trial.pid)
        deadline = time.monotonic() + 60
        servers = []
        while not servers and time.monotonic() < deadline:
            servers = [p for p in parent.children(recursive=True) if FAKE in " ".join(p.cmdline())]
            time.sleep(0.2)
        assert servers, "the trial never launched its server"
        time.sleep(3)  # replaying by now
        os.kill(trial.pid, signal.SIGTERM)
        trial.wait(timeout=30)
        gone, alive = psutil.wait_procs(servers, timeout=15)
        assert not alive, f"launched server still running after SIGTERM to the trial: {alive}"
    finally:
        if trial.poll() is None:
            trial.kill()
