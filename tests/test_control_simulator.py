"""The simulator against timelines worked out by hand from a simple step model:
step = 10 ms + 1 ms per prefill token + 5 ms per decode (no attention or KV terms)."""
from __future__ import annotations

import pytest

from splitserve.control.simulator import Instance, InstanceSpec, Simulation, SimRequest
from splitserve.control.stepmodel import StepModel

MODEL = StepModel(overhead_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.005)


def run(requests, *specs, transfer_s=0.0):
    instances = [Instance(f"i{k}", spec, MODEL, num_blocks=1000, block_size=16) for k, spec in enumerate(specs)]
    Simulation(instances, lambda n: transfer_s).run(requests)
    return instances


def token_times(req):
    times = [req.first_s]
    for gap in req.gaps:
        times.append(times[-1] + gap)
    return times


def test_one_request_prefills_in_one_step_then_decodes_one_token_per_step():
    req = SimRequest(0, 0.0, prompt_tokens=100, answer_tokens=3)
    run([req], InstanceSpec())
    assert token_times(req) == pytest.approx([0.11, 0.125, 0.14])
    assert req.finished_s == pytest.approx(0.14)


def test_two_prompts_contending_for_a_small_budget_share_steps_as_the_scheduler_does():
    # budget 128: A (100) is admitted whole, B gets the remaining 28 tokens; next step A decodes
    # first and B takes its last 72 tokens beside it.
    a, b = SimRequest(0, 0.0, 100, 2), SimRequest(1, 0.0, 100, 2)
    run([a, b], InstanceSpec(budget=128))
    assert token_times(a) == pytest.approx([0.138, 0.225])
    assert token_times(b) == pytest.approx([0.225, 0.240])


def test_a_long_prompt_arriving_during_decodes_is_chunked_beside_them():
    stream, doc = SimRequest(0, 0.0, 10, 5), SimRequest(1, 0.04, 200, 1)
    run([stream, doc], InstanceSpec(budget=128))
    # 0.02 first token; decodes at 0.035, 0.05; the doc joins at 0.05 with 127 tokens (0.142 s)
    # beside the decode, then its last 73 tokens (0.088 s)
    assert token_times(stream) == pytest.approx([0.02, 0.035, 0.05, 0.192, 0.28])
    assert doc.first_s == pytest.approx(0.28)


def test_whole_prefill_stalls_running_streams_for_the_whole_prompt():
    stream, doc = SimRequest(0, 0.0, 10, 5), SimRequest(1, 0.04, 200, 1)
    run([stream, doc], InstanceSpec(budget=256, policy="whole"))
    assert doc.first_s == pytest.approx(0.26)
    assert token_times(stream) == pytest.approx([0.02, 0.035, 0.05, 0.275, 0.29])
    assert max(stream.gaps) == pytest.approx(0.225)


def test_separated_request_streams_first_token_from_prefill_then_decodes_after_the_transfer():
    req = SimRequest(0, 0.0, 100, 3)
    run([req], InstanceSpec("prefill"), InstanceSpec("decode"), transfer_s=0.05)
    assert token_times(req) == pytest.approx([0.11, 0.175, 0.19])


def test_router_sends_simultaneous_requests_to_different_colocated_instances():
    a, b = SimRequest(0, 0.0, 100, 2), SimRequest(1, 0.0, 100, 2)
    first, second = run([a, b], InstanceSpec(), InstanceSpec())
    assert first.num_steps == second.num_steps == 2
    assert a.first_s == b.first_s == pytest.approx(0.11)


def test_running_out_of_kv_blocks_preempts_the_newest_and_recomputes_it():
    a, b = SimRequest(0, 0.0, 30, 20), SimRequest(1, 0.0, 30, 20)
    instance = Instance("i", InstanceSpec(), MODEL, num_blocks=5, block_size=16)
    Simulation([instance]).run([a, b])
    assert instance.num_preemptions >= 1
    assert a.outputs == b.outputs == 20 and instance.free_blocks == 5


