"""The load generator records what each stream did: tokens, and every way a request can go wrong."""
import asyncio
import subprocess
import sys

import pytest

from splitserve.trial.arrangements import free_port, stop_process_group, wait_ready
from splitserve.trial.client import _tokens_in_chunk, run_load
from splitserve.trial.workload import PlannedRequest

from test_trial_end_to_end import FAKE


@pytest.fixture(scope="module")
def faulty_server():
    port = free_port()
    # request 3 and 6 are cut after 2 tokens; request 4 pauses 3 s (beyond the 1 s timeout)
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--gap-s", "0.01", "--cut-every", "3",
                             "--pause-every", "4", "--pause-s", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc)


def planned(n, spacing_s=0.15):
    return [PlannedRequest(i, "chat", i * spacing_s, [5, 6, 7], 5) for i in range(n)]


def test_each_request_is_sent_on_schedule_and_every_way_it_ends_is_recorded(faulty_server):
    records = asyncio.run(run_load(faulty_server, planned(6), timeout_s=1.0, model="fake-model"))
    kinds = [r.error_kind for r in records]
    assert kinds == [None, None, "cancelled", "timeout", None, "cancelled"]
    for r in records:
        assert r.sent_s >= r.scheduled_s                     # never early
    ok = records[0]
    assert len(ok.token_times_s) == 5 and ok.num_tokens == 5 and ok.finish_reason == "length"
    assert ok.token_times_s == sorted(ok.token_times_s) and ok.token_times_s[0] >= ok.sent_s
    assert len(records[2].token_times_s) == 2                # cut after two tokens


def test_an_unreachable_server_is_a_connection_error():
    port = free_port()  # nothing listens here
    [rec] = asyncio.run(run_load(f"http://127.0.0.1:{port}", planned(1), timeout_s=5.0))
    assert rec.error_kind == "connection_error" and rec.token_times_s == []


def test_an_error_chunk_is_a_cancelled_stream_and_its_kv_report_is_kept():
    port = free_port()
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--error-every", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, 60, proc)
        [rec] = asyncio.run(run_load(base_url, planned(1), timeout_s=10.0))
    finally:
        stop_process_group(proc)
    assert rec.error_kind == "cancelled" and "KV transfer failed" in rec.error_message
    assert rec.kv_transfer["outcome"] == "failed" and rec.retries == 2
    assert len(rec.token_times_s) == 1


@pytest.mark.parametrize("choice, expected", [
    ({"text": " the"}, 1), ({"text": ""}, 0), ({"text": "ab", "token_ids": [1, 2, 3]}, 3),
    ({"text": "x", "num_tokens": 2}, 2), ({"text": "", "finish_reason": "length"}, 0)])
def test_tokens_per_chunk(choice, expected):
    assert _tokens_in_chunk(choice) == expected


def _serve(*flags):
    port = free_port()
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}", 60, proc)
    return proc, f"http://127.0.0.1:{port}"


def test_an_odd_response_fails_its_request_and_a_failing_side_task_loses_nothing():
    proc, url = _serve("--gap-s", "0.01", "--odd-every", "2")

    async def broken_side_task(t0):
        raise RuntimeError("a fault injector bug")

    try:
        records = asyncio.run(run_load(url, planned(4, 0.05), timeout_s=5.0, side_tasks=[broken_side_task]))
    finally:
        stop_process_group(proc)
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert [r.error_kind for r in records] == [None, "cancelled", None, "cancelled"]
    assert "unreadable response" in records[1].error_message


def test_timing_is_per_token_when_the_server_names_token_ids_and_per_chunk_otherwise():
    proc, url = _serve("--gap-s", "0.005", "--token-ids")
    try:
        [named] = asyncio.run(run_load(url, planned(1), timeout_s=5.0))
    finally:
        stop_process_group(proc)
    assert named.token_timing == "token" and len(named.token_times_s) == 5
    assert _tokens_in_chunk({"text": "", "token_ids": [1, 2]}) == 2   # held-back text still counts


def test_a_stop_event_ends_the_remaining_requests_as_probe_stopped(faulty_server):
    stop = asyncio.Event()

    def on_done(rec):
        stop.set()                                      # the first finished request stops the rest

    plan = planned(3, 0.0) + [PlannedRequest(9, "chat", 30.0, [5], 5)]  # due far in the future
    records = asyncio.run(run_load(faulty_server, plan, timeout_s=5.0, on_done=on_done, stop=stop))
    assert records[-1].error_kind == "probe_stopped" and records[-1].sent_s is None
    assert any(r.error_kind != "probe_stopped" for r in records[:3])  # the one that finished first
