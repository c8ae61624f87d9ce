"""The fitted method end to end against fake servers: every arrangement up at once, probes
interleaved in rotating order on identical requests, a fitted capacity with an interval each,
and a probe stopped early that never counts a request it did not send."""
import json

import pytest
import yaml

from splitserve.cli import main

from test_trial_end_to_end import fake, spec_dict


def fitted_spec(**capacity):
    raw = spec_dict([{"name": "colocated", "command": fake("--serial", "--prefill-s-per-token", "0.004")},
                     {"name": "1P1D", "command": fake("--prefill-s-per-token", "0.0005")}])
    raw["arrivals"] = {"pattern": "constant", "rate": {"fraction_of_capacity": 0.5, "reference": "colocated",
                                                         "nominal": 4.0}, "num_requests": 12}
    raw["workload"]["classes"]["document"]["prompt_tokens"] = 60
    raw["slo"] = {"ttft_s": 0.5, "gap_s": 0.5, "max_pause_s": 1.0, "e2e_s": 3.0}
    raw["capacity"] = {"probe_requests": 12, "max_probes": 5, "precision": 0.3, **capacity}
    return raw


@pytest.mark.timeout(300)
def test_side_by_side_rounds_rotate_on_identical_requests_and_every_capacity_has_an_interval(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(fitted_spec()))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["side_by_side"][0]["together"]
    rounds = doc["rounds"]
    assert len(rounds) >= 2
    # the order rotates by one each round while both still search
    both = [r["order"] for r in rounds if len(r["order"]) == 2]
    assert both[0] == ["colocated", "1P1D"] and (len(both) < 2 or both[1] == ["1P1D", "colocated"])
    by_name = {a["name"]: a for a in doc["arrangements"]}
    probes = {n: [r for r in a["runs"] if r["purpose"] == "probe"] for n, a in by_name.items()}
    # round k replays the same requests (classes, prompt lengths) for every arrangement
    for k in range(len(both)):
        firsts = [next(r for r in probes[n] if r["summary"]["round"] == k) for n in by_name]
        shared = min(len(r["requests"]) for r in firsts)
        shapes = [[(q["index"], q["class_name"], q["num_prompt_tokens"]) for q in r["requests"][:shared]]
                  for r in firsts]
        assert shapes[0] == shapes[1]
    q = doc["quote"]
    for name in by_name:
        c = q["arrangements"][name]
        assert c["kind"] in ("point", "at_least", "at_most")
        if c["kind"] == "point":
            assert c["lo_rps"] <= c["estimate_rps"] <= c["hi_rps"]
    assert q["separated"] == "1P1D" and q["colocated"] == "colocated"
    assert doc["verdict"].startswith("Separate prefill: ")
    assert (out / "capacity.png").exists()
    # the fixed-rate run follows the reference's fitted capacity
    fixed = [r for r in by_name["1P1D"]["runs"] if r["purpose"] == "fixed"]
    assert fixed and fixed[0]["rate_multiplier"] == pytest.approx(doc["calibration"]["rate_multiplier"])


@pytest.mark.timeout(300)
def test_a_probe_stopped_early_counts_only_the_requests_it_decided(tmp_path):
    raw = fitted_spec(max_probes=2, probe_requests=40)
    raw["arrangements"] = raw["arrangements"][:1]
    raw["arrivals"]["rate"]["nominal"] = 40.0   # ten times what the serial fake holds: round 0 drowns
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    runs = [r for r in doc["arrangements"][0]["runs"] if r["purpose"] == "probe"]
    stopped = [r for r in runs if r["summary"]["stopped_early"]]
    assert stopped, "the serial fake at a high rate should stop a probe early"
    some_unsent = False
    for run in stopped:
        outcomes = run["summary"]["outcomes"]
        unsent = {q["index"] for q in run["requests"] if q["sent_s"] is None}
        undecided = {q["index"] for q in run["requests"] if q["error_kind"] == "probe_stopped"}
        some_unsent = some_unsent or bool(unsent)
        assert not unsent & set(outcomes["index"])
        assert run["summary"]["num_decided"] == len(outcomes["index"]) <= len(run["requests"]) - len(unsent)
        # a request the probe cut off is an outcome only if it was judged bad before the stop
        for i, good in zip(outcomes["index"], outcomes["good"]):
            if i in undecided:
                assert good is False
    assert some_unsent   # 40 requests in 1 s against a fake that serves ~4/s: the stop left some unsent


def test_a_phased_plan_is_probed_whole_or_on_the_phase_the_spec_names():
    from splitserve.trial.runner import phase_plan
    from splitserve.trial.spec import SpecError
    from splitserve.trial.workload import PlannedRequest

    plan = [PlannedRequest(i, "chat", t, [1], 1) for i, t in enumerate([0.0, 5.0, 12.0, 15.0, 31.0])]
    assert phase_plan(plan, [0.0, 10.0, 30.0], None) == plan
    second = phase_plan(plan, [0.0, 10.0, 30.0], 2)
    assert [r.index for r in second] == [2, 3] and [r.send_at_s for r in second] == [2.0, 5.0]
    with pytest.raises(SpecError, match="capacity.phase: 4"):
        phase_plan(plan, [0.0, 10.0, 30.0], 4)
