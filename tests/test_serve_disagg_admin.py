"""Instances join and leave a running 1 prefill + 1 decode server.

- an engine started by hand (`splitserve engine --role decode --connect ADDR`) joins by itself;
- `DELETE /admin/instances/decode-0` drains the original decode instance: it takes no new
  requests, is told to shut down, and its process exits; traffic goes to the new one;
- `POST /admin/instances {"role": ...}` starts one more engine; a bad role is a 400;
- a hand-started engine that is killed is taken out by the health checks; as it was the last
  decode instance, the prefill instance takes over as colocated and requests keep being served.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from serve_disagg_support import DisaggServer, completion_body, stream_completion
from serve_support import REPO, all_blocks_free, metric_samples, process_alive, secret_flags, wait_until
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    model = str(write_tiny_checkpoint(root / "tiny", arch="llama"))
    secrets = secret_flags(root)  # an engine started by hand joins it
    srv = DisaggServer(model, "--prefill", "1", "--decode", "1", "--kv-transport", "shm", *secrets,
                       log_path=root / "server.log").wait_ready()
    srv.secrets = secrets
    yield srv, model, root
    assert srv.stop() == 0, srv.log()


def alive(srv) -> dict[str, bool]:
    return {i["id"]: i["alive"] for i in srv.health()["instances"]}


def complete(srv, n: int = 4) -> list[dict]:
    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(stream_completion(client, srv.base_url, completion_body([9, 8, 7, i], 6, True))
                                          for i in range(n)))
    return asyncio.run(go())


def test_hand_started_decode_engine_joins_and_drained_one_leaves(setup):
    srv, model, root = setup
    listing = httpx.get(srv.base_url + "/admin/instances").json()
    old_pid = {i["id"]: i["pid"] for i in listing["instances"]}["decode-0"]
    cmd = [sys.executable, "-m", "splitserve.cli", "engine", "--role", "decode", "--connect",
           listing["engine_address"], "--engine-id", "decode-hand", "--model", model, "--threads-per-instance", "1",
           "--kv-transport", "shm", "--kv-cache-memory", "8MiB", *srv.secrets]
    with open(root / "hand.log", "wb") as log:
        hand = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert wait_until(lambda: alive(srv).get("decode-hand") is True, timeout_s=120), (root / "hand.log").read_text()
        assert httpx.delete(srv.base_url + "/admin/instances/decode-0").status_code == 202
        assert wait_until(lambda: alive(srv)["decode-0"] is False, timeout_s=30)
        assert wait_until(lambda: not process_alive(old_pid), timeout_s=30), "a drained engine must exit"
        ok_before = metric_samples(srv.base_url, "splitserve_kv_transfers_total")['{outcome="ok"}']
        results = complete(srv)
        assert all(r["done"] and r["num_tokens"] == 6 and r["report"]["kv_transfer"]["outcome"] == "ok"
                   for r in results), results
        assert metric_samples(srv.base_url, "splitserve_kv_transfers_total")['{outcome="ok"}'] == ok_before + 4
        assert wait_until(lambda: all_blocks_free(srv.base_url))

        hand.send_signal(signal.SIGKILL)  # no parent watches it: only the heartbeat check can tell
        assert wait_until(lambda: alive(srv)["decode-hand"] is False, timeout_s=30)
        assert wait_until(lambda: {i["id"]: i["role"] for i in httpx.get(srv.base_url + "/admin/instances").json()[
            "instances"]}["prefill-0"] == "colocated", timeout_s=5)
        r = httpx.post(srv.base_url + "/v1/completions", json=completion_body([1, 2], 3, False))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert sum(metric_samples(srv.base_url, "splitserve_role_changes_total").values()) == 1
    finally:
        if hand.poll() is None:
            hand.kill()
        hand.wait()


def test_admin_post_starts_an_engine_of_the_given_role(setup):
    srv, _, _ = setup
    bad = httpx.post(srv.base_url + "/admin/instances", json={"role": "teacher"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
    r = httpx.post(srv.base_url + "/admin/instances", json={"role": "decode"})
    assert r.status_code == 202
    new_id = r.json()["id"]
    assert wait_until(lambda: alive(srv).get(new_id) is True, timeout_s=120)
    results = complete(srv, 2)
    assert all(r["done"] and r["num_tokens"] == 6 for r in results), results
    assert httpx.delete(srv.base_url + "/admin/instances/nope").status_code == 404
