"""The stream cap (control/stream_cap.py, Scheduler.max_streams): past capacity an instance that
admits every prompt slows every stream past its deadline (demand_rotation_overload_x2, session 26:
52 writing answers admitted at once, none within its 40 s). The mix controller tells each instance
how many streams keep the strictest class's per-token allowance; requests past it wait, running
streams are never evicted, and nothing is lost."""
from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from splitserve.config import SchedulerConfig
from splitserve.control.mix import InstanceView, MixController, MixTargets, parse_slo_classes
from splitserve.control.mix_loop import MixLoop
from splitserve.control.stepmodel import StepModel
from splitserve.control.stream_cap import allowance_s, stream_cap
from splitserve.control.whatif import Demand
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.engine.scheduler import Scheduler
from splitserve.sampling import SamplingParams
from engine_support import make_engine, run_to_end
from tiny_models import write_tiny_checkpoint

# the online fit of session 26's x2 run (AMD EPYC Zen 4): 7.5 ms + 2.96 ms/prompt token + 2.6 ms/decode
MODEL = StepModel(overhead_s=0.0075, per_prefill_token_s=0.00296, per_prefill_attn_s=0.0007,
                  per_decode_seq_s=0.0026, per_decode_kv_token_s=1.4e-5)
CLASSES = "retrieval:4:0.5,writing:4:0.5::40,summary:15:0.5::45,chat:4:0.5"


def writing_surge(with_retrieval: bool) -> Demand:
    """10 s of writing (5.2/s, 50-token prompts, 200-token answers), after 10 s of retrieval."""
    arrivals = [(10 + i / 5.2, 50, 200, "writing") for i in range(52)]
    if with_retrieval:
        arrivals += [(i / 3.8, 350, 48, "retrieval") for i in range(38)]
    return Demand.from_arrivals(arrivals, 20.0, 15.0, 30.0)


def test_slo_classes_take_an_end_to_end_target_and_a_share_left_empty():
    writing, doc = parse_slo_classes("writing:4:0.5::40,doc:8:0.5:0.3:30")
    assert (writing.share, writing.e2e_s) == (1.0, 40.0) and (doc.share, doc.e2e_s) == (0.3, 30.0)
    assert parse_slo_classes("chat:2:0.25")[0].e2e_s is None
    for bad in ("w:4:0.5:1:x", "w:4:0.5:1:-3", "w:4:0.5:1:40:9", ":4:0.5"):
        with pytest.raises(ValueError, match="SLO class"):
            parse_slo_classes(bad)
    targets = MixTargets(4.0, 0.5, classes=(writing,), e2e_s=20.0)
    assert targets.e2e_of("writing") == 40.0 and targets.e2e_of("chat") == 20.0
    assert MixTargets(4.0, 0.5).e2e_of("writing") is None
    with pytest.raises(ValueError, match="end-to-end"):
        MixTargets(4.0, 0.5, e2e_s=0)


def test_the_strictest_class_sets_the_allowance_and_a_long_answer_due_in_40_s_binds():
    targets = MixTargets(4.0, 0.5, classes=parse_slo_classes(CLASSES), e2e_s=20.0)
    # writing: (40 - 4) s over 200 tokens = 0.18 s a token, stricter than any gap target
    assert allowance_s(writing_surge(False), targets) == pytest.approx(0.18)
    # with no end-to-end target the gap target is the allowance
    assert allowance_s(writing_surge(False), MixTargets(4.0, 0.5, classes=parse_slo_classes("writing:4:0.5"))) == 0.5
    # a TPOT target, when set, is one too
    assert allowance_s(writing_surge(False), MixTargets(4.0, 0.5, tpot_s=0.1)) == pytest.approx(0.1)
    assert allowance_s(Demand(), targets) is None