def test_an_arrangement_without_a_stage_is_refused():
    with pytest.raises(ValueError, match="prefill and a decode"):
        run([SimRequest(0, 0.0, 10, 2)], InstanceSpec("prefill"))


def test_a_request_that_never_ran_misses_every_deadline_instead_of_crashing_the_score():
    from splitserve.control.predict import score
    from splitserve.trial.spec import SLO

    done = SimRequest(0, 0.0, 10, 2, first_s=0.1, last_s=0.2, finished_s=0.2, gaps=[0.1])
    never = SimRequest(1, 0.0, 5000, 2)  # no cache could hold it: no first token, no finish
    result = score([done, never], [], SLO(ttft_s=1.0, gap_s=1.0, max_pause_s=1.0, e2e_s=5.0))
    assert result["attainment"] == 0.5


def timelines(requests, specs, num_blocks, fast_forward, host_load=0.0):
    model = StepModel(0.045, 0.0026, 0.001, 0.005, 1.4e-5, 0.05)  # the bundled model's 1-thread shape, with panels
    instances = [Instance(f"i{k}", spec, model, num_blocks=num_blocks, block_size=16) for k, spec in enumerate(specs)]
    sim = Simulation(instances, lambda n: 0.002 + n * 1e-6, host_load=host_load)
    sim.fast_forward = fast_forward
    fresh = [SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.answer_tokens) for r in requests]
    sim.run(fresh)
    return ([(r.first_s, r.finished_s, r.gaps) for r in fresh],
            [(i.num_steps, i.num_preemptions, i.free_blocks, sim.router.instances[i.name].outstanding_tokens)
             for i in instances])


@pytest.mark.parametrize("specs, num_blocks, host_load", [
    ((InstanceSpec(budget=64),) * 2, 1000, 0.0),
    ((InstanceSpec(budget=256),), 50, 0.0),  # tight: decodes run out of blocks and preempt
    ((InstanceSpec(policy="whole"),), 1000, 0.0),
    ((InstanceSpec("prefill"), InstanceSpec("decode")), 1000, 0.0),
    ((InstanceSpec("prefill"), InstanceSpec("decode"), InstanceSpec("decode")), 50, 0.0),
    # host work: steps stretched by who else is busy, decided at each step's start
    ((InstanceSpec(budget=64),) * 2, 1000, 0.5),
    ((InstanceSpec("prefill"), InstanceSpec("decode")), 1000, 0.5),
    ((InstanceSpec("prefill"), InstanceSpec("decode"), InstanceSpec("decode")), 50, 0.8),
])
def test_batched_decode_steps_give_the_same_timeline_as_one_step_at_a_time(specs, num_blocks, host_load):
    import random
    rng = random.Random(1)
    requests, t = [], 0.0
    for i in range(150):
        t += rng.expovariate(3.0)
        requests.append(SimRequest(i, t, rng.choice([20, 60, 300, 700]), rng.randint(1, 60)))
    fast = timelines(requests, specs, num_blocks, True, host_load)
    slow = timelines(requests, specs, num_blocks, False, host_load)
    assert fast == slow  # exact: the same floats in the same order
    assert all(first is not None for first, _, _ in fast[0])
    if num_blocks == 50:
        assert sum(preempted for _, preempted, _, _ in fast[1]) > 0


def test_a_prompt_one_token_past_the_budget_gets_its_first_token_in_the_fast_path_too():
    # 65 tokens at a 64-token budget: a 64-token chunk (0.074 s), then the last prompt token runs
    # as a decode (the scheduler's is_prefilling is false) and samples the first token at 0.089 s.
    # The fast path used to count that step as a gap from t=0 (a 0.09 s "pause") and the first
    # token as arriving at the end of the stretch.
    req = SimRequest(0, 0.0, prompt_tokens=65, answer_tokens=4)
    run([req], InstanceSpec(budget=64))
    assert token_times(req) == pytest.approx([0.089, 0.104, 0.119, 0.134])
    assert len(req.gaps) == 3


