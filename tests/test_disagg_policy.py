"""The disaggregation policy decides where a disaggregated request's prompt is prefilled: on the
prefill instance (remote) or on the decode instance the router picked (local), and says why."""
from __future__ import annotations

import argparse

import pytest

from splitserve.control.stepmodel import StepModel
from splitserve.coordinator.disagg_policy import (DisaggPolicy, add_disagg_arguments, check_disagg_args,
                                                  sized_chunk_tokens)
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.request_state import Instance
from splitserve.coordinator.router import RoutableRequest, Router
from splitserve.protocol import EngineHello, EngineStats

# 1 ms a step + 1 ms a prompt token + 2 ms a decode sequence: easy numbers to reason about
MODEL = StepModel(overhead_s=0.001, per_prefill_token_s=0.001, per_decode_seq_s=0.002)


def pair() -> Router:
    router = Router()
    router.add_instance("p", "prefill")
    router.add_instance("d", "decode")
    return router


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> RoutableRequest:
    return RoutableRequest(rid, len(prompt), max_tokens, None, prompt)


def place(policy: DisaggPolicy, router: Router, req: RoutableRequest, instances: dict | None = None):
    plan, placement = policy.place(router.pick(req), req, instances or {}, router)
    router.on_start(plan, req)
    return plan, placement


def queue_on_prefill(router: Router, rid: str, num_tokens: int) -> None:
    """A prompt sent to the prefill instance before the policy was asked (its queue grows)."""
    req = request(rid, list(range(num_tokens)))
    router.on_start(router.pick(req), req)


def instance(engine_id: str, role: str, running: int = 0, used_blocks: int = 0, queued: int = 0) -> Instance:
    hello = EngineHello(engine_id, role, "tiny", 4096, 256, 1000, 16, 64, 1)
    inst = Instance(hello, 0.0)
    inst.stats = EngineStats(engine_id, role, 0, running, 1000, 1000 - used_blocks, block_size=16,
                             num_queued_prompt_tokens=queued)
    return inst


def test_always_keeps_every_prompt_on_the_prefill_instance_and_counts_it():
    metrics = FrontendMetrics()
    policy, router = DisaggPolicy("always", metrics=metrics), pair()
    plan, placement = place(policy, router, request("a", [1, 2, 3]))
    assert plan.prefill_instance_id == "p" and placement is None  # as before: no report on the answer
    assert policy.counts == {("remote", "always"): 1}
    assert metrics.disagg_decisions.labels("remote", "always")._value.get() == 1


def test_threshold_prefills_short_prompts_on_the_decode_instance_and_long_ones_remotely():
    policy, router = DisaggPolicy("threshold", local_max_tokens=32), pair()
    plan, placement = place(policy, router, request("short", list(range(20))))
    assert plan.prefill_instance_id is None and plan.instance_id == "d"
    assert (placement.local, placement.reason) == (True, "short")
    plan, placement = place(policy, router, request("long", list(range(1000, 1100))))
    assert plan.prefill_instance_id == "p" and plan.instance_id == "d"
    assert (placement.local, placement.reason) == (False, "long")


def test_threshold_prefills_locally_a_long_prompt_whose_prefix_the_decode_instance_holds():
    policy, router = DisaggPolicy("threshold", local_max_tokens=32), pair()
    doc = list(range(300, 400))
    _, first = place(policy, router, request("doc", doc))
    assert not first.local  # the decode instance received its KV: its prefix cache holds it now
    plan, again = place(policy, router, request("follow-up", doc + [1, 2, 3, 4, 5]))
    assert plan.prefill_instance_id is None and (again.local, again.reason) == (True, "cached")
    assert again.cached_tokens == 96  # 6 full blocks of 16 (the last token is always recomputed)


def test_threshold_prefills_locally_when_the_prefill_queue_is_too_long():
    policy, router = DisaggPolicy("threshold", local_max_tokens=32, prefill_queue_max_tokens=500), pair()
    _, first = place(policy, router, request("doc1", list(range(600))))
    assert not first.local
    _, second = place(policy, router, request("doc2", list(range(1000, 1600))))
    assert (second.local, second.reason) == (True, "prefill_queue_full")  # 600 tokens already wait on p


