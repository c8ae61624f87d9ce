"""Serving pieces without a server: router choice, the wire codec, CPU budget arguments."""
from __future__ import annotations

import os

import msgspec
import pytest

from splitserve.engine.process import parse_cpus
from splitserve.entrypoints.launch import core_sets
from splitserve.coordinator.router import NoInstanceAvailable, RoutableRequest, Router
from splitserve.protocol import (AbortRequests, Codec, EngineHello, EngineStats, GenerateRequest, Heartbeat,
                                 Shutdown, StepOutputs, StepSample, TokenOutput, WireSamplingParams)


def start(router: Router, request_id: str, prompt: int, answer: int) -> str:
    request = RoutableRequest(request_id, prompt, answer)
    plan = router.pick(request)
    router.on_start(plan, request)
    return plan.instance_id


def test_router_sends_each_request_to_the_least_outstanding_tokens():
    router = Router()
    router.add_instance("a")
    router.add_instance("b")
    assert start(router, "long", 1000, 100) == "a"
    assert start(router, "short-1", 10, 10) == "b"
    assert start(router, "short-2", 10, 10) == "b"  # b holds 40 tokens, a 1100
    router.on_progress("a", "long", num_prompt_done=1000, num_new_tokens=1)  # a now holds 99
    assert start(router, "mid", 50, 50) == "b"  # b: 40 < 99
    assert start(router, "next", 5, 5) == "a"  # a: 99 < b: 140
    router.on_finish("a", "long")
    router.on_finish("a", "next")
    assert router.instances["a"].outstanding_tokens == 0 and router.instances["a"].num_requests == 0


def test_router_respects_admission_limits_and_dead_instances():
    router = Router()
    router.add_instance("a", max_requests=1)
    router.add_instance("b", max_requests=1)
    start(router, "r1", 5, 5)
    start(router, "r2", 5, 5)
    with pytest.raises(NoInstanceAvailable) as full:
        start(router, "r3", 5, 5)
    assert full.value.retry_after_s >= 1
    held_by_a = router.instances["a"].requests.copy()
    assert router.mark_dead("a") == list(held_by_a)
    router.on_finish("b", "r2")
    assert start(router, "r4", 5, 5) == "b"  # never the dead one
    router.mark_dead("b")
    with pytest.raises(NoInstanceAvailable, match="alive"):
        start(router, "r5", 5, 5)


def test_every_wire_message_round_trips_through_its_direction():
    codec = Codec()
    to_engine = [GenerateRequest("r1", [1, 2, 3], WireSamplingParams(max_tokens=4, seed=7, stop_token_ids=[2])),
                 AbortRequests(["r1", "r2"]), Shutdown("bye")]
    from_engine = [EngineHello("e0", "colocated", "m", 512, 600, 100, 16, 8, 1234),
                   StepOutputs("e0", [TokenOutput("r1", [5], True, "length", 3, 0)]),
                   EngineStats("e0", "colocated", 1, 2, 100, 90), Heartbeat("e0"),
                   EngineStats("e0", "colocated", 1, 2, 100, 90, step_samples=[StepSample(64, 2.048, 2, 300, 0.05)])]
    for message in to_engine:
        assert codec.to_engine.decode(codec.encode(message)) == message
    for message in from_engine:
        assert codec.from_engine.decode(codec.encode(message)) == message
    # 64 step samples, the most one stats message carries, stay a small message (~45 bytes a sample)
    full = EngineStats("e0", "colocated", 1, 2, 100, 90,
                       step_samples=[StepSample(256, 98.3, 32, 40000, 0.123456, 0.125)] * 64)
    assert len(codec.encode(full)) < 3200


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xfe garbage", msgspec.msgpack.encode({"type": "no-such-tag"}),
    msgspec.msgpack.encode({"type": "abort", "request_ids": "not-a-list"}),
    msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt_token_ids": ["x"],
                            "params": {"max_tokens": 1}}),
])
def test_malformed_or_foreign_frames_are_refused_by_the_decoder(payload):
    with pytest.raises(msgspec.DecodeError):
        Codec().to_engine.decode(payload)


def test_an_engine_message_is_not_accepted_as_a_frontend_message():
    codec = Codec()
    with pytest.raises(msgspec.DecodeError):
        codec.to_engine.decode(codec.encode(Heartbeat("e0")))


def test_cpu_budget_arguments():
    assert parse_cpus("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError, match="--cpus"):
        parse_cpus("zero")
    cores = len(os.sched_getaffinity(0))
    assert core_sets(1, 1) == [str(min(os.sched_getaffinity(0)))]
    with pytest.raises(ValueError, match="--pin-cores"):
        core_sets(cores + 1, 1)


def test_engines_sleep_between_parallel_regions_when_their_threads_fill_the_cores(monkeypatch):
    import argparse

    from splitserve.entrypoints.launch import engine_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cores = len(os.sched_getaffinity(0))

    def env(policy, threads, engines):
        args = argparse.Namespace(omp_wait_policy=policy, threads_per_instance=threads)
        return engine_env(args, engines).get("OMP_WAIT_POLICY")

    assert env("auto", cores, 1) == ("PASSIVE" if cores > 1 else None)  # one engine on every core
    assert env("auto", 1, cores) is None  # single-threaded engines have no OpenMP team to park
    assert env("active", 2, 1) == "ACTIVE" and env("passive", 1, 1) == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own setting wins
    assert env("passive", 2, 1) == "ACTIVE"


def test_kernels_off_reaches_the_engines_and_makes_them_load_no_kernels(monkeypatch):
    """`serve --kernels off` (the engine before its C++ kernels, for before/after trials): the
    setting travels in the EngineConfig the engines get, not in their environment, and an engine
    built from it makes kernels.load() return None even where they are built."""
    import argparse

    from splitserve import kernels
    from splitserve.config import EngineConfig
    from splitserve.engine.process import engine_config_from_args
    from splitserve.entrypoints.launch import add_arguments, engine_env

    def serve_args(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p.parse_args(list(argv))

    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    args = serve_args("--kernels", "off")
    assert engine_config_from_args(args, "colocated", "engine-0").kernels == "off"
    assert engine_config_from_args(serve_args(), "colocated", "engine-0").kernels == "auto"
    assert "SPLITSERVE_KERNELS" not in engine_env(args, 2)
    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(kernels="of")
    monkeypatch.setattr(kernels, "_LOADED", [])
    monkeypatch.setattr(kernels, "built_library", lambda: pytest.fail("looked for the library although switched off"))
    kernels.switch_off()
    assert kernels.load() is None
    monkeypatch.setattr(kernels, "_LOADED", [])  # the environment variable still works in-process
    monkeypatch.setenv("SPLITSERVE_KERNELS", "off")
    assert kernels._load() is None
