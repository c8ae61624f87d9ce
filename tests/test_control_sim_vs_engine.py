"""The simulator schedules as the engine does, because it runs the engine's own scheduler.

The same recorded arrivals go to real EngineCores (tiny random-weight model; each step timed by
a fake clock: it lasts what the step model says for the batch the engine scheduled, and its
tokens count at its end) and to the simulator. Every step's batch (which requests decode, which
prefill and how many tokens) and every token's time must be the same: chunked, whole, the
priority policy, a cache so small that requests are preempted, and a prefill + decode pair."""
from __future__ import annotations

import heapq
import random

import pytest

from engine_support import make_engine
from splitserve.control.simulator import Instance, InstanceSpec, Simulation, SimRequest
from splitserve.control.stepmodel import StepModel
from splitserve.sampling import SamplingParams
from splitserve.stepfeatures import step_shape
from tiny_models import write_tiny_checkpoint

MODEL = StepModel(overhead_s=0.01, per_prefill_token_s=0.001, per_prefill_attn_s=0.002,
                  per_decode_seq_s=0.004, per_decode_kv_token_s=1e-5)
BLOCK = 16


def recorded_arrivals(seed: int, n: int = 14, priorities: bool = False,
                      answers: tuple[int, int] = (2, 12)) -> list[tuple[float, int, int, int]]:
    """(time, prompt tokens, answer tokens, priority): chats and documents, some arriving together;
    with priorities, documents are the less urgent class."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.choice([0.0, 0.02, 0.05, 0.15, 0.3])
        doc = rng.random() < 0.3
        out.append((round(t, 3), rng.randint(90, 150) if doc else rng.randint(5, 30), rng.randint(*answers),
                    (1 if doc else 0) if priorities else 0))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("simeng") / "m")


def _record(scheduler, log: list) -> None:
    """Log every non-empty batch the scheduler plans: (decoding ids, [(prefilling id, chunk)], its
    step shape)."""
    plan = scheduler.schedule

    def schedule():
        batch = plan()
        if batch:
            log.append(([r.request_id for r in batch.decodes], [(r.request_id, n) for r, n in batch.prefills],
                        step_shape(batch)))
        return batch
    scheduler.schedule = schedule


def run_engines(model_dir, arrivals, specs, kv) -> tuple[dict, dict, dict]:
    """The engines on virtual time, as the simulator moves it: arrivals join between steps, an idle
    engine with work starts a step once everything due at an instant has landed (prefill before
    decode), a step's outputs (and a prefill instance's handover) count at its end, and a KV
    transfer takes no time (the decode engine waits for the pull before its next step).
    Returns ({engine: [batch]}, {request id: [token times]}, {engine: (KV blocks, preemptions)})."""
    now = [0.0]
    engines = {}
    for k, spec in enumerate(specs):
        engines[f"{spec.role}-{k}"] = make_engine(
            model_dir, policy=spec.policy, budget=spec.budget, kv=kv, max_num_seqs=spec.max_num_seqs,
            role=spec.role, scheduling_policy=spec.scheduling, instance_id=f"{spec.role}-{k}",
            clock=lambda: now[0])
    first = next(name for name, e in engines.items() if e.role != "decode")
    decode = next((name for name, e in engines.items() if e.role == "decode"), None)
    logs = {name: [] for name in engines}
    for name, engine in engines.items():
        _record(engine.scheduler, logs[name])
    rng = random.Random(1)
    prompts = {}
    times: dict[str, list[float]] = {}
    events, seq, busy, pending = [], 0, set(), set()
    for i, (at, prompt, answer, priority) in enumerate(arrivals):
        prompts[str(i)] = ([rng.randrange(3, 250) for _ in range(prompt)],
                           SamplingParams(max_tokens=answer, ignore_eos=True), priority)
        heapq.heappush(events, (at, 0, i, None))
    try:
        while events or pending:
            if pending and (not events or events[0][0] > now[0]):
                todo = sorted(pending, key=lambda n: engines[n].role == "decode")
                pending.clear()
                for name in todo:
                    if name in busy:
                        continue
                    engine = engines[name]
                    steps = len(logs[name])
                    outputs = engine.step()
                    started_transfer = _wait_for_pulls(engine)
                    if len(logs[name]) > steps:  # it ran a batch: it ends after the step model's time
                        ends = now[0] + MODEL.step_s(*logs[name][-1][2])
                        busy.add(name)
                        seq += 1
                        heapq.heappush(events, (ends, 1, seq, (name, outputs)))
                    elif started_transfer:
                        pending.add(name)  # the KV has landed: it steps again at this instant
                continue
            at, kind, i, payload = heapq.heappop(events)
            now[0] = at
            if kind == 0:
                rid = str(i)
                prompt, params, priority = prompts[rid]
                engines[first].add_request(rid, prompt, params, priority=priority)
                pending.add(first)
                continue
            name, outputs = payload
            busy.discard(name)
            pending.add(name)
            for out in outputs:
                times.setdefault(out.request_id, []).extend([at] * len(out.new_token_ids))
                if out.kv_descriptor is not None:
                    prompt, params, priority = prompts[out.request_id]
                    engines[decode].add_request(out.request_id, prompt, params, kv_descriptor=out.kv_descriptor,
                                                first_token_ids=out.new_token_ids, priority=priority)
                    pending.add(decode)
        counts = {name: (e.block_manager.num_blocks, e.scheduler.num_preemptions) for name, e in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    return {name: [log[:2] for log in entries] for name, entries in logs.items()}, times, counts


def _wait_for_pulls(engine) -> bool:
    """A decode engine's transfers started this step: wait for their threads (no link time)."""
    receiver = getattr(engine.connector, "receiver", None)
    active = list(receiver._active.values()) if receiver is not None else []
    for transfer in active:
        transfer.future.result(timeout=30)
    return bool(active)


