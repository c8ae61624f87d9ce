"""Disaggregated routing, the per-request transfer report and the wire, without processes."""
from __future__ import annotations

import msgspec
import pytest

from splitserve.api.answer import splitserve_report, trial_report
from splitserve.coordinator.request_state import TokenEvent
from splitserve.coordinator.router import NoInstanceAvailable, RoutableRequest, Router
from splitserve.kv_transfer import SourceInfo, TransferDescriptor
from splitserve.protocol import (ApiEvent, ApiEvents, Codec, EngineStats, FromCoordinator, GenerateRequest, KVStats,
                                 KVTransferReport, StepOutputs, TokenOutput, WireSamplingParams)


def disagg_router(num_prefill: int = 2, num_decode: int = 2) -> Router:
    router = Router()
    for i in range(num_prefill):
        router.add_instance(f"p{i}", "prefill", max_requests=4)
    for i in range(num_decode):
        router.add_instance(f"d{i}", "decode", max_requests=4)
    return router


def start(router: Router, rid: str, prompt: int, answer: int):
    request = RoutableRequest(rid, prompt, answer)
    plan = router.pick(request)
    router.on_start(plan, request)
    return plan


def test_prefill_goes_to_least_queued_prompt_tokens_and_decode_to_least_running_tokens():
    router = disagg_router()
    first = start(router, "a", prompt=1000, answer=10)
    assert (first.prefill_instance_id, first.instance_id) == ("p0", "d0")
    second = start(router, "b", prompt=10, answer=500)
    # p0 holds 1000 prompt tokens, d0 only 10 answer tokens: b goes to p1 and d1
    assert (second.prefill_instance_id, second.instance_id) == ("p1", "d1")
    third = start(router, "c", prompt=10, answer=10)
    assert (third.prefill_instance_id, third.instance_id) == ("p1", "d0")
    assert router.instances["p0"].outstanding_tokens == 1000  # prompts only on prefill instances
    assert router.instances["d1"].outstanding_tokens == 500  # answers only on decode instances


def test_decode_ties_go_to_the_instance_with_more_free_blocks():
    router = disagg_router(1, 2)
    router.set_free_blocks("d0", 10)
    router.set_free_blocks("d1", 900)
    assert start(router, "a", 5, 0).instance_id == "d1"


def test_finish_releases_both_instances_and_drained_ones_take_nothing():
    router = disagg_router()
    plan = start(router, "a", 100, 20)
    for instance_id in (plan.prefill_instance_id, plan.instance_id):
        router.on_finish(instance_id, "a")
    assert all(x.outstanding_tokens == 0 and not x.requests for x in router.instances.values())
    router.drain("p0")
    router.drain("d0")
    for i in range(3):
        plan = start(router, f"r{i}", 10, 10)
        assert (plan.prefill_instance_id, plan.instance_id) == ("p1", "d1")


def test_a_missing_role_is_named_and_full_queues_are_refused():
    router = disagg_router(1, 1)
    router.mark_dead("d0")
    with pytest.raises(NoInstanceAvailable, match="no decode engine instance is alive"):
        router.pick(RoutableRequest("x", 1, 1))
    router = disagg_router(1, 1)
    for i in range(4):
        start(router, f"r{i}", 1, 1)
    with pytest.raises(NoInstanceAvailable, match="queue is full"):
        router.pick(RoutableRequest("x", 1, 1))


def test_colocated_instances_are_preferred_and_need_no_pair():
    router = Router()
    router.add_instance("c0")
    assert start(router, "a", 10, 10).prefill_instance_id is None


@pytest.mark.parametrize("outcome", ["ok", "recomputed", "failed"])
def test_transfer_report_passes_the_engine_outcome_through(outcome):
    """The decode instance decides ok | recomputed | failed; the frontend does not re-derive it."""
    report = trial_report(KVTransferReport(outcome, "p0", "shm", 4096, 0.002, 0.0, "boom", "injected"))
    assert report["outcome"] == outcome and report["bytes"] == 4096 and report["retries"] == 0
    assert ("error_kind" in report) == (outcome != "ok")


def test_descriptor_first_token_and_report_cross_the_wire_intact():
    codec = Codec()
    descriptor = TransferDescriptor(SourceInfo("p0", "tcp", (2, 2, 1, 8, 16, 4), "float32", "127.0.0.1", 4242),
                                    "r1", num_tokens=17, num_blocks=2)
    request = GenerateRequest("r1", [1, 2, 3], WireSamplingParams(max_tokens=4), descriptor, [7])
    assert codec.to_engine.decode(codec.encode(request)) == request
    out = StepOutputs("d0", [TokenOutput("r1", [9], True, "length",
                                         kv_transfer=KVTransferReport("ok", "p0", "tcp", 99, 0.01)),
                             TokenOutput("r2", [5], True, "prefill_done", kv_descriptor=descriptor)])
    assert codec.from_engine.decode(codec.encode(out)) == out
    stats = EngineStats("p0", "prefill", 0, 0, 10, 10, kv=KVStats(num_lease_expiries=3))
    assert codec.from_engine.decode(codec.encode(stats)).kv.num_lease_expiries == 3


def test_the_transfer_report_reaches_an_api_process_as_the_engine_sent_it_and_becomes_json_there():
    report = KVTransferReport("recomputed", "p0", "tcp", 99, 0.01, 0.002, "peer reset", "network")
    events = ApiEvents([ApiEvent("r1", [9], 3, 1, True, "length", kv_transfer=report)])
    received = msgspec.msgpack.Decoder(FromCoordinator).decode(msgspec.msgpack.encode(events))
    assert received.events[0].kv_transfer == report
    answer = splitserve_report(TokenEvent(num_prompt_tokens=3, num_completion_tokens=1, kv_transfer=report))
    assert msgspec.json.decode(msgspec.json.encode(answer)) == {"retries": 0, "kv_transfer": {
        "bytes": 99, "seconds": 0.01, "outcome": "recomputed", "retries": 0, "wait_seconds": 0.002, "source": "p0",
        "transport": "tcp", "error_kind": "network", "error": "peer reset"}}


