"""A prefill engine dies while requests wait on it (2 prefill + 1 decode): none of them had a
token yet, so each is retried once on the other prefill instance and completes; the client sees
the retry in the per-request report (`splitserve.retries`) and /metrics counts it.

The victim is SIGSTOPped first, so the requests are certainly stuck on it with no token (a tiny
model would otherwise prefill them before any kill could land), then SIGKILLed.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

from serve_disagg_support import DisaggServer, completion_body
from serve_support import metric_samples, wait_until
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-failure-disagg")
    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    srv = DisaggServer(str(model), "--prefill", "2", "--decode", "1", "--kv-transport", "shm",
                       log_path=root / "server.log").wait_ready()
    yield srv
    srv.stop()


def instances(server) -> dict[str, dict]:
    return {i["id"]: i for i in httpx.get(server.base_url + "/admin/instances", timeout=5).json()["instances"]}


@pytest.mark.timeout(240)
def test_requests_stuck_on_a_dead_prefill_engine_are_retried_on_the_other(server):
    rows = instances(server)
    victim = next(i for i, row in rows.items() if row["role"] == "prefill")
    os.kill(rows[victim]["pid"], signal.SIGSTOP)
    results: list[dict] = []

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(n: int) -> None:
                body = completion_body([5 + n, 6, 7, 8, 9, 10, 11, 12] * 4, 24, stream=False)
                resp = await client.post(server.base_url + "/v1/completions", json=body)
                results.append({"status": resp.status_code, **resp.json()})

            tasks = [asyncio.create_task(one(n)) for n in range(6)]
            # the router sends to the stopped engine while it still looks alive (heartbeats time out
            # after 1.5 s); kill it once some requests are stuck there
            for _ in range(100):
                if instances(server)[victim]["num_requests"] > 0:
                    break
                await asyncio.sleep(0.02)
            stuck = instances(server)[victim]["num_requests"]
            os.kill(rows[victim]["pid"], signal.SIGKILL)
            await asyncio.gather(*tasks)
            results.append({"stuck": stuck})

    asyncio.run(main())
    stuck = results.pop()["stuck"]
    assert stuck >= 1, "no request went to the stopped engine"
    assert [r["status"] for r in results] == [200] * 6, results
    assert [r["usage"]["completion_tokens"] for r in results] == [24] * 6
    retried = [r for r in results if (r.get("splitserve") or {}).get("retries") == 1]
    assert len(retried) == stuck, [r.get("splitserve") for r in results]
    assert all(r["splitserve"]["kv_transfer"]["outcome"] == "ok" for r in retried)  # prefilled elsewhere, moved
    assert sum(metric_samples(server.base_url, "splitserve_request_retries_total").values()) == stuck
    assert not instances(server)[victim]["alive"]

    def survivors_free() -> bool:
        used = metric_samples(server.base_url, "splitserve_instance_kv_blocks_used")
        return all(v == 0 for k, v in used.items() if re.search(r'instance="([^"]+)"', k).group(1) != victim)

    assert wait_until(survivors_free)
