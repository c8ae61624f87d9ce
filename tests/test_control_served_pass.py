"""The profile's served pass (control/served_pass.py): steps of instances `serve` runs under chat
traffic, refitted with the profiled model as prior; which arrangements the planner gives them to,
and that the simulator then adds no host work on top."""
from __future__ import annotations

import copy
import json
import random

import pytest

from splitserve.control import profile as profile_mod
from splitserve.control.profile_file import ProfileError, parse_profile
from splitserve.control.stepmodel import StepModel, StepShape
from test_control_profile import HAND_WRITTEN
from tiny_models import write_tiny_checkpoint

LONE2 = {"overhead_s": 0.003, "per_prefill_token_s": 1.2e-5, "per_decode_seq_s": 6e-5, "per_decode_kv_token_s": 1e-8}
SERVED2 = {"overhead_s": 0.004, "per_prefill_token_s": 1.6e-5, "per_decode_seq_s": 6.5e-5,
           "per_decode_kv_token_s": 1e-8}


def served_doc(instances: int = 1) -> dict:
    doc = copy.deepcopy(HAND_WRITTEN)
    doc["threads"]["2"] = {"step_model": LONE2, "served": {"instances": instances, "threads_each": 2,
                                                           "step_model": SERVED2}}
    return json.loads(json.dumps(doc))


def test_the_served_steps_are_used_for_exactly_the_arrangement_the_pass_served():
    profile = parse_profile(served_doc(instances=1))
    assert profile.serves([2]) and not profile.serves([2, 2]) and not profile.serves([1]) and not profile.serves([])
    assert profile.instance_models([2]) == ([StepModel(**SERVED2)], 1.0)
    assert profile.instance_models([2, 2])[0] == [StepModel(**LONE2)] * 2  # not what it served: as before
    assert profile.instance_models([1])[0] == [profile.steps.for_threads(1)]
    assert "served pass" in profile.contention_note([2]) and "served pass" not in profile.contention_note([1])
    slow = profile.slowed(2.0)
    assert slow.instance_models([2])[0][0].overhead_s == pytest.approx(2 * SERVED2["overhead_s"])
    two = parse_profile(served_doc(instances=2))
    assert two.serves([2, 2]) and not two.serves([2])


def test_a_trial_calibration_drops_the_served_steps_and_bad_entries_are_named():
    doc = served_doc()
    doc["trial_calibration"] = {"threads": {"2": {"step_model": LONE2}}}
    assert not parse_profile(doc).served  # a trial's own steps speak instead
    bad = served_doc()
    bad["threads"]["2"]["served"]["instances"] = 1.5
    with pytest.raises(ProfileError, match=r"threads\.2\.served\.instances"):
        parse_profile(bad)
    bad["threads"]["2"]["served"] = {"instances": 1}
    with pytest.raises(ProfileError, match=r"threads\.2\.served\.step_model"):
        parse_profile(bad)


def test_the_simulation_adds_no_host_work_to_served_steps():
    """The served steps ran beside the stack's work: with them the prediction is the one without host
    work; the same model given as the lone one, with host work, is slower."""
    from splitserve.control.predict import Arrangement, simulate
    from splitserve.control.simulator import InstanceSpec, SimRequest

    heavy = {"idle_cores": 0.0, "per_request_s": 0.2, "per_token_s": 0.02}
    same = served_doc()
    same["threads"]["2"]["step_model"] = SERVED2  # lone == served: only the host work can differ
    lone_only = copy.deepcopy(same)
    del lone_only["threads"]["2"]["served"]
    arr = Arrangement("one", (InstanceSpec("colocated", threads=2, budget=256, max_num_seqs=16),),
                      kv_cache_bytes=64 << 20)
    rng = random.Random(3)
    requests = [SimRequest(i, i * 0.05, rng.randint(20, 200), rng.randint(8, 40)) for i in range(60)]

    def mean_e2e(doc: dict) -> float:
        done, _ = simulate(arr, parse_profile(doc), requests)
        return sum(r.finished_s - r.arrival_s for r in done) / len(done)

    served = mean_e2e({**same, "host_work": heavy})
    assert served == pytest.approx(mean_e2e(lone_only))  # no host work on top of served steps
    assert mean_e2e({**lone_only, "host_work": heavy}) > served * 1.05