def test_the_cap_keeps_the_steps_within_the_allowance_and_lets_no_prefill_instance_be_held():
    targets = MixTargets(4.0, 0.5, classes=parse_slo_classes(CLASSES), e2e_s=20.0)
    demand = writing_surge(False)
    a = allowance_s(demand, targets)
    cap = stream_cap(MODEL, "colocated", demand, a, headroom=0.9)
    assert cap is not None and 10 < cap < 64

    def step(n: int) -> float:  # decodes of n streams plus their successors' prompt work, as the cap reads it
        context = demand.mean_prompt + demand.mean_answer / 2
        return MODEL.step_s(decode_seqs=n, decode_kv_tokens=int(n * context)) + \
            n * MODEL.per_prefill_token_s * demand.mean_prompt / demand.mean_answer
    assert step(cap) <= 0.9 * a + MODEL.per_panel_step_s < step(cap + 1)
    # a decode instance prefills nothing of its own: more streams keep the pace there
    assert stream_cap(MODEL, "decode", demand, a, 0.9) > cap
    assert stream_cap(MODEL, "prefill", demand, a, 0.9) is None
    # the retrieval backlog's long prompts in the window: each stream's successor costs more
    mixed = writing_surge(True)
    assert stream_cap(MODEL, "colocated", mixed, allowance_s(mixed, targets), 0.9) < cap
    # a generous allowance is no cap at all; an impossible one still lets one stream run
    assert stream_cap(MODEL, "colocated", demand, 60.0) is None
    assert stream_cap(MODEL, "colocated", demand, 0.001) == 1


def test_the_successors_are_the_prompts_arriving_now_where_they_are_lighter_than_the_window_s():
    """At a boundary from long prompts to short ones the window still holds the long ones, and a cap
    read on it holds the short prompts of the new phase behind a handful of streams (demand_rotation,
    session 30: 2-3 streams an instance while the next phase's chats waited 4-5 s); the newest
    seconds show what a stream that ends lets in. Heavier newest seconds (one document among
    chats) do not lower the cap ahead of the window."""
    targets = MixTargets(4.0, 0.5, classes=parse_slo_classes(CLASSES), e2e_s=20.0)
    writing = [(2 + i / 2.6, 50, 200, "writing") for i in range(26)]        # 2-12 s, still streaming
    summaries = [(12 + 2.4 * i, 1350, 35, "summary") for i in range(8)]    # 12-29 s
    chats = [(30 + 0.3 * i, 40, 80, "chat") for i in range(10)]            # 30-33 s: the next phase

    def cap(arrivals, now):
        d = Demand.from_arrivals(arrivals, now, 15.0, 30.0, newest_s=5.0)
        return stream_cap(MODEL, "colocated", d, allowance_s(d, targets), 0.9), d

    with_newest, d = cap(writing + summaries + chats, 33.0)
    assert d.mean_prompt > 2.5 * d.newest.mean_prompt  # the 15 s window: five summaries among the chats
    unread = Demand.from_arrivals(writing + summaries + chats, 33.0, 15.0, 30.0)  # no newest seconds read
    before = stream_cap(MODEL, "colocated", unread, allowance_s(unread, targets), 0.9)
    assert with_newest >= 2 * before  # the chats' successors, not the summaries'
    # the newest seconds heavier than the window: the window's reading stands
    docs_last = [(10 + i / 2, 40, 80, "chat") for i in range(20)] + [(19.5, 1350, 35, "summary")]
    heavy, d = cap(docs_last, 20.0)
    assert d.newest.mean_prompt > d.mean_prompt
    plain = Demand.from_arrivals(docs_last, 20.0, 15.0, 30.0)
    assert heavy == stream_cap(MODEL, "colocated", plain, allowance_s(plain, targets), 0.9)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cap") / "m", arch="llama")


def test_a_capped_engine_holds_the_rest_until_a_stream_ends_and_answers_every_request_alike(tiny):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": [5 + i, 6, 7, 8, 9, 10] for i in range(6)}
    free, capped = make_engine(tiny), make_engine(tiny)
    capped.set_max_streams(2)
    for engine in (free, capped):
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
    most, steps = 0, 0
    while capped.has_unfinished_requests():
        capped.step()
        steps += 1
        most = max(most, sum(1 for r in capped.scheduler.running if not r.remote_decode))
    assert most == 2  # never more than the cap, and the cap was reached
    free_steps = 0
    expected = {}
    while free.has_unfinished_requests():
        for out in free.step():
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)
        free_steps += 1
    assert steps > free_steps  # three waves of two, not one of six
    # nothing is lost and greedy answers do not depend on the batch
    again = make_engine(tiny)
    again.set_max_streams(3)
    for rid, prompt in prompts.items():
        again.add_request(rid, prompt, params)
    assert run_to_end(again) == expected
    with pytest.raises(ValueError, match="max streams"):
        again.set_max_streams(0)
    again.set_max_streams(None)
    assert again.scheduler.max_streams is None


