"""An engine killed under load: a request that already streamed tokens is resumed on the survivor
(prompt + tokens so far recomputed; issue 11) and completes, a request that had no token yet is
retried once on the survivor and completes, the router
stops using the dead instance, and an engine restarted by hand under the same id
(`splitserve engine --connect ...`) rejoins and takes traffic.

One server per module: 2 colocated engines that each run one request at a time and queue
the rest, so a queued request is a request in flight with no token sent yet.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from serve_support import (REPO, ServerProcess, all_blocks_free, metric_samples, secret_flags, stop_process,
                           wait_until)
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-failure")
    # 4,096 positions: a stream of LONG tokens outlasts the few tenths of a second the test takes
    # to find the queued request and kill its engine (480 tokens took the tiny model under 0.5 s)
    model = write_tiny_checkpoint(root / "tiny", arch="llama", max_position_embeddings=4096)
    secrets = secret_flags(root)  # an engine restarted by hand joins it
    srv = ServerProcess(str(model), "--max-num-seqs", "1", "--max-queued-requests", "4", "--kv-cache-memory", "8MiB",
                        *secrets, instances=2, log_path=root / "server.log").wait_ready()
    srv.model_path, srv.secrets = model, secrets
    yield srv
    srv.stop()


LONG = 3000


def per_instance(server, metric: str) -> dict[str, float]:
    samples = metric_samples(server.base_url, metric)
    return {re.search(r'instance="([^"]+)"', k).group(1): v for k, v in samples.items()}


def engine_pids(server) -> dict[str, int]:
    return {i["id"]: i["pid"] for i in server.health()["instances"]}


def open_stream(client, model, prompt: str, max_tokens: int):
    stream = iter(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                            extra_body={"ignore_eos": True}))
    next(stream)  # its first token arrived: it is running, not queued
    return stream


def drain(stream) -> str:
    try:
        chunks = list(stream)
        return f"finished:{chunks[-1].choices[0].finish_reason if chunks else None}"
    except openai.APIError as e:
        return f"error:{e.message}"


def test_queued_request_is_retried_on_the_survivor_and_the_dead_engine_leaves_at_its_exit(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    running = [open_stream(client, model, "hello world", LONG) for _ in range(2)]  # one per engine
    queued: dict = {}

    def queued_request():
        queued["answer"] = client.completions.create(model=model, prompt="the answer", max_tokens=40,
                                                     temperature=0, extra_body={"ignore_eos": True})

    waiter = threading.Thread(target=queued_request)
    waiter.start()
    # The victim is the engine that reports the request queued behind its running stream. (Read
    # from the router's load instead, the two streams' start times could outweigh the queued
    # request's tokens and pick the other engine.) The streams are long enough to still run when
    # the engines' stats, sent at most every 0.25 s, say where it waits.
    assert wait_until(lambda: max(per_instance(server, "splitserve_instance_queued_requests").values()) >= 1)
    queued_on = per_instance(server, "splitserve_instance_queued_requests")
    victim = max(queued_on, key=queued_on.get)
    survivor, = set(queued_on) - {victim}
    killed_at = time.monotonic()
    os.kill(engine_pids(server)[victim], signal.SIGKILL)
    # Its exit is noticed at once (not after 1.5 s of silence); how soon the server gets to it
    # depends on the box, so the deadline is generous and the log says which way it was noticed.
    assert wait_until(lambda: not {i["id"]: i["alive"] for i in server.health()["instances"]}[victim],
                      timeout_s=30, interval_s=0.05), "the dead engine stayed in rotation"
    noticed_s = time.monotonic() - killed_at
    assert f"engine {victim} is dead (exited with code -9)" in server.log_path.read_text(errors="replace")

    outcomes = [drain(s) for s in running]
    assert outcomes == ["finished:length"] * 2, outcomes  # the victim's stream was resumed, not failed
    server.victim = victim
    # The victim's stream is resumed on the survivor when it still ran at the kill. On a busy box
    # (make test, session 23) the tiny model may finish it first: then nothing is resumed, and the
    # log and /metrics must both say so
    resumed = f"engine {victim} resumed after" in server.text()
    assert sum(metric_samples(server.base_url, "splitserve_request_resumes_total").values()) == resumed
    waiter.join(timeout=120)
    assert not waiter.is_alive(), "the retried request hangs"
    assert queued["answer"].usage.completion_tokens == 40  # retried once on the survivor, complete
    assert queued["answer"].choices[0].finish_reason == "length"
    # On a fast (quiet) machine the victim's stream can finish before the kill and the queued
    # request start on it: then it is resumed after some tokens instead of retried. The answer's
    # report counts both as times it was sent again; /metrics counts retries and resumes apart;
    # the log names each (CI once read a resume as a missing retry line).
    log_text = server.text()
    rid = queued["answer"].id.removeprefix("cmpl-")
    sent_again = re.findall(rf"request {rid}: engine (\S+) (died before its first token; retry 1|resumed after \d+ tokens) "
                            r"on (\S+)", log_text)
    retries_metric = sum(metric_samples(server.base_url, "splitserve_request_retries_total").values())
    report = (queued["answer"].model_extra or {}).get("splitserve")
    assert (report or {}).get("retries", 0) == len(sent_again), (report, log_text)
    assert report in (None, {"retries": 1}), report
    assert all(dead == victim and to == survivor for dead, _, to in sent_again), (victim, log_text)
    retried = any(kind.startswith("died") for _, kind, _ in sent_again)
    assert retries_metric == retried, (retries_metric, log_text)
    if not sent_again:
        print("the queued request was not on the killed engine this time; retry not exercised")
    for _ in range(3):  # new requests go to the survivor only
        assert client.completions.create(model=model, prompt="hi", max_tokens=3,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    print(f"dead engine out of rotation after {noticed_s:.2f} s")
    if not (resumed or retried):
        pytest.skip("the killed engine finished what it held before the kill: no resume or retry exercised")


def test_an_engine_restarted_by_hand_rejoins_and_takes_traffic(server, tmp_path):
    victim = server.victim
    address = re.search(r"engines join at (tcp://\S+)", server.text()).group(1)
    with open(tmp_path / "engine.log", "wb") as log:
        engine = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "engine", "--connect", address,
                                   "--engine-id", victim, "--model", str(server.model_path), "--max-num-seqs", "1",
                                   "--threads-per-instance", "1", "--kv-cache-memory", "8MiB", *server.secrets],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: server.health()["instances_alive"] == 2, timeout_s=180), \
            (tmp_path / "engine.log").read_text()[-2000:]
        # the rejoined engine is not mistaken for its dead predecessor: it stays alive
        time.sleep(1.0)
        assert server.health()["instances_alive"] == 2
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        # Least outstanding tokens sends one of two streams to the newcomer. Its load is read as each
        # stream starts: read once after both, a stream the newcomer took first could have finished
        # while the second started beside the other engine (session 28 saw {victim: 0, other: 141}).
        streams, loads = [], []
        for _ in range(2):
            streams.append(open_stream(client, model, "hello world", 480))
            loads.append(per_instance(server, "splitserve_instance_outstanding_tokens"))
        assert any(load[victim] > 0 for load in loads), loads
        assert [drain(s) for s in streams] == ["finished:length"] * 2
        assert wait_until(lambda: all_blocks_free(server.base_url))
        # The frontend holds no process handle for an engine started by hand: only its silence
        # (heartbeats every 0.25 s) tells. It must still leave the rotation, for that silence
        # (1.5 s; how much later the server gets to it depends on the box, so the deadline is generous).
        killed_at = time.monotonic()
        engine.kill()
        assert wait_until(lambda: not {i["id"]: i["alive"] for i in server.health()["instances"]}[victim],
                          timeout_s=30, interval_s=0.05), "a silent hand-started engine stayed in rotation"
        print(f"hand-started engine out of rotation {time.monotonic() - killed_at:.2f} s after SIGKILL")
        assert f"engine {victim} is dead (sent nothing for 1.5 s)" in server.log_path.read_text(errors="replace")
        assert client.completions.create(model=model, prompt="hi", max_tokens=3,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    finally:
        stop_process(engine)