def test_served_passes_run_for_thread_counts_that_divide_the_cores(monkeypatch):
    calls = []

    def fake(model, threads, instances, prior, vocab, seconds, log, max_model_len=None):
        calls.append((threads, instances, prior))
        return {"instances": instances, "step_model": prior.to_dict()}

    monkeypatch.setattr("splitserve.control.served_pass.measure_served", fake)
    monkeypatch.setattr(profile_mod.os, "cpu_count", lambda: 4)
    lone = {"kind": "prefill", "prefill_tokens": 32, "prefill_attn_ktok2": 0.5, "decode_seqs": 0,
            "decode_kv_tokens": 0}
    samples = [dict(lone, prefill_tokens=n, seconds=[0.01 * n / 32, 0.02 * n / 32]) for n in (32, 128, 512)]
    samples += [{"kind": "decode", "prefill_tokens": 0, "prefill_attn_ktok2": 0.0, "decode_seqs": b,
                 "decode_kv_tokens": b * 64, "seconds": [0.005 + 0.001 * b, 0.006 + 0.001 * b]} for b in (1, 4, 16)]
    slower = [dict(s, seconds=[3 * x for x in s["seconds"]]) for s in samples]
    doc = {**copy.deepcopy(HAND_WRITTEN), "threads": {str(t): {"samples": samples} for t in (1, 2, 3)}}
    doc["threads"]["1"]["contended"] = {"samples": slower}
    profile_mod.served_passes(doc, None, [1, 2, 3], 1000, lambda line: None)
    assert [(t, n) for t, n, _ in calls] == [(1, 4), (2, 2)]  # 3 does not divide 4 cores
    assert "served" not in doc["threads"]["3"]
    # several instances: the steps beside busy engines are the prior; one instance would take the lone ones
    prompt = StepShape(128, 8.192)
    assert calls[0][2].predict(prompt) > 2 * calls[1][2].predict(prompt)


@pytest.mark.timeout(180)
def test_a_served_pass_of_the_tiny_model_refits_on_the_steps_its_engines_reported(tmp_path):
    from splitserve.control.served_pass import MIN_STEPS, measure_served

    model = write_tiny_checkpoint(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    prior = StepModel(overhead_s=0.002, per_prefill_token_s=1e-5, per_decode_seq_s=5e-5, per_decode_kv_token_s=1e-8)
    entry = measure_served(str(model), 1, 1, prior, config["vocab_size"], seconds=4.0, log=lambda line: None,
                           max_model_len=config["max_position_embeddings"])
    assert entry["instances"] == 1 and entry["requests"] > 8 and entry["streamed_chunks"] > 100
    assert len(entry["samples"]) == entry["fit"]["num_steps"] >= MIN_STEPS
    assert entry["fit"]["num_prompt_steps"] > 0
    assert any(row[2] > 1 for row in entry["samples"])  # the clients kept several streams decoding at once
    refit = StepModel(**entry["step_model"])
    assert refit != prior  # the steps moved the fit
    assert entry["against_prior"]["decode"]["num_steps"] > 0
    doc = served_doc()
    doc["threads"]["1"]["served"] = json.loads(json.dumps(entry))
    assert parse_profile(doc).instance_models([1])[0] == [refit]


def test_a_full_profile_runs_the_served_passes_by_default_and_a_quick_one_does_not():
    import argparse

    parser = argparse.ArgumentParser()
    profile_mod.add_arguments(parser)
    args = parser.parse_args(["--out", "p.json"])
    assert args.served == "auto"
    assert profile_mod.runs_pass(args.served, quick=False)
    assert not profile_mod.runs_pass(args.served, quick=True)
    assert profile_mod.runs_pass("on", quick=True)
    assert not profile_mod.runs_pass("off", quick=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "p.json", "--served", "sometimes"])


def test_the_printed_plan_says_which_arrangement_runs_on_served_steps(tmp_path, capsys):
    from splitserve.cli import main
    from test_control_plan import SPEC

    spec, profile = tmp_path / "spec.yaml", tmp_path / "profile.json"
    spec.write_text(SPEC.replace("NUM", "30"))
    profile.write_text(json.dumps(served_doc(instances=1)))
    assert main(["plan", str(spec), "--profile", str(profile), "--cores", "2", "--no-capacity",
                 "--out", str(tmp_path / "plan.json")]) == 0
    printed = capsys.readouterr().out
    host = next(line for line in printed.splitlines() if line.startswith("Host work: "))
    assert "served pass ran (1 x 2 thread(s))" in host and "none is added" in host