def test_only_prompts_that_would_begin_an_answer_here_are_held_never_a_stream_that_has_begun():
    """Held, a stream whose first token is out would pause with its client waiting (x2, session 27
    on 8f0265e: summaries handed to a capped decode instance waited 7-25 s after their first token)."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(64, 16))
    scheduler.max_streams = 1
    params = SamplingParams(max_tokens=4)
    scheduler.add(Request("s", [1, 2, 3], params))
    for i in range(3):  # a prefill instance's prompts end on their first token here: never held
        scheduler.add(Request(f"p{i}", [4, 5, 6], params, remote_decode=True))
    fresh = Request("fresh", [1, 9, 9], params)
    scheduler.add(fresh)
    batch = scheduler.schedule()
    assert {r.request_id for r, _ in batch.prefills} == {"s", "p0", "p1", "p2"}
    assert list(scheduler.waiting) == [fresh]  # a new prompt past the cap waits

    def received(rid: str, first: list[int]) -> Request:  # KV already in its blocks
        r = Request(rid, [7, 8, 9, 10], params)
        scheduler.blocks.allocate(r, 4)
        r.num_computed_tokens, r.output_token_ids = 4, list(first)
        return r
    handed, streamed = received("kv", [11]), received("overlap", [])
    scheduler.add_prefilled(handed)  # handed over with its first token: joins past the cap
    scheduler.schedule()
    assert handed in scheduler.running and fresh in scheduler.waiting
    scheduler.add_prefilled(streamed)  # KV streamed ahead of its first token: not begun, held
    scheduler.schedule()
    assert list(scheduler.prefilled) == [streamed]
    # a stream preempted for blocks (its answer begun) is taken back past the cap as well
    preempted = Request("again", [2, 3, 4], params)
    preempted.output_token_ids = [5, 6]
    scheduler._to_waiting(preempted, front=True)
    scheduler.schedule()
    assert preempted in scheduler.running and fresh in scheduler.waiting
    scheduler.max_streams = None
    scheduler.schedule()
    assert streamed in scheduler.running and fresh in scheduler.running


def test_the_loop_tells_each_instance_its_cap_only_when_it_changes():
    targets = MixTargets(4.0, 0.5, classes=parse_slo_classes(CLASSES), e2e_s=20.0)
    views = [InstanceView("e0", "colocated"), InstanceView("e1", "colocated")]
    sent, demands = [], [writing_surge(False)]

    async def change_role(*_):
        raise AssertionError("no role change expected")
    loop = MixLoop(MixController(MODEL, targets), lambda: views, change_role, demand=lambda: demands[-1],
                   set_stream_caps=sent.append)
    asyncio.run(loop.run_once())
    assert len(sent) == 1 and set(sent[0]) == {"e0", "e1"} and sent[0]["e0"] == sent[0]["e1"] > 10
    assert loop.decisions[-1]["stream_caps"] == sent[0]
    asyncio.run(loop.run_once())  # the same demand: nothing sent again
    assert len(sent) == 1 and "stream_caps" not in loop.decisions[-1]
    demands.append(writing_surge(True))  # long prompts in the window: a lower cap
    asyncio.run(loop.run_once())
    assert len(sent) == 2 and sent[1]["e0"] < sent[0]["e0"]


def test_serve_takes_an_end_to_end_target_only_with_adaptive():
    from splitserve.coordinator.adaptive import add_adaptive_arguments, check_adaptive_args
    p = argparse.ArgumentParser()
    add_adaptive_arguments(p)
    with pytest.raises(ValueError, match="--slo-e2e-s only apply with --adaptive"):
        check_adaptive_args(p.parse_args(["--slo-e2e-s", "20"]))
    with pytest.raises(ValueError, match="--slo-e2e-s must be positive"):
        check_adaptive_args(p.parse_args(["--adaptive", "--slo-e2e-s", "-1"]))
    args = p.parse_args(["--adaptive", "--slo-e2e-s", "20", "--slo-classes", "writing:4:0.5::40"])
    check_adaptive_args(args)
    assert args.slo_e2e_s == 20


def first_token_order(engine, order: list[str]) -> list[str]:
    """`order`: the requests whose first token came already."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in order:
                order.append(out.request_id)
    return order


@pytest.mark.parametrize("deadlines,expected", [(True, ["a", "c", "b"]), (False, ["a", "b", "c"])])
def test_a_late_prompt_waits_behind_one_that_can_still_meet_its_deadline(tiny, deadlines, expected):
    now = [0.0]
    engine = make_engine(tiny, max_num_seqs=1, clock=lambda: now[0])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for rid, due in (("a", 10.0), ("b", 1.0), ("c", 10.0)):
        engine.add_request(rid, [5, 6, 7, 8], params, ttft_due_in_s=due if deadlines else None)
    engine.step()  # a runs; b and c wait for the one slot
    now[0] = 5.0  # b's first token is late now, c's is not
    assert first_token_order(engine, ["a"]) == expected
    with pytest.raises(ValueError, match="ttft_due_in_s"):
        engine.add_request("bad", [5, 6], params, ttft_due_in_s=float("nan"))


