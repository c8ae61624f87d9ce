"""`splitserve plan`: a ranked plan with a recommendation from a spec and a profile, for 2 cores
and for many instances; bad inputs refused naming the field; the simulator's speed target."""
from __future__ import annotations

import json
import random

import pytest

from splitserve.cli import main
from splitserve.control.planner import enumerate_arrangements
from splitserve.control.predict import Arrangement, simulate
from splitserve.control.profile_file import FORMAT, parse_profile
from splitserve.control.simulator import InstanceSpec, SimRequest

PROFILE = {
    "format": FORMAT,
    "model": {"name": "hand", "kv_bytes_per_token": 46080, "block_size": 16},
    "threads": {"1": {"step_model": {"overhead_s": 0.045, "per_prefill_token_s": 0.0027,
                                     "per_prefill_attn_s": 0.001, "per_decode_seq_s": 0.005,
                                     "per_decode_kv_token_s": 1.5e-5}}},
    "serial_fraction": 0.3,
    "kv_transfer": {"shm": {"latency_s": 0.005, "gb_per_s": 5.0}},
}
SPEC = """
name: small
seed: 3
workload:
  classes:
    chat: {prompt_tokens: {dist: uniform, min: 32, max: 96}, answer_tokens: 16}
    document: {prompt_tokens: 1200, answer_tokens: 8}
  mix: {chat: 4, document: 1}
arrivals: {pattern: poisson, rate: 0.5, num_requests: NUM}
slo: {ttft_s: 8.0, gap_s: 0.5, max_pause_s: 1.5, e2e_s: 30.0}
"""


@pytest.fixture
def files(tmp_path):
    def write(num_requests=30, profile=PROFILE):
        (tmp_path / "spec.yaml").write_text(SPEC.replace("NUM", str(num_requests)))
        (tmp_path / "profile.json").write_text(json.dumps(profile))
        return tmp_path / "spec.yaml", tmp_path / "profile.json", tmp_path / "plan.json"
    return write


