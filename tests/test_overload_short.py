"""Short versions of bench/overload.py and bench/soak.py, asserting the same properties.

One server (tiny model, one engine running 4 requests with 4 more queued). Overload: far more
requests than it can take, for ~10 s: every answer is a 200 or a 429/503 with Retry-After,
never a 5xx or a timeout; the engine queue never exceeds its bound; afterwards all KV blocks
are free and a request is served at once. Soak: a mixed load with abandoned streams and
timed-out clients for ~10 s: afterwards blocks are free and the processes hold no more open
files than before.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time

import httpx
import pytest

from serve_support import REPO, ServerProcess, all_blocks_free, wait_until
from tiny_models import write_tiny_checkpoint

sys.path.insert(0, str(REPO / "bench"))
from load import open_loop, random_completion, sample_tree  # noqa: E402

MAX_NUM_SEQS, MAX_QUEUED = 4, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("overload")
    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    srv = ServerProcess(str(model), "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                        "--kv-cache-memory", "8MiB", log_path=root / "server.log").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.flaky(reruns=2)  # timing-sensitive on a loaded 2-core box; see README known issues
def test_overload_gets_429_with_retry_after_bounded_queues_and_recovers(server):
    # 480 tokens (the tiny model's context is 512): since the C++ decode attention a 128-token answer
    # was short enough that a quiet box served 500 of 600 requests, which is no overload
    long_answer = {"prompt": "hello world the answer is", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    load = asyncio.run(open_loop(server.base_url, 60.0, 10.0, lambda i: (long_answer, None), timeout_s=120.0,
                                 max_in_flight=200))
    counts = load.counts()
    assert set(counts) <= {"ok", "rejected"}, counts  # no 5xx, no timeout, no dropped connection
    assert counts.get("ok", 0) > 0 and counts.get("rejected", 0) > counts.get("ok", 0), counts
    assert load.rejected_without_retry_after() == 0
    assert all(int(o.retry_after) >= 1 for o in load.outcomes if o.kind == "rejected")
    assert load.max_queued and max(load.max_queued.values()) <= MAX_QUEUED, load.max_queued
    assert wait_until(lambda: all_blocks_free(server.base_url), timeout_s=30)
    r = httpx.post(server.base_url + "/v1/completions", json={**long_answer, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_short_soak_with_aborts_leaks_no_blocks_or_file_descriptors(server):
    rng = random.Random(3)

    def mixed(i):
        body = random_completion(rng, max_prompt_words=30, max_tokens=(2, 64))
        return body, rng.randint(1, 5) if rng.random() < 0.4 else None

    asyncio.run(open_loop(server.base_url, 6.0, 3.0, mixed))  # warm-up: pools and lazy imports
    assert wait_until(lambda: all_blocks_free(server.base_url), timeout_s=30)
    time.sleep(1.0)
    before = sample_tree(server.proc.pid)
    load = asyncio.run(open_loop(server.base_url, 6.0, 10.0, mixed, timeout_s=60.0))
    counts = load.counts()
    assert counts.get("abandoned", 0) > 5 and counts.get("ok", 0) > 20, counts
    assert set(counts) <= {"ok", "abandoned", "rejected"}, counts
    assert wait_until(lambda: all_blocks_free(server.base_url), timeout_s=30)
    time.sleep(2.0)  # closed connections settle
    after = sample_tree(server.proc.pid)
    assert after.num_fds.keys() == before.num_fds.keys(), "a process appeared or vanished"
    assert sum(after.num_fds.values()) <= sum(before.num_fds.values()), (before.num_fds, after.num_fds)
    # asyncio's executor may start a thread or two lazily; a leak would be one per request
    assert sum(after.num_threads.values()) <= sum(before.num_threads.values()) + 2
    growth_mib = (sum(after.rss_bytes.values()) - sum(before.rss_bytes.values())) / 2**20
    assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB over a 10 s soak"