def run_simulator(arrivals, specs, num_blocks: int) -> tuple[dict, dict, dict]:
    instances = [Instance(f"{spec.role}-{k}", spec, MODEL, num_blocks=num_blocks, block_size=BLOCK)
                 for k, spec in enumerate(specs)]
    logs = {i.name: [] for i in instances}
    for inst in instances:
        _record(inst.scheduler, logs[inst.name])
    requests = [SimRequest(i, at, prompt, answer, priority=priority)
                for i, (at, prompt, answer, priority) in enumerate(arrivals)]
    sim = Simulation(instances)
    sim.fast_forward = False  # every step planned, so every batch is seen (the fast path has its own test)
    sim.run(requests)
    times = {}
    for i, r in enumerate(requests):
        assert r.finished_s is not None and r.outputs == r.answer_tokens
        stamps = [r.first_s]
        for gap in r.gaps:
            stamps.append(stamps[-1] + gap)
        times[str(i)] = stamps
    counts = {i.name: (i.blocks.num_blocks, i.num_preemptions) for i in instances}
    return {name: [log[:2] for log in entries] for name, entries in logs.items()}, times, counts


TIGHT = 16  # KV blocks: one document's worth and a few chats, so long answers run out and are preempted
CASES = {
    "chunked": ([InstanceSpec(budget=64)], 0, False, None),
    "chunked, budget 32": ([InstanceSpec(budget=32)], 1, False, None),
    "whole": ([InstanceSpec(policy="whole", budget=64)], 2, False, None),
    "priority": ([InstanceSpec(budget=64, scheduling="priority")], 3, True, None),
    "preempting": ([InstanceSpec(budget=64)], 4, False, TIGHT),
    "priority, preempting": ([InstanceSpec(budget=64, scheduling="priority")], 7, True, TIGHT),
    "1P1D": ([InstanceSpec("prefill", budget=64), InstanceSpec("decode", budget=64)], 5, False, None),
    "1P1D, priority": ([InstanceSpec("prefill", budget=64, scheduling="priority"),
                        InstanceSpec("decode", budget=64, scheduling="priority")], 6, True, None),
}


@pytest.fixture(scope="module")
def bytes_per_block(model_dir):
    probe = make_engine(model_dir, kv="1MiB")
    kv = probe.runner.kv_cache
    size = kv.numel() * kv.element_size() // probe.block_manager.num_blocks
    probe.close()
    return size


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_holds_the_same_batch_in_the_engine_and_the_simulator(model_dir, bytes_per_block, case):
    specs, seed, priorities, blocks = CASES[case]
    arrivals = recorded_arrivals(seed, priorities=priorities, answers=(20, 40) if blocks else (2, 12))
    engine_batches, engine_times, engine_counts = run_engines(
        model_dir, arrivals, specs, blocks * bytes_per_block if blocks else "4MiB")
    num_blocks = {n for n, _ in engine_counts.values()}.pop()
    assert blocks is None or num_blocks == blocks
    sim_batches, sim_times, sim_counts = run_simulator(arrivals, specs, num_blocks)
    assert sum(len(b) for b in engine_batches.values()) > len(arrivals)
    for name, batches in engine_batches.items():
        assert sim_batches[name] == batches, name
    assert sim_times.keys() == engine_times.keys()
    for rid, stamps in engine_times.items():
        assert sim_times[rid] == pytest.approx(stamps, abs=1e-9), rid
    assert sim_counts == engine_counts
    preempted = sum(p for _, p in engine_counts.values())
    assert (preempted > 0) == (blocks is not None)
    if priorities:  # the priority policy had something to reorder: a document and a chat both waiting
        assert any(len({arrivals[int(rid)][3] for rid, _ in prefills}) > 1 or decodes and prefills
                   for decodes, prefills in engine_batches[next(iter(engine_batches))])