def test_steps_beside_a_busy_instance_take_the_host_contention_factor_longer():
    # two instances, both start a 100-token prefill at t=0: each 0.11 s step doubles to 0.22 s.
    # The second request then finishes, so the first's decodes run alone at the profiled 0.015 s.
    a, b = SimRequest(0, 0.0, 100, 3), SimRequest(1, 0.0, 100, 1)
    instances = [Instance(f"i{k}", InstanceSpec(), MODEL, num_blocks=1000, block_size=16) for k in range(2)]
    Simulation(instances, contention=2.0).run([a, b])
    assert b.first_s == pytest.approx(0.22)
    assert token_times(a) == pytest.approx([0.22, 0.235, 0.25])


def test_a_lone_instance_is_never_slowed_by_host_contention():
    req = SimRequest(0, 0.0, prompt_tokens=100, answer_tokens=3)
    Simulation([Instance("i0", InstanceSpec(), MODEL, num_blocks=1000, block_size=16)], contention=2.0).run([req])
    assert token_times(req) == pytest.approx([0.11, 0.125, 0.14])
    with pytest.raises(ValueError, match="contention"):
        Simulation([Instance("i0", InstanceSpec(), MODEL, 1000, 16)], contention=0.5)


def test_host_work_takes_cores_from_engine_steps_only_when_the_engines_need_them():
    # 2 cores, the stack's host work keeps 0.5 busy: two busy 1-thread engines share 1.5 cores
    # (each step 2 / 1.5 times its profiled time); one busy engine still has a whole core.
    a, b = SimRequest(0, 0.0, 100, 3), SimRequest(1, 0.0, 100, 1)
    instances = [Instance(f"i{k}", InstanceSpec(), MODEL, num_blocks=1000, block_size=16) for k in range(2)]
    sim = Simulation(instances, host_load=0.5, cores=2)
    sim.run([a, b])
    assert b.first_s == pytest.approx(0.11 * 4 / 3)
    assert token_times(a) == pytest.approx([0.11 * 4 / 3, 0.11 * 4 / 3 + 0.015, 0.11 * 4 / 3 + 0.03])
    assert sim.stretch(1) == 1.0 and sim.stretch(2) == pytest.approx(4 / 3)
    assert sim.stretch(4, 2) == pytest.approx(1 / (1 - 0.5 * 2 / 4))  # a 2-thread engine waits for both


def test_a_lone_instance_of_two_threads_waits_for_whichever_thread_the_host_work_preempts():
    # 0.4 of a core taken from a 2-thread engine on 2 cores: each parallel region waits for the
    # preempted thread, so the engine runs 1 / (1 - 0.4) times longer (not 2 / 1.6)
    req = SimRequest(0, 0.0, prompt_tokens=100, answer_tokens=3)
    Simulation([Instance("i0", InstanceSpec(threads=2), MODEL, num_blocks=1000, block_size=16)],
               host_load=0.4, cores=2).run([req])
    assert token_times(req) == pytest.approx([0.11 / 0.6, 0.125 / 0.6, 0.14 / 0.6])
    spare = SimRequest(0, 0.0, prompt_tokens=100, answer_tokens=3)  # a third core takes the host work
    Simulation([Instance("i0", InstanceSpec(threads=2), MODEL, num_blocks=1000, block_size=16)],
               host_load=0.4, cores=3).run([spare])
    assert token_times(spare) == pytest.approx([0.11, 0.125, 0.14])
    idle = SimRequest(0, 0.0, prompt_tokens=100, answer_tokens=3)  # no host work: the profiled times
    Simulation([Instance("i0", InstanceSpec(threads=2), MODEL, num_blocks=1000, block_size=16)]).run([idle])
    assert token_times(idle) == pytest.approx([0.11, 0.125, 0.14])
    with pytest.raises(ValueError, match="host load"):
        Simulation([Instance("i0", InstanceSpec(), MODEL, 1000, 16)], host_load=-0.1)
