"""The simulator schedules as the engine does: the same requests, added at the same step
boundaries to a real EngineCore (tiny model) and to the simulator (every step lasting exactly
one second), get their tokens in the same steps — chunking, short prompts first, whole prefill."""
from __future__ import annotations

import random

import pytest

from engine_support import make_engine
from splitserve.control.simulator import Instance, InstanceSpec, Simulation, SimRequest
from splitserve.control.stepmodel import StepModel
from splitserve.sampling import SamplingParams
from tiny_models import write_tiny_checkpoint

# (name, arrival step, prompt tokens, answer tokens): a stream, a long prompt arriving during
# it, then a short and a medium prompt arriving together while the long one is being chunked
REQUESTS = [("a", 0, 10, 6), ("b", 2, 70, 3), ("c", 3, 8, 4), ("d", 3, 40, 2), ("e", 5, 100, 3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("simeng") / "m")


def engine_steps(model_dir, policy: str, budget: int) -> dict[str, list[int]]:
    """For each request, the 1-based steps in which the engine gave it a token."""
    engine = make_engine(model_dir, policy=policy, budget=budget, kv="4MiB")
    rng = random.Random(0)
    got: dict[str, list[int]] = {}
    step = 0
    while step < 200 and (step <= max(r[1] for r in REQUESTS) or engine.has_unfinished_requests()):
        for name, at, prompt, answer in REQUESTS:
            if at == step:
                engine.add_request(name, [rng.randrange(3, 250) for _ in range(prompt)],
                                   SamplingParams(max_tokens=answer, ignore_eos=True))
        step += 1
        for out in engine.step():
            got.setdefault(out.request_id, []).extend([step] * len(out.new_token_ids))
    return got


def simulated_steps(policy: str, budget: int) -> dict[str, list[int]]:
    one_second = StepModel(overhead_s=1.0, per_prefill_token_s=0.0)
    instance = Instance("i", InstanceSpec("colocated", 1, policy, budget), one_second, num_blocks=1000, block_size=16)
    requests = [SimRequest(i, float(at), prompt, answer, name) for i, (name, at, prompt, answer) in enumerate(REQUESTS)]
    Simulation([instance]).run(requests)
    out = {}
    for r in requests:
        times = [r.first_s]
        for gap in r.gaps:
            times.append(times[-1] + gap)
        out[r.class_name] = [round(t) for t in times]
    return out


@pytest.mark.parametrize("policy, budget", [("chunked", 32), ("chunked", 64), ("whole", 64)])
def test_simulated_steps_match_the_engine(model_dir, policy, budget):
    assert simulated_steps(policy, budget) == engine_steps(model_dir, policy, budget)