def test_auto_prefers_remote_prefill_when_a_local_one_would_be_no_sooner():
    policy, router = DisaggPolicy("auto", steps=MODEL, slo_ttft_s=1.0, slo_gap_s=0.1, chunk_tokens=16), pair()
    # 10 streams on d: a decode step takes 21 ms, so the chat's two local chunks take 37 + 25 ms,
    # while p prefills it in 21 ms and d's next step (11 streams) and the handover add 23 + 10 ms
    busy = {"p": instance("p", "prefill"), "d": instance("d", "decode", running=10)}
    _, placement = place(policy, router, request("chat", list(range(20))), busy)
    assert (placement.local, placement.reason) == (False, "remote_meets_slo")
    assert placement.ttft_remote_s == pytest.approx(0.021 + 0.023 + 0.010)
    assert placement.ttft_local_s == pytest.approx(0.037 + 0.025)


def test_auto_prefills_a_chat_on_an_idle_decode_instance_where_its_first_token_comes_sooner():
    policy, router = DisaggPolicy("auto", steps=MODEL, slo_ttft_s=1.0, slo_gap_s=0.1, chunk_tokens=16), pair()
    _, placement = place(policy, router, request("chat", list(range(20))))
    assert (placement.local, placement.reason) == (True, "local_faster")  # no handover to wait for
    assert placement.ttft_local_s == pytest.approx(0.017 + 0.005)
    assert placement.ttft_local_s < placement.ttft_remote_s
    assert placement.stall_local_s == 0.0  # no stream there to slow down


def test_auto_keeps_a_long_prompt_remote_when_it_would_stall_the_decode_streams_too_long():
    policy, router = DisaggPolicy("auto", steps=MODEL, slo_ttft_s=1.0, slo_gap_s=0.1, chunk_tokens=16), pair()
    # p is 5,000 tokens behind: remote misses the 1 s target. On d each 16-token chunk keeps a step
    # within the 100 ms gap target (25 ms), but the 13 chunks of 200 tokens add 16 ms each to the
    # 4 streams' steps: 0.2 s in all, twice the gap target. The streams would pay; the document waits.
    instances = {"p": instance("p", "prefill", queued=5000), "d": instance("d", "decode", running=4)}
    queue_on_prefill(router, "doc", 5000)
    plan, placement = place(policy, router, request("long", list(range(1000, 1200))), instances)
    assert placement.gap_local_s == pytest.approx(0.025) and placement.stall_local_s == pytest.approx(0.2)
    assert placement.ttft_remote_s > 1.0 and placement.ttft_local_s < 1.0
    assert (placement.local, placement.reason) == (False, "neither_meets_slo") and plan.prefill_instance_id == "p"
    _, chat = place(policy, router, request("chat", list(range(20))), instances)
    assert (chat.local, chat.reason) == (True, "local_meets_slo")  # a short prompt there still costs 20 ms


def test_auto_prefills_a_short_prompt_locally_when_the_prefill_queue_would_miss_ttft():
    policy, router = DisaggPolicy("auto", steps=MODEL, slo_ttft_s=1.0, slo_gap_s=0.1, chunk_tokens=16), pair()
    instances = {"p": instance("p", "prefill", queued=5000), "d": instance("d", "decode", running=4)}
    queue_on_prefill(router, "doc", 5000)
    _, placement = place(policy, router, request("chat", list(range(20))), instances)
    assert (placement.local, placement.reason) == (True, "local_meets_slo")
    # two chunks (16 + 4 tokens), each beside 4 decodes
    assert placement.ttft_local_s == pytest.approx((0.001 + 0.016 + 0.008) + (0.001 + 0.004 + 0.008))
    assert placement.gap_local_s == pytest.approx(0.025)