def test_plan_for_two_cores_ranks_every_arrangement_and_explains_the_pick(files, capsys):
    spec, profile, out = files()
    assert main(["plan", str(spec), "--profile", str(profile), "--cores", "2", "--min-requests", "90",
                 "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["num_requests"] == 90 and plan["spec_num_requests"] == 30  # repeated back to back
    names = [a["name"] for a in plan["arrangements"]]
    assert "1P1D-1t/1t" in names and "colocated-chunked256-2x1t" in names and "colocated-whole-1x2t" in names
    assert all(a["cores"] == 2 for a in plan["arrangements"])
    assert plan["recommendation"]["name"] == names[0]
    assert plan["recommendation"]["reason"].startswith(f"Recommended: {names[0]}")
    first = plan["arrangements"][0]
    assert 0 <= first["predicted"]["attainment"] <= 1 and first["predicted"]["ttft_s"]["p99"] > 0
    printed = capsys.readouterr().out
    assert names[0] in printed and "Recommended" in printed


def test_plan_for_many_instances_at_a_high_rate_names_instance_counts(files):
    spec, profile, out = files(num_requests=100)
    assert main(["plan", str(spec), "--profile", str(profile), "--cores", "32", "--rate", "20", "--budgets", "256",
                 "--min-requests", "1", "--no-capacity", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["rate_rps"] == pytest.approx(20)
    counts = {len(a["instances"]) for a in plan["arrangements"]}
    assert 32 in counts and max(counts) <= 64
    assert any(a["name"].startswith("8P") for a in plan["arrangements"])
    assert plan["recommendation"]["serve_args"]


def test_enumeration_respects_cores_and_the_instance_cap():
    arrangements = enumerate_arrangements(16, budgets=(256,), max_instances=8)
    assert all(a.cores == 16 and len(a.instances) <= 8 for a in arrangements)
    assert {"colocated-chunked256-8x2t", "colocated-whole-1x16t"} <= {a.name for a in arrangements}


@pytest.mark.parametrize("args, field", [
    (["--cores", "0"], "--cores"),
    (["--rate", "-1"], "--rate"),
    (["--target", "1.5"], "--target"),
    (["--budgets", "256,lots"], "--budgets"),
    (["--transport", "tcp"], "kv_transfer.tcp"),
])
def test_plan_refuses_bad_arguments_naming_them(files, capsys, args, field):
    spec, profile, out = files()
    assert main(["plan", str(spec), "--profile", str(profile), "--out", str(out), *args]) == 2
    assert field in capsys.readouterr().err
    assert not out.exists()


def test_plan_refuses_a_malformed_profile_or_spec_naming_the_field(files, capsys):
    spec, profile, out = files(profile={**PROFILE, "kv_transfer": {"shm": {"latency_s": -1, "gb_per_s": 1}}})
    assert main(["plan", str(spec), "--profile", str(profile), "--out", str(out)]) == 2
    assert "kv_transfer.shm.latency_s" in capsys.readouterr().err
    spec, profile, out = files()
    spec.write_text(spec.read_text().replace("ttft_s", "ttft"))
    assert main(["plan", str(spec), "--profile", str(profile), "--out", str(out)]) == 2
    assert "slo.ttft" in capsys.readouterr().err
    assert main(["plan", str(spec), "--profile", str(profile.parent / "missing.json"), "--out", str(out)]) == 2
    assert "splitserve profile" in capsys.readouterr().err


def test_ten_thousand_requests_past_capacity_are_all_served_when_admission_is_unlimited():
    # The rate is far past capacity: the admission limit is lifted so that every request queues
    # and is served (with serve's limit most would be refused with a 429 and never reach the
    # scheduler). How long this takes is a benchmark, not an assertion: bench/planner_speed.py
    # (docs/benchmarks.md, "Planner", Speed).
    rng = random.Random(0)
    requests = [SimRequest(i, i * 0.25, rng.choice([48, 64, 1500]), 32) for i in range(10_000)]
    arrangement = Arrangement("2x1t", (InstanceSpec("colocated", 1),) * 2)
    done, _ = simulate(arrangement, parse_profile(PROFILE), requests, max_queued_requests=10_000)
    assert len(done) == 10_000
    assert all(r.outputs == 32 for r in done)


def test_one_kv_budget_per_arrangement_is_split_between_its_instances():
    arrangements = enumerate_arrangements(4, budgets=(256,), kv_total_bytes=4 << 30)
    assert {len(a.instances) for a in arrangements} == {1, 2, 3, 4}
    assert all(a.kv_cache_bytes == (4 << 30) // len(a.instances) for a in arrangements)


def test_two_instances_on_two_cores_are_simulated_with_the_steps_timed_beside_a_busy_engine():
    contended = {"overhead_s": 0.09, "per_prefill_token_s": 0.0054, "per_prefill_attn_s": 0.002,
                 "per_decode_seq_s": 0.01, "per_decode_kv_token_s": 3e-5}  # twice the lone step
    raw = json.loads(json.dumps(PROFILE))
    raw["threads"]["1"]["contended"] = {"step_model": contended}
    raw["host_contention"] = {"factor": 1.5}  # measured steps beside neighbours replace the factor
    profile = parse_profile(raw)
    lone = parse_profile(PROFILE).steps.for_threads(1)
    pair = Arrangement("2x1t", (InstanceSpec("colocated", 1),) * 2)
    separated = Arrangement("1P1D", (InstanceSpec("prefill", 1), InstanceSpec("decode", 1)))
    single = Arrangement("1x1t", (InstanceSpec("colocated", 1),))
    request = [SimRequest(0, 0.0, 100, 2)]
    for arrangement in (pair, separated):
        done, instances = simulate(arrangement, profile, request)
        assert all(i.model == profile.contended[1] for i in instances)
    done, instances = simulate(pair, profile, request)
    # one request alone on the pair: still the contended 100-token step (0.09 + 0.54 + attention)
    assert done[0].first_s == pytest.approx(profile.contended[1].step_s(100, 100 * 50 / 1000))
    done, instances = simulate(single, profile, request)
    assert instances[0].model == lone and done[0].first_s == pytest.approx(lone.step_s(100, 100 * 50 / 1000))


def test_the_plan_says_which_step_times_several_instances_use(files, capsys):
    spec, profile, out = files()
    assert main(["plan", str(spec), "--profile", str(profile), "--cores", "2", "--no-capacity",
                 "--out", str(out)]) == 0
    assert "no step times measured beside busy engines" in json.loads(out.read_text())["step_times_beside_neighbours"]
    assert "Step times: the profile has no step times measured beside busy engines" in capsys.readouterr().out


def test_the_plan_judges_each_class_by_its_own_slo_as_the_trial_does(files, tmp_path):
    """A class's own deadlines (`slo:` under the class) decide its attainment in the plan, as in the
    trial and compare: documents given 60 s for a first token are not judged by the global 1 s."""
    spec, profile, _ = files()
    tight = SPEC.replace("NUM", "30").replace("ttft_s: 8.0", "ttft_s: 1.0")
    lenient = tight.replace("document: {prompt_tokens: 1200, answer_tokens: 8}",
                            "document: {prompt_tokens: 1200, answer_tokens: 8, slo: {ttft_s: 60.0, e2e_s: 90.0}}")
    by_class = {}
    for name, text in (("tight", tight), ("lenient", lenient)):
        spec.write_text(text)
        out = tmp_path / f"{name}.json"
        assert main(["plan", str(spec), "--profile", str(profile), "--cores", "2", "--min-requests", "30",
                     "--no-capacity", "--out", str(out)]) == 0
        plan = json.loads(out.read_text())
        by_class[name] = {a["name"]: a["predicted"]["by_class"] for a in plan["arrangements"]}
    # a 1,200-token prompt takes over 3 s of prefill on this profile: never within 1 s, always within 60 s
    for name, classes in by_class["tight"].items():
        assert classes["document"]["attainment"] == 0.0, name
    assert all(c["document"]["attainment"] > 0.5 for c in by_class["lenient"].values())
    # the chats keep the global deadlines either way
    for name in by_class["tight"]:
        assert by_class["lenient"][name]["chat"]["attainment"] == by_class["tight"][name]["chat"]["attainment"]


def test_the_plan_gives_the_picks_capacity_at_the_slow_and_fast_ends_of_the_profiles_watched_step(files, capsys):
    import copy

    from splitserve.control.stepmodel import StepModel
    from splitserve.stepfeatures import prefill_attn_ktok2

    model = StepModel(**PROFILE["threads"]["1"]["step_model"])
    step = model.step_s(128, prefill_attn_ktok2(0, 128))
    # twenty readings of the watched step: 0.95-1.45x the model, as a VM's minutes might be
    factors = [0.95 + 0.5 * i / 19 for i in range(20)]
    profile = copy.deepcopy(PROFILE)
    profile["threads"]["1"]["drift"] = {"prompt_tokens": 128, "readings": [[5.0 * i, step * f]
                                                                            for i, f in enumerate(factors)]}
    spec, path, out = files(profile=profile)
    assert main(["plan", str(spec), "--profile", str(path), "--cores", "2", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    band = plan["speed_band"]
    assert band["readings"] == 20 and band["p10"] == pytest.approx(1.0, abs=0.01)
    assert band["p90"] == pytest.approx(1.4, abs=0.01) and band["span_s"] == 95.0
    pick = plan["arrangements"][0]
    ends = pick["capacity_band_rps"]
    assert ends["slow"] < pick["capacity_rps"] * 0.95            # 1.4x slower steps hold less
    assert ends["slow"] <= ends["fast"]
    other = next(a for a in plan["arrangements"] if a["kind"] != pick["kind"])
    assert "capacity_band_rps" in other                            # and the best of the other kind
    assert sum("capacity_band_rps" in a for a in plan["arrangements"]) == 2
    assert "At the speeds the profile's watched step ran (20 readings over 95 s: x1.00-x1.40" in \
        plan["recommendation"]["reason"]
    assert "x1.00-x1.40 the step model" in capsys.readouterr().out
    # a profile without the watch (every one before session 35): no band, no sentence
    spec, path, out = files()
    assert main(["plan", str(spec), "--profile", str(path), "--cores", "2", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["speed_band"] is None and not any("capacity_band_rps" in a for a in plan["arrangements"])
    assert "watched step" not in plan["recommendation"]["reason"]
