"""Defects of issue 15 in the engine link, the dispatcher and the engine loop, each with the test
that failed before the fix: liveness a busy event loop cannot fake, wrongly-dead engines admitted
back and long-silent ones stopped, hellos checked, no leaked admission slot whatever the error,
unique ids inside, a stop string on the first token frees the prefill instance's blocks, one
request's exception fails that request only, and no decode instance alive is a 503.
"""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from cluster_support import Cluster, prompt_of
from engine_support import make_engine, run_to_end
from splitserve.api.engine_client import EngineClient
from splitserve.api.render import load_renderer
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.api.openai_schema import ApiError
from splitserve.coordinator.router import NoInstanceAvailable, RoutableRequest, Router
from splitserve.api.serving import OpenAIServing
from splitserve.protocol import Codec, EngineHello, Heartbeat, Shutdown, socket_identity
from splitserve.sampling import SamplingParams
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "m", arch="llama")


class FakeEngine:
    """Speaks the engine side of the link by hand: a hello, heartbeats, or silence."""

    def __init__(self, address: str, engine_id: str) -> None:
        self.engine_id, self.codec, self.ctx = engine_id, Codec(), zmq.Context()
        self.socks = {}
        for direction in ("in", "out"):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, socket_identity(engine_id, direction))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.socks[direction] = sock

    def hello(self, **fields) -> None:
        hello = EngineHello(self.engine_id, "colocated", "tiny", 512, 300, 64, 16, 2, 4242)
        self.socks["in"].send(self.codec.encode(msgspec.structs.replace(hello, **fields)))

    def heartbeat(self) -> None:
        self.socks["out"].send(self.codec.encode(Heartbeat(self.engine_id)))

    def received(self) -> list:
        out = []
        while self.socks["in"].poll(0):
            out.append(self.codec.to_engine.decode(self.socks["in"].recv()))
        return out

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.ctx.term()


async def started_client(renderer=None, **kwargs) -> EngineClient:
    client = EngineClient(renderer, Router(), FrontendMetrics(), max_queued_requests=0, **kwargs)
    client.start()
    return client