def serve_args(*argv: str):
    import argparse

    from splitserve.entrypoints import launch

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return launch, parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,message", [
    (("--instances", "2", "--prefill", "1", "--decode", "1"), "cannot be mixed"),
    (("--prefill", "1"), "--decode"),
    (("--prefill", "2", "--decode", "1", "--kv-port", "7000"), "--kv-port"),
])
def test_serve_refuses_arrangements_that_cannot_work(argv, message):
    launch, args = serve_args(*argv)
    with pytest.raises(ValueError, match=message):
        launch.check_args(args)


def test_serve_builds_each_engine_config_once_and_sends_it_whole():
    """The engines get the EngineConfig serve built (msgspec on stdin), not flags parsed again."""
    from splitserve.engine.process import engine_config_from_args
    from splitserve.protocol import decode_engine_config, encode_engine_config

    launch, args = serve_args("--prefill", "2", "--decode", "1", "--kv-transport", "tcp", "--kv-fault-rate", "0.2",
                              "--kv-failure-policy", "fail", "--weight-format", "fp32")
    launch.check_args(args)
    roles = launch.engine_roles(args)
    assert roles == [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    config = engine_config_from_args(args, "prefill", "prefill-1")
    sent = decode_engine_config(encode_engine_config(config))
    assert sent == config
    assert (sent.role, sent.instance_id, sent.kv_failure_policy) == ("prefill", "prefill-1", "fail")
    assert sent.weight_format == "fp32"
    assert (sent.kv_transfer.transport, sent.kv_transfer.fault_rate, sent.kv_transfer.port) == ("tcp", 0.2, 0)
    cmd = launch.engine_command(args, "tcp://127.0.0.1:1", None)
    assert "--config-stdin" in cmd and "--kv-transport" not in cmd and "--role" not in cmd
    launch, args = serve_args()
    launch.check_args(args)
    assert launch.engine_roles(args) == [("engine-0", "colocated")]
    # a colocated engine gets the KV settings too: a live role change may need them
    assert engine_config_from_args(args, "colocated", "engine-0").kv_transfer.transport == "shm"


def test_prefix_affinity_sends_a_shared_prefix_back_to_its_prefill_instance():
    from splitserve.coordinator.router import AFFINITY_SLACK_TOKENS, prefix_key

    shared = list(range(100, 164))
    key = prefix_key(shared + [1, 2, 3])
    assert key == prefix_key(shared + [9]) and prefix_key(shared[:10]) is None
    for affinity, expected in ((True, "p0"), (False, "p1")):
        router = Router(prefix_affinity=affinity)
        for i in range(2):
            router.add_instance(f"p{i}", "prefill")
            router.add_instance(f"d{i}", "decode")
        for rid in ("a", "b"):
            request = RoutableRequest(rid, 500, 10, key)
            plan = router.pick(request)
            router.on_start(plan, request)
        assert plan.prefill_instance_id == expected  # p0 is 500 tokens busier: affinity outweighs that
    request = RoutableRequest("c", AFFINITY_SLACK_TOKENS + 1, 10, key)
    router = Router(prefix_affinity=True)
    router.add_instance("p0", "prefill")
    router.add_instance("p1", "prefill")
    router.add_instance("d0", "decode")
    router.on_start(router.pick(request), request)  # p0 now holds more than the slack
    assert router.pick(RoutableRequest("d", 10, 10, key)).prefill_instance_id == "p1"


def test_topology_file_names_local_and_remote_instances(tmp_path):
    from splitserve.entrypoints.topology import hand_start_command, parse_topology

    path = tmp_path / "topo.yaml"
    path.write_text("instances:\n  - {id: p0, role: prefill}\n  - {id: d0, role: decode}\n"
                    "  - {id: d-far, role: decode, host: 10.0.0.7}\n")
    launch, args = serve_args("--topology", str(path))
    launch.check_args(args)
    assert launch.engine_roles(args) == [("p0", "prefill"), ("d0", "decode")]
    far = args.topology_spec.remote
    assert [i.id for i in far] == ["d-far"]
    assert "--role decode --engine-id d-far --connect tcp://h:1" in hand_start_command(far[0], "tcp://h:1", None)
    launch, args = serve_args("--topology", str(path), "--prefill", "1", "--decode", "1")
    with pytest.raises(ValueError, match="--topology names every instance"):
        launch.check_args(args)


@pytest.mark.parametrize("data,message", [
    ({"instances": []}, "non-empty 'instances'"),
    ({"instances": [{"id": "a", "role": "teacher"}]}, r"instances\[0\].role"),
    ({"instances": [{"id": "a", "role": "prefill"}]}, "add a decode instance"),
    ({"instances": [{"id": "a", "role": "colocated"}, {"id": "a", "role": "colocated"}]}, "appears twice"),
    ({"instances": [{"id": "a b", "role": "colocated"}]}, r"instances\[0\].id"),
    ({"instances": [{"id": "a", "role": "colocated"}], "engine_adress": "x"}, "unknown field"),
])
def test_topology_mistakes_are_named(data, message):
    from splitserve.entrypoints.topology import parse_topology

    with pytest.raises(ValueError, match=message):
        parse_topology(data)
