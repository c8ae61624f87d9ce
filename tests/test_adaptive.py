"""serve --adaptive: the mix loop on a running frontend, its adapter, its log and its metrics."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import deque

import httpx
import pytest

from cluster_support import Cluster, prompt_of
from splitserve.entrypoints import launch
from splitserve.coordinator.adaptive import AdaptiveMix, adaptive_from_args, check_adaptive_args, mix_views
from splitserve.api.api_server import build_app
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.request_state import STEP_WINDOW, Instance
from splitserve.coordinator.role_change import InstanceLoadView, RoleChangeRefused
from splitserve.protocol import EngineHello, EngineStats, StepSample
from splitserve.sampling import SamplingParams
from splitserve.control.mix import MixController, MixTargets, FALLBACK_STEP_MODEL
from splitserve.control.stepmodel import COEFFICIENTS
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("adaptive") / "m", arch="llama")


def serve_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    args = p.parse_args(list(flags))
    check_adaptive_args(args)
    return args


def test_flags_are_checked_with_the_fix_in_the_message():
    for flags, message in ((["--slo-ttft-s", "1"], "only apply with --adaptive"),
                           (["--adaptive", "--slo-gap-s", "0"], "--slo-gap-s must be positive"),
                           (["--adaptive", "--mix-interval-s", "-1"], "--mix-interval-s must be positive"),
                           (["--slo-tpot-s", "0.1"], "only apply with --adaptive"),
                           (["--adaptive", "--slo-tpot-s", "-0.1"], "--slo-tpot-s must be positive"),
                           (["--adaptive", "--profile", "missing.json"], "splitserve profile --out")):
        with pytest.raises(ValueError, match=message):
            serve_args(*flags)
    args = serve_args("--adaptive")
    assert (args.slo_ttft_s, args.slo_gap_s, args.mix_interval_s, args.slo_tpot_s) == (2.0, 0.25, 1.0, None)
    assert serve_args("--adaptive", "--slo-tpot-s", "0.12").slo_tpot_s == 0.12


def test_the_adapter_maps_each_field():
    measured = (StepSample(64, 2.048, 0, 0, 0.3), StepSample(0, 0.0, 2, 320, 0.03))
    loads = [InstanceLoadView("a", "prefill", True, False, 3, 900, num_queued_prompt_tokens=700,
                              num_running_requests=2, num_kv_tokens_used=320, step_seconds=0.04, step_tokens=64.0,
                              step_samples=measured, num_step_samples=57),
             InstanceLoadView("b", "decode", True, True, 0, 0, 0, 0, 0, 0.0, 0.0),
             InstanceLoadView("c", "colocated", False, False, 0, 0, 0, 0, 0, 0.0, 0.0)]
    a, b, c = mix_views(loads, {"a": 2}, default_threads=1)
    assert (a.instance_id, a.role, a.alive, a.queued_prompt_tokens, a.num_running, a.decode_kv_tokens, a.threads,
            a.recent_step_s) == ("a", "prefill", True, 700, 2, 320, 2, 0.04)
    assert a.num_step_samples == 57 and [(s.shape.prefill_tokens, s.shape.prefill_attn_ktok2, s.shape.decode_seqs,
                                           s.shape.decode_kv_tokens, s.seconds) for s in a.step_samples] == [
        (64, 2.048, 0, 0, 0.3), (0, 0.0, 2, 320, 0.03)]
    assert b.alive and b.threads == 1 and b.recent_step_s is None and b.step_samples == () and b.num_step_samples == 0
    assert not c.alive


def test_the_frontend_keeps_each_instances_last_300_step_samples_and_counts_them_all():
    inst = Instance(EngineHello("e", "colocated", "m", 512, 100, 16, 16, 8, 1), 0.0)
    for k in range(5):
        inst.observe_stats(EngineStats("e", "colocated", 0, 1, 16, 15, step_samples=[
            StepSample(0, 0.0, 1, 64 * k + i, 0.01) for i in range(64)]))
    assert inst.num_step_samples == 320 and len(inst.step_samples) == STEP_WINDOW == 300
    assert [s.decode_kv_tokens for s in inst.step_samples] == list(range(20, 320))  # the newest
    assert inst.stats.num_running == 1


class RefusingClient:
    """1P1D whose decode instance is swamped by long answers; every role change is refused."""

    def __init__(self) -> None:
        self.calls = 0
        now = time.monotonic()
        self.arrivals = deque((now - i * 0.5, 40, 128) for i in range(10))  # 2 chats/s, 128-token answers

    def load_view(self):
        return [InstanceLoadView("x", "prefill", True, False, 0, 0, 0, 0, 0, 0.0, 0.0),
                InstanceLoadView("y", "decode", True, False, 80, 8000, 0, 80, 12000, 0.0, 0.0)]

    async def change_role(self, instance_id, role):
        self.calls += 1
        raise RoleChangeRefused(f"{instance_id} is draining")


def test_a_refused_change_is_logged_counted_and_the_loop_goes_on():
    async def go():
        metrics = FrontendMetrics()
        controller = MixController(FALLBACK_STEP_MODEL, MixTargets(4.0, 0.5), patience=1, cooldown=0)
        mix = AdaptiveMix(RefusingClient(), metrics, controller, interval_s=0.01)
        mix.start()
        while mix.client.calls < 2:
            await asyncio.sleep(0.01)
        await mix.stop()
        refused = [d for d in mix.loop.decisions if d.get("applied") is False]
        assert len(refused) >= 2 and "RoleChangeRefused: x is draining" in refused[0]["error"]
        assert mix.loop.num_failed_changes >= 2 and mix.loop.num_role_changes == 0
        assert f'splitserve_mix_decisions_total{{action="refused"}} {float(mix.loop.num_failed_changes)}' \
            in metrics.render().decode()
    asyncio.run(go())


def test_documents_turn_two_colocated_instances_into_prefill_plus_decode_in_two_steps_losing_nothing(tiny):
    # The old rule moved one instance toward the stage under pressure (here: a colocated instance to
    # prefill, leaving a prefill instance beside a colocated one that the router never sends new work).
    # The what-if controller takes both steps to 1 prefill + 1 decode: with long prompts queued, every
    # colocated stream meets a prefill chunk per step, while a decode instance steps without them.
    async def go():
        async with Cluster(tiny, {"engine-0": "colocated", "engine-1": "colocated"}) as cluster:
            args = serve_args("--adaptive", "--slo-ttft-s", "60", "--slo-gap-s", "0.2", "--mix-interval-s", "0.05",
                              "--threads-per-instance", "1")
            mix = adaptive_from_args(args, cluster.client, cluster.client.metrics, 2)
            streams = [cluster.client.submit(f"doc-{i}", prompt_of(200, seed=i), SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True), []) for i in range(8)]
            for _ in range(200):
                await mix.run_once()
                if mix.loop.num_role_changes >= 2:
                    break
            first, second = mix.loop.changes()[:2]
            assert first["applied"] and second["applied"] and first["instance_id"] != second["instance_id"]
            assert "first of two steps to 1 prefill + 1 decode" in first["reason"]
            assert "second of two steps" in second["reason"] and "predicted inter-token" in second["reason"]
            roles = {v.instance_id: v.role for v in cluster.client.load_view()}
            assert sorted(roles.values()) == ["decode", "prefill"]
            moved = second["instance_id"]
            app = build_app(cluster.client, cluster.client.renderer, cluster.client.metrics, mix=mix)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
                body = (await http.get("/admin/mix")).json()
                assert body["roles"] == roles and body["num_role_changes"] == 2
                assert body["model"]["prior"] == FALLBACK_STEP_MODEL.for_threads(1).to_dict()
                assert body["changes"][1]["reason"] == second["reason"] and body["changes"][0]["wall_time"] > 0
                json.dumps(body, allow_nan=False)
                text = (await http.get("/metrics")).text
                assert 'splitserve_mix_decisions_total{action="change"} 2.0' in text
                assert f'splitserve_instance_role{{instance="{moved}",role="{roles[moved]}"}} 1.0' in text
                assert (await build_and_get_without_mix(cluster)).status_code == 404
            for stream in streams:  # nothing was lost by the changes
                finish = None
                async for event in stream:
                    finish = event.finish_reason or finish
                assert finish == "length"
            # one more request through the split, so the decode instance has stepped: the documents
            # may all have been answered on engine-1 (engine-0 hands back the prompts it had not started)
            assert (await cluster.generate(prompt_of(200, seed=99), 4))["finish"] == "length"
            # the engines' measured steps reach the controller: counted, and fitted once there are 30
            deadline = time.monotonic() + 60  # generous: stats come every 0.25 s, later on a loaded box
            while time.monotonic() < deadline:
                loads = cluster.client.load_view()
                if sum(v.num_step_samples for v in loads) >= 30:
                    break
                await asyncio.sleep(0.05)
            await mix.run_once()  # in its cooldown: no change, but the model is refitted
            loads = cluster.client.load_view()  # as run_once saw them: stats arrive on this loop only
            assert all(len(v.step_samples) == v.num_step_samples > 0 for v in loads)
            model = mix.snapshot()["model"]
            assert model["source"] == "online" and model["num_samples"] == sum(v.num_step_samples for v in loads)
            assert set(model["coefficients"]) == set(COEFFICIENTS) and model["median_abs_rel_error"] >= 0
            assert "model: online fit of" in mix.loop.decisions[-1]["reason"] and mix.loop.num_role_changes == 2
    asyncio.run(go())


async def build_and_get_without_mix(cluster: Cluster) -> httpx.Response:
    app = build_app(cluster.client, cluster.client.renderer, cluster.client.metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        return await http.get("/admin/mix")


class MidChangeClient(RefusingClient):
    """1P1D whose decode instance is in the middle of a role change (an operator's, or a takeover)."""

    def load_view(self):
        return [InstanceLoadView("p", "prefill", True, False, 0, 0, 0, 0, 0, 0.0, 0.0),
                InstanceLoadView("d", "decode", True, True, 0, 0, 0, 0, 0, 0.0, 0.0)]


def test_no_decision_fights_a_role_change_under_way_and_the_log_stays_valid_json():
    async def go():
        client = MidChangeClient()
        mix = AdaptiveMix(client, FrontendMetrics(), MixController(FALLBACK_STEP_MODEL, MixTargets(1, 1)),
                          interval_s=1.0)
        await mix.run_once()
        [entry] = mix.snapshot()["decisions"]
        assert entry["instance_id"] is None and "under way on d" in entry["reason"] and client.calls == 0
        # a stage with no instance at all: the estimate is inf, which JSON cannot carry
        client.load_view = lambda: [InstanceLoadView("p", "prefill", True, False, 0, 0, 0, 0, 0, 0.0, 0.0)]
        await mix.run_once()
        assert mix.snapshot()["decisions"][-1]["gap_estimate_s"] is None
        json.dumps(mix.snapshot(), allow_nan=False)
    asyncio.run(go())


def test_the_chunk_budget_knob_reaches_every_engine_and_shows_in_the_snapshot(tiny):
    async def go():
        async with Cluster(tiny, {"c0": "colocated", "d0": "decode"}) as cluster:
            args = serve_args("--adaptive", "--threads-per-instance", "1")
            mix = adaptive_from_args(args, cluster.client, cluster.client.metrics, 2)
            mix.loop.set_chunk_tokens(16)  # as the loop applies a decision that moved it
            deadline = time.monotonic() + 10
            while any(e.core.connector.chunk_tokens != 16 for e in cluster.engines.values()):
                assert time.monotonic() < deadline, "SetChunkTokens did not reach every engine"
                await asyncio.sleep(0.02)
            snapshot = mix.snapshot()
            assert snapshot["chunk_tokens"] is None and snapshot["num_chunk_moves"] == 0  # set by hand here
            cluster.client.set_chunk_tokens(None)  # each role's own again
            while any(e.core.connector.chunk_tokens == 16 for e in cluster.engines.values()):
                assert time.monotonic() < deadline, "SetChunkTokens(0) did not reach every engine"
                await asyncio.sleep(0.02)
    asyncio.run(go())