async def beat(engine: FakeEngine, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        engine.heartbeat()
        await asyncio.sleep(0.1)


def test_a_blocked_event_loop_does_not_make_live_engines_look_dead(tiny):
    async def go():
        async with Cluster(tiny, {"c0": "colocated"}, heartbeat_timeout_s=0.6) as cluster:
            time.sleep(1.5)  # the loop is stuck (a burst of huge prompts), the engine keeps beating
            await asyncio.sleep(0.5)  # the watchdog runs now
            assert cluster.client.instances["c0"].alive
            assert (await cluster.generate(prompt_of(10), 4))["finish"] == "length"
    asyncio.run(go())


def test_an_engine_wrongly_declared_dead_rejoins_and_one_silent_for_long_is_told_to_stop():
    async def go():
        client = await started_client(heartbeat_timeout_s=0.5, orphan_grace_s=1.0)
        engine = FakeEngine(client.address, "e0")
        try:
            engine.hello()
            await client.wait_ready(["e0"], 5)
            await asyncio.sleep(0.9)  # silent: declared dead
            assert not client.instances["e0"].alive
            await beat(engine, 0.3)  # it was only slow: admitted back
            assert client.instances["e0"].alive and client.router.instances["e0"].alive
            await asyncio.sleep(1.8)  # dead again, then silent past the grace: removed and told to stop
            assert client.instances["e0"].removed
            assert any(isinstance(m, Shutdown) for m in engine.received())
            await beat(engine, 0.3)  # an engine removed for good stays out
            assert not client.instances["e0"].alive
        finally:
            await client.shutdown()
            engine.close()
    asyncio.run(go())


def test_hellos_are_checked_and_a_live_engine_id_cannot_be_claimed_again():
    async def go():
        client = await started_client(heartbeat_timeout_s=5)
        engines = [FakeEngine(client.address, name) for name in ("e0", "bad-role", "zero-ctx", "other-model")]
        try:
            engines[0].hello()
            await client.wait_ready(["e0"], 5)
            engines[0].hello(max_model_len=8, pid=999)  # a second hello would shrink every context limit
            engines[1].hello(role="teacher")
            engines[2].hello(max_model_len=0)
            engines[3].hello(model_name="another")
            await asyncio.sleep(0.3)
            assert list(client.instances) == ["e0"]
            assert client.max_model_len == 512 and client.instances["e0"].hello.pid == 4242
        finally:
            await client.shutdown()
            for engine in engines:
                engine.close()
    asyncio.run(go())


def test_a_request_that_cannot_be_sent_leaks_no_admission_slot(tiny):
    async def go():
        client = await started_client(load_renderer(str(tiny)), heartbeat_timeout_s=5)
        engine = FakeEngine(client.address, "e0")  # admits 2 requests (max_num_seqs 2, no queue)
        try:
            engine.hello()
            await client.wait_ready(["e0"], 5)
            for _ in range(10):
                with pytest.raises(ValueError, match="out of range"):
                    client.submit("x", [5, 6, 7], SamplingParams(max_tokens=4, top_k=10**30), [])
            assert not client.router.instances["e0"].requests and not client.dispatcher.requests
            streams = [client.submit("x", [5, 6, 7], SamplingParams(max_tokens=4), []) for _ in range(2)]
            assert len(client.router.instances["e0"].requests) == 2  # both slots were still free
            for stream in streams:
                stream.close()
        finally:
            await client.shutdown()
            engine.close()
    asyncio.run(go())


def test_a_stop_string_on_the_first_token_frees_the_prefill_instances_blocks_at_once(tiny):
    async def go():
        async with Cluster(tiny, {"p": "prefill", "d": "decode"}, lease_s=30) as cluster:
            tokenizer = cluster.client.renderer.tokenizer
            for seed in range(50):  # a prompt whose first answer token is visible text
                prompt = prompt_of(12, seed)
                first = tokenizer.decode((await cluster.generate(prompt, 1))["tokens"])
                if first.strip():
                    break
            await cluster.wait_idle()
            # the same X-Request-Id twice at once: inside, each gets its own id
            a, b = await asyncio.gather(cluster.generate(prompt, 8, request_id="dup", stop=[first.strip()]),
                                        cluster.generate(prompt, 8, request_id="dup", stop=[first.strip()]))
            assert a["finish"] == b["finish"] == "stop"
            await cluster.wait_idle(timeout_s=5)  # far less than the 30 s lease: the blocks were dropped
    asyncio.run(go())


def test_an_exception_while_handling_one_request_fails_only_that_request(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for rid in ("a", "bad", "c"):
        engine.add_request(rid, prompt_of(20, ord(rid[0])), params)
    on_finished = engine.connector.on_finished

    def broken(request):
        if request.request_id == "bad":
            raise RuntimeError("boom")
        return on_finished(request)

    engine.connector.on_finished = broken
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = (out.finish_reason, out.error)
    assert finals["a"] == finals["c"] == ("length", None)
    assert finals["bad"][0] == "error" and "boom" in finals["bad"][1]
    execute = engine.runner.execute
    engine.runner.execute = lambda *a: (_ for _ in ()).throw(RuntimeError("kernel fault"))
    engine.add_request("d", prompt_of(20, 4), params)
    [out] = engine.step()
    assert out.finish_reason == "error" and "kernel fault" in out.error
    engine.runner.execute = execute
    engine.add_request("e", prompt_of(20, 5), params)
    assert len(run_to_end(engine)["e"]) == 5  # the engine lives on
    s = engine.stats()
    assert s.num_free_blocks == s.num_blocks_total


def test_no_decode_instance_alive_is_a_503_not_a_full_queue():
    router = Router()
    router.add_instance("p", "prefill")
    with pytest.raises(NoInstanceAvailable) as no_decode:
        router.pick(RoutableRequest("r", 5, 5))
    assert no_decode.value.status == 503

    class Client:
        async def generate(self, *args):
            raise no_decode.value

    with pytest.raises(ApiError) as answer:
        asyncio.run(OpenAIServing(Client(), None).submit("r", [1], SamplingParams(max_tokens=1), []))
    assert answer.value.status == 503 and answer.value.code == "no_engine"
