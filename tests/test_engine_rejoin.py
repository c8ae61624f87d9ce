"""A hand-started engine outlives its frontend: a new frontend started on the same address asks it
for its hello again (ResendHello) and serves through it (issue 15 item 9). The engine was running a
request for the old frontend when it died; the new frontend's ids restart from the same counter, so
the engine must drop the old request rather than refuse the new one as a duplicate.
"""
from __future__ import annotations

import asyncio

import pytest

from cluster_support import Cluster, prompt_of
from splitserve.api.engine_client import EngineClient
from splitserve.api.render import load_renderer
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.router import Router
from splitserve.sampling import SamplingParams
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rejoin") / "m", arch="llama")


def test_an_engine_rejoins_a_frontend_restarted_on_the_same_address(tiny):
    async def go():
        async with Cluster(tiny, {"c0": "colocated"}) as cluster:
            old = cluster.client
            stream = old.submit("r", prompt_of(8), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), [])
            async for _ in stream:
                break  # "r.0" is running on the engine when its frontend dies
            old.link.send = lambda *args: None  # a crash: the engine hears no Shutdown, no abort
            await old.shutdown()
            new = EngineClient(load_renderer(str(tiny)), Router(), FrontendMetrics(), bind=old.address,
                               heartbeat_timeout_s=1.0)
            cluster.client = new
            new.start()
            await new.wait_ready(["c0"], 10)
            result = await asyncio.wait_for(cluster.generate(prompt_of(8, seed=1), 6, request_id="r"), 30)
            assert result["error"] is None and len(result["tokens"]) == 6
            await cluster.wait_idle()  # the old frontend's request was dropped, not left running

    asyncio.run(go())

