"""Rolling restart under a steady stream of requests: `splitserve admin restart --all` replaces
every instance of a 1 prefill + 1 decode server and of a 2-colocated one, one at a time, and not
one request fails: each answer is complete and the same greedy text as before the restart. The
replacements keep the roles, the old processes exit, no block stays in use, and a restart that
cannot be made (an unknown id, one already replaced) is refused clearly. Past a short drain
deadline, what the old instance still runs resumes on another one, and still nothing fails.
"""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import httpx
import pytest

import serve_disagg_support
from serve_disagg_support import DisaggServer, completion_body, stream_completion
from serve_support import REPO, metric_samples, process_alive, wait_until
from tiny_models import write_tiny_checkpoint

BODY = completion_body([5, 6, 7, 8, 9, 10, 11, 12] * 4, 24, stream=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("restart") / "tiny", arch="llama"))


class SteadyLoad(serve_disagg_support.SteadyLoad):
    """`clients` clients sending `body` one after another, in a thread, until stopped."""

    def __init__(self, base_url: str, clients: int = 2, body: dict = BODY) -> None:
        super().__init__(base_url, clients, body)


def instances(base_url: str) -> list[dict]:
    return httpx.get(base_url + "/admin/instances", timeout=10).json()["instances"]


def rolling_restart(srv, tmp_path, *arrangement):
    reference = asyncio.run(one(srv.base_url))
    assert reference["done"] and reference["num_tokens"] == 24, reference
    before = {i["id"]: i for i in instances(srv.base_url)}
    with SteadyLoad(srv.base_url) as load:
        assert wait_until(lambda: len(load.results) >= 4, timeout_s=60)
        began = time.monotonic()
        restart = subprocess.run([sys.executable, "-m", "splitserve.cli", "admin", "restart", "--all",
                                  "--url", srv.base_url], cwd=REPO, capture_output=True, text=True, timeout=900)
        ended = time.monotonic()
        assert restart.returncode == 0, restart.stderr + restart.stdout + srv.log()
        count_at_end = len(load.results)
        assert wait_until(lambda: len(load.results) >= count_at_end + 2, timeout_s=60)  # serving afterwards
    results = load.results
    failed = [r for r in results if not (r["done"] and r["error"] is None and r["text"] == reference["text"])]
    assert not failed, failed[:3]
    during = [r for r in results if r["started"] < ended and r["ended"] > began]
    assert len(during) >= 4, len(during)  # the load ran through the restart
    print(f"rolling restart of {arrangement}: {ended - began:.1f} s, {len(results)} requests, "
          f"{len(during)} during it, 0 failed\n{restart.stdout}")
    after = {i["id"]: i for i in instances(srv.base_url)}
    serving = {i: row["role"] for i, row in after.items() if row["alive"]}
    assert serving == {f"{i}.r1": row["role"] for i, row in before.items()}, (before, after)
    assert not any(after[i]["alive"] for i in before)
    assert wait_until(lambda: not any(process_alive(row["pid"]) for row in before.values()), timeout_s=30)
    assert wait_until(lambda: blocks_free_on(srv.base_url, serving), timeout_s=60)
    return restart.stdout


def blocks_free_on(base_url: str, ids) -> bool:
    """The serving instances hold no block and no request (the gauges of replaced ones keep
    their last values)."""
    for name in ("splitserve_instance_kv_blocks_used", "splitserve_instance_outstanding_tokens"):
        values = {re.search(r'instance="([^"]+)"', k).group(1): v for k, v in metric_samples(base_url, name).items()}
        if any(values.get(i, 0) != 0 for i in ids) or not set(ids) <= set(values):
            return False
    return True


async def one(base_url: str, body: dict = BODY) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        return await stream_completion(client, base_url, body)


def test_rolling_restart_of_1p1d_under_load_fails_no_request(model, tmp_path):
    srv = DisaggServer(model, "--prefill", "1", "--decode", "1", "--kv-transport", "shm",
                       log_path=tmp_path / "server.log").wait_ready()
    try:
        out = rolling_restart(srv, tmp_path, "1P1D")
        assert "prefill-0 -> prefill-0.r1 (prefill)" in out and "decode-0 -> decode-0.r1 (decode)" in out
        # a restart that cannot be made says why
        r = httpx.post(srv.base_url + "/admin/instances/nope/restart", timeout=10)
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        r = httpx.post(srv.base_url + "/admin/instances/prefill-0/restart", timeout=10)  # gone already
        assert r.status_code == 409 and "not serving" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log()


def test_rolling_restart_of_two_colocated_under_load_fails_no_request(model, tmp_path):
    srv = DisaggServer(model, "--instances", "2", log_path=tmp_path / "server.log").wait_ready()
    try:
        out = rolling_restart(srv, tmp_path, "2 colocated")
        assert "engine-0 -> engine-0.r1 (colocated)" in out and "engine-1 -> engine-1.r1 (colocated)" in out
        # A drain deadline too short for the requests running there: they resume on another
        # instance. Four clients with 200-token answers make it likely that some run there when
        # the drain begins (how many did is printed; that none fails is asserted).
        long_body = completion_body([5, 6, 7, 8, 9, 10, 11, 12] * 4, 200, stream=True)
        reference = asyncio.run(one(srv.base_url, long_body))
        with SteadyLoad(srv.base_url, clients=4, body=long_body) as load:
            assert wait_until(lambda: len(load.results) >= 4, timeout_s=120)
            r = httpx.post(srv.base_url + "/admin/instances/engine-0.r1/restart", json={"drain_deadline_s": 0.05},
                           timeout=900)
            assert r.status_code == 200, r.text
        assert r.json()["replacement"] == "engine-0.r2"
        failed = [x for x in load.results if not (x["done"] and x["error"] is None and x["text"] == reference["text"])]
        assert not failed, failed[:3]
        print(f"short drain deadline: {r.json()['resumed_requests']} requests resumed elsewhere, "
              f"{len(load.results)} requests, 0 failed")
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_replacement_id_counts_the_generations_of_an_instance():
    from splitserve.coordinator.rolling_restart import replacement_id

    assert replacement_id("prefill-0", {}) == "prefill-0.r1"
    assert replacement_id("prefill-0.r1", {}) == "prefill-0.r2"
    assert replacement_id("engine-1", {"engine-1.r1": None, "engine-1.r2": None}) == "engine-1.r3"