def test_auto_sends_even_a_short_prompt_away_from_a_decode_instance_near_its_gap_target():
    policy, router = DisaggPolicy("auto", steps=MODEL, slo_ttft_s=1.0, slo_gap_s=0.1, chunk_tokens=16), pair()
    # 45 streams: a decode step takes 91 ms, near the 100 ms gap target; one that also carries a
    # 16-token chunk 107 ms. The prefill instance's queue (1000 tokens) makes the chat's TTFT 1.025 s,
    # (plus d's next step and the handover); a local prefill would stretch d's steps past the gap
    # target, which every one of its 45 streams would pay: remote
    busy = {"p": instance("p", "prefill"), "d": instance("d", "decode", running=45)}
    queue_on_prefill(router, "doc", 1000)
    _, placement = place(policy, router, request("chat", list(range(20))), busy)
    assert placement.gap_local_s == pytest.approx(0.107)
    assert placement.ttft_remote_s == pytest.approx(1.025 + 0.093 + 0.010)  # + d's next step + the handover
    assert (placement.local, placement.reason) == (False, "neither_meets_slo")
    idle = {"p": busy["p"], "d": instance("d", "decode", running=1)}
    _, placement = place(policy, router, request("chat2", list(range(20))), idle)
    assert placement.local, "the same chat, with the decode instance idle, is prefilled there"


def test_local_prompts_count_as_the_decode_instance_queue_until_their_first_token():
    policy, router = DisaggPolicy("auto", steps=MODEL, slo_ttft_s=1.0, slo_gap_s=0.1, chunk_tokens=16), pair()
    instances = {"p": instance("p", "prefill"), "d": instance("d", "decode")}
    queue_on_prefill(router, "doc", 5000)
    _, a = place(policy, router, request("a", list(range(500, 700))), instances)
    _, b = place(policy, router, request("b", list(range(800, 1000))), instances)
    assert a.local and b.local and b.ttft_local_s > a.ttft_local_s  # b waits behind a on the decode instance
    policy.on_prefilled("d", "a")
    _, c = place(policy, router, request("c", list(range(1200, 1400))), instances)
    assert c.ttft_local_s == pytest.approx(b.ttft_local_s)


def test_decode_first_prefers_the_decode_instance_holding_the_prefix():
    policy, router = DisaggPolicy("threshold", local_max_tokens=32), pair()
    router.add_instance("d2", "decode")
    doc = list(range(300, 400))
    plan, _ = place(policy, router, request("doc", doc, max_tokens=4))
    router.on_finish(plan.instance_id, "doc")
    router.on_finish("p", "doc")
    holder = plan.instance_id
    other = "d2" if holder == "d" else "d"
    queue = request("busy", [1, 2, 3], max_tokens=100)
    router.on_start(type(plan)(holder), queue)  # the holder is now the busier one, by 103 tokens
    assert router.pick(request("probe", doc)).instance_id == other  # the router alone would leave it
    plan, placement = place(policy, router, request("follow-up", doc + [7, 8]))
    assert plan.instance_id == holder and (placement.local, placement.reason) == (True, "cached")


def test_colocated_plans_are_left_alone():
    router = Router()
    router.add_instance("c", "colocated")
    policy = DisaggPolicy("threshold")
    plan, placement = place(policy, router, request("a", [1, 2, 3]))
    assert plan.instance_id == "c" and placement is None and not policy.counts


def test_chunk_sizing_follows_the_gap_target():
    assert sized_chunk_tokens(MODEL, gap_s=0.1, budget=256) == 64  # 1 + 64 + 16 ms = 81 ms; 128 would be 145
    assert sized_chunk_tokens(MODEL, gap_s=0.01, budget=256) == 16  # the floor
    assert sized_chunk_tokens(MODEL, gap_s=10.0, budget=100) == 64  # powers of two up to the budget


@pytest.mark.parametrize("flags, message", [
    (["--local-prefill-max-tokens", "64"], "only apply with --disagg-policy threshold or auto"),
    (["--disagg-policy", "threshold", "--local-prefill-chunk-tokens", "0"], "must be positive"),
    (["--disagg-policy", "auto", "--slo-gap-s", "0"], "must be positive seconds"),
])
def test_bad_flags_get_a_clear_error(flags, message):
    p = argparse.ArgumentParser()
    add_disagg_arguments(p)
    p.add_argument("--slo-ttft-s", type=float)
    p.add_argument("--slo-gap-s", type=float)
    with pytest.raises(ValueError, match=message):
        check_disagg_args(p.parse_args(flags))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="always, threshold, auto"):
        DisaggPolicy("sometimes")