def test_a_request_s_first_token_deadline_reaches_its_engine_and_the_caps_reach_the_scheduler(tiny):
    from cluster_support import Cluster, prompt_of
    from splitserve.coordinator.adaptive import adaptive_from_args
    from test_adaptive import serve_args

    async def go():
        async with Cluster(tiny, {"engine-0": "colocated", "engine-1": "colocated"}) as cluster:
            args = serve_args("--adaptive", "--slo-ttft-s", "3", "--slo-gap-s", "0.5", "--slo-e2e-s", "20",
                              "--slo-classes", "writing:7:0.5::40", "--mix-interval-s", "0.05",
                              "--threads-per-instance", "1")
            mix = adaptive_from_args(args, cluster.client, cluster.client.metrics, 2)
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            sent = time.monotonic()
            streams = [cluster.client.submit_tokens(f"w{i}", prompt_of(20, seed=i), params, slo_class=cls)
                       for i, cls in enumerate(("writing", "", "writing"))]
            seen = {}
            deadline = time.monotonic() + 30
            while len(seen) < 3 and time.monotonic() < deadline:
                for engine in cluster.engines.values():
                    for rid, r in list(engine.core.requests.items()):
                        seen.setdefault(rid.split(".")[0], r.ttft_deadline)
                await asyncio.sleep(0.005)
            assert seen["w0"] == pytest.approx(sent + 7, abs=1.0) and seen["w2"] == pytest.approx(sent + 7, abs=1.0)
            assert seen["w1"] == pytest.approx(sent + 3, abs=1.0)  # no class: the global target
            for _ in range(3):
                await mix.run_once()
            caps = mix.snapshot()["stream_caps"]
            assert set(caps) == {"engine-0", "engine-1"} and mix.snapshot()["num_cap_moves"] >= 1
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                    cluster.engines[e].core.scheduler.max_streams != c for e, c in caps.items()):
                await asyncio.sleep(0.01)
            assert all(cluster.engines[e].core.scheduler.max_streams == c for e, c in caps.items())
            for stream in streams:
                async for _ in stream:
                    pass
    asyncio.run(go())


def test_a_separated_plan_waits_in_the_frontend_while_its_decode_instance_is_at_its_cap(tiny):
    # demand_rotation_overload_x2, session 28: in 1 prefill + 1 decode through the writing surge the
    # engine's cap held nothing (a handed-over stream has begun its answer), the decode instance
    # stepped every stream the prefill instance finished, at 1-2 s a token. The dispatcher holds a
    # separated plan before its prefill while the decode instance is full, and sends it as room opens
    from cluster_support import Cluster, prompt_of

    async def go():
        async with Cluster(tiny, {"engine-0": "prefill", "engine-1": "decode"}) as cluster:
            client = cluster.client
            dispatcher = client.dispatcher
            client.set_stream_caps({"engine-0": None, "engine-1": 2})
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            streams = [client.submit_tokens(f"r{i}", prompt_of(12, seed=i), params) for i in range(6)]
            assert len(dispatcher.held) == 4 and dispatcher._streams_on("engine-1") == 2
            aborted = streams.pop(5)
            aborted.close()  # a held request's client leaves: it goes, and holds nothing
            assert len(dispatcher.held) == 3
            # the controller sees the queue the hold made, on the prefill instance
            views = {v.instance_id: v for v in client.load_view()}
            assert views["engine-0"].num_queued_prompt_tokens >= 3 * 12
            most, outputs = 0, {}

            async def read(i, stream):
                tokens = []
                async for out in stream:
                    tokens += out.token_ids
                outputs[i] = tokens

            tasks = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
            while not all(t.done() for t in tasks):
                most = max(most, dispatcher._streams_on("engine-1"))
                await asyncio.sleep(0.002)
            assert most == 2 and not dispatcher.held
            assert all(len(outputs[i]) == 24 for i in range(5))
            # greedy answers are the same as with no cap
            client.set_stream_caps({"engine-1": None})
            free = [client.submit_tokens(f"f{i}", prompt_of(12, seed=i), params) for i in range(5)]
            assert not dispatcher.held
            again = {}
            for i, s in enumerate(free):
                again[i] = [t for out in [o async for o in s] for t in out.token_ids]
            assert again == outputs
    asyncio.run(go())
