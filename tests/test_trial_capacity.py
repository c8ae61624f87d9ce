"""Capacity within the SLOs: grow-then-bisect on a known threshold, the rate relative to a reference,
repeats in rotating order, and results.json written as each run ends."""
import json

import pytest
import yaml

from splitserve.cli import main
from splitserve.trial.capacity import Probe, search_capacity
from splitserve.trial.method import TuneSpec, grid_arrangements
from splitserve.trial.runner import Trial
from splitserve.trial.spec import Arrangement, SpecError, parse_spec

from test_trial_end_to_end import fake, spec_dict


def threshold_probe(limit, seconds=10.0, log=None):
    def probe(m):
        if log is not None:
            log.append(m)
        return Probe(m, 1.0 if m <= limit else 0.5, 2.0 * m, seconds / m)  # faster arrivals, shorter probe
    return probe


def test_search_grows_until_a_probe_fails_then_bisects_to_the_precision():
    tried = []
    found = search_capacity(threshold_probe(3.0, log=tried), start=1.0, target=0.9, precision=0.1)
    assert tried[:3] == [1.0, 2.0, 4.0]                            # grow x2 until it fails
    assert found.passed.multiplier <= 3.0 < found.failed.multiplier
    assert found.failed.multiplier <= found.passed.multiplier * 1.1 and found.stopped_by == "precision"
    assert found.capacity_rps == pytest.approx(2.0 * found.passed.multiplier)


def test_search_shrinks_when_the_start_fails_and_reports_nothing_held_at_the_floor():
    found = search_capacity(threshold_probe(0.3), start=1.0, target=0.9)
    assert found.passed.multiplier <= 0.3 < found.failed.multiplier
    nothing = search_capacity(threshold_probe(-1.0), start=1.0, target=0.9, max_probes=30)
    assert nothing.passed is None and nothing.capacity_rps is None and nothing.stopped_by == "floor"


def test_the_budget_ends_the_bisection_but_never_the_growth_before_a_rate_fails():
    found = search_capacity(threshold_probe(3.0, seconds=10.0), start=1.0, target=0.9, budget_s=16.0,
                            beaten=lambda m: True)
    # x1 (10 s) and x2 (5 s) pass; x4 (2.5 s) is still tried past the budget and fails; the
    # bisection's x2.83 (3.5 s more) would end past it
    assert [p.multiplier for p in found.probes] == [1.0, 2.0, 4.0] and found.stopped_by == "budget"
    assert found.passed.multiplier == 2.0 and found.failed.multiplier == 4.0


def test_the_budget_never_ends_the_bisection_of_an_arrangement_still_in_the_running():
    # nobody else held x4: this search is a contender and is narrowed to the precision past its budget
    asked = []
    contender = search_capacity(threshold_probe(3.0, seconds=10.0), start=1.0, target=0.9, budget_s=16.0,
                                precision=0.2, beaten=lambda m: asked.append(m) or m <= 2.5)
    assert asked  # it asked whether its failing rate had been held by another arrangement
    assert contender.stopped_by == "precision"
    assert contender.failed.multiplier <= contender.passed.multiplier * 1.2
    assert contender.passed.multiplier <= 3.0 < contender.failed.multiplier
    # once another arrangement held its failing rate, the budget ends it as before
    out = search_capacity(threshold_probe(3.0, seconds=10.0), start=1.0, target=0.9, budget_s=16.0,
                          precision=0.2, beaten=lambda m: m <= 5.0)
    assert out.stopped_by == "budget" and len(out.probes) == 3
    never_fails = search_capacity(threshold_probe(1e9, seconds=10.0), start=1.0, target=0.9, budget_s=1.0,
                                  max_probes=5)
    assert never_fails.stopped_by == "max_probes" and sum(p.seconds for p in never_fails.probes) < 20.0


def test_the_tuning_grid_sets_each_colocated_knob_and_refuses_unequal_cores():
    base = Arrangement("colocated", serve_args=["--instances", "1", "--threads-per-instance", "2"], cores=2)
    points = grid_arrangements(TuneSpec("colocated", [64, 256], [(1, 2), (2, 1)]), base, 2)
    assert [p.name for p in points] == ["colocated@64tok-1x2", "colocated@64tok-2x1", "colocated@256tok-1x2",
                                        "colocated@256tok-2x1"]
    assert points[1].serve_args == ["--instances", "2", "--threads-per-instance", "1", "--prefill-policy", "chunked",
                                    "--max-num-batched-tokens", "64"]
    with pytest.raises(SpecError, match="2x2 uses 4 cores"):
        grid_arrangements(TuneSpec("colocated", [], [(2, 2)]), base, 2)


def fake_spec(**extra):
    # a serial fake: 0.02 s of "prefill" per prompt token blocks every stream, so load piles up
    raw = spec_dict([{"name": "slow", "command": fake("--serial", "--prefill-s-per-token", "0.004")},
                     {"name": "fast", "command": fake("--prefill-s-per-token", "0.0005")}])
    raw["arrivals"] = {"pattern": "constant", "rate": {"fraction_of_capacity": 0.5, "reference": "fast",
                                                         "nominal": 4.0}, "num_requests": 12}
    raw["workload"]["classes"]["document"]["prompt_tokens"] = 60
    raw["slo"] = {"ttft_s": 0.5, "gap_s": 0.5, "max_pause_s": 1.0, "e2e_s": 3.0}
    raw["capacity"] = {"probe_requests": 8, "max_probes": 3, "precision": 0.5, "method": "bisect"}
    raw.update(extra)
    return raw


def test_relative_rate_needs_a_reference_among_the_arrangements():
    raw = fake_spec()
    raw["arrivals"]["rate"]["reference"] = "nobody"
    with pytest.raises(SpecError, match=r"arrivals.rate.reference: no arrangement named 'nobody'"):
        parse_spec(raw)


@pytest.mark.timeout(240)
def test_capacity_search_with_a_calibrated_rate_in_rotating_repeats(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(fake_spec()))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out), "--repeat", "2"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["order"] == [["fast", "slow"], ["slow", "fast"]]    # the reference calibrates first
    cal = doc["calibration"]
    assert cal["reference"] == "fast" and cal["rate_multiplier"] == pytest.approx(0.5 * cal["capacity_multiplier"])
    for arr in doc["arrangements"]:
        assert [c["repeat"] for c in arr["capacity"]] == [0, 1]
        fixed = [r for r in arr["runs"] if r["purpose"] == "fixed"]
        assert [r["repeat"] for r in fixed] == [0, 1]
        assert all(r["rate_multiplier"] == pytest.approx(cal["rate_multiplier"]) for r in fixed)  # equal rates
        assert all(len(r["requests"]) == 8 for r in arr["runs"] if r["purpose"] == "probe")
    fast, slow = (next(a for a in doc["arrangements"] if a["name"] == n) for n in ("fast", "slow"))
    assert fast["capacity_rps"]["median"] > slow["capacity_rps"]["median"]
    assert "Capacity within the SLOs" in doc["verdict"] and "fast" in doc["verdict"]


@pytest.mark.timeout(120)
def test_results_are_saved_after_every_run_so_a_cut_trial_keeps_them(tmp_path):
    raw = spec_dict([{"name": "a", "command": fake()}, {"name": "b", "command": fake()}])
    raw["arrivals"]["num_requests"] = 4
    spec = parse_spec(raw)
    snapshots = []

    def save(trial):
        done = {name: [r.purpose for r in res.runs] for name, res in trial.results.items()}
        snapshots.append(done)

    Trial(spec, tmp_path, on_update=save).run()
    assert {"a": ["fixed"]} in snapshots                             # saved before b even started
    assert snapshots[-1] == {"a": ["fixed"], "b": ["fixed"]}


def test_the_budget_shares_time_between_launches_and_sizes_the_fixed_run_from_the_measured_rate():
    from splitserve.trial.budget import Budget

    now = [0.0]
    budget = Budget(300.0, repeat=2, weight=4.0, clock=lambda: now[0])
    assert budget.share(2.0) == pytest.approx(300.0)               # the calibration counts twice
    now[0] = 250.0
    budget.spent(2.0)
    assert budget.share() == pytest.approx(350.0 / 2)
    # 30% of a 100 s share at 0.5 req/s holds 15 requests (+1: the first goes at 0); a machine twice
    # as slow measures half the rate and replays about half as many, never fewer than 8
    assert Budget.fixed_requests(100.0, 0.5, 54) == 16
    assert Budget.fixed_requests(100.0, 0.25, 54) == 8
    assert Budget.fixed_requests(100.0, 0.1, 54) == 8
    assert Budget.fixed_requests(1000.0, 0.5, 54) == 54 and Budget.fixed_requests(None, 0.5, 54) == 54


@pytest.mark.timeout(60)
def test_a_probe_stops_as_soon_as_streams_in_flight_break_the_slo(tmp_path):
    from splitserve.trial.arrangements import launched

    # every stream freezes for 5 s after its 2nd token; a pause over 1 s already breaks the SLO
    raw = spec_dict([{"name": "frozen", "command": fake("--pause-every", "1", "--pause-s", "5")}])
    raw["slo"] = {"ttft_s": 2.0, "gap_s": 0.5, "max_pause_s": 1.0, "e2e_s": 10.0}
    spec = parse_spec(raw)
    trial = Trial(spec, tmp_path)
    with launched(spec.arrangements[0], None, tmp_path / "logs") as endpoint:
        trial._ensure_plan(endpoint)
        run = trial._probe(endpoint, "frozen", 1.0, 0, 8, 1)
    # judged while frozen: no stream lived to finish its pause
    assert run.summary["stopped_early"]
    assert {r.error_kind for r in run.records} == {"probe_stopped"}
    assert run.summary["attainment"] == 0.0


@pytest.mark.timeout(120)
def test_a_reference_that_holds_no_rate_hands_the_calibration_to_the_next_arrangement(tmp_path):
    raw = fake_spec()
    raw["arrangements"] = [{"name": "fast", "command": fake()},
                           {"name": "frozen", "command": fake("--pause-every", "1", "--pause-s", "5")}]
    raw["arrivals"]["rate"]["reference"] = "frozen"
    raw["capacity"] = {"probe_requests": 6, "max_probes": 3, "min_multiplier": 0.5, "precision": 0.5, "method": "bisect"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["trial", str(path), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["order"] == [["frozen", "fast"]]
    cal = doc["calibration"]
    assert cal["reference"] == "fast" and cal["held_nothing"] == ["frozen"]
    assert "frozen held no rate tried" in doc["verdict"]
    frozen = next(a for a in doc["arrangements"] if a["name"] == "frozen")
    assert frozen["capacity"][0]["stopped_by"] == "floor" and frozen["capacity_rps"]["median"] == 0.0


@pytest.mark.timeout(180)
def test_when_no_arrangement_holds_any_rate_the_trial_says_so_once_instead_of_repeating_the_search(tmp_path):
    # a share of a capacity that nobody has: no fixed rate exists, and a second repeat would spend the
    # same probes on the same answer (examples/demand_unseen.yaml on 2 cores: 25 minutes of them)
    frozen = fake("--pause-every", "1", "--pause-s", "5")
    raw = fake_spec()
    raw["arrangements"] = [{"name": "frozen-a", "command": frozen}, {"name": "frozen-b", "command": frozen}]
    raw["arrivals"]["rate"]["reference"] = "frozen-a"
    raw["capacity"] = {"probe_requests": 6, "max_probes": 3, "min_multiplier": 0.5, "precision": 0.5, "method": "bisect"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    main(["trial", str(path), "--repeat", "2", "--out", str(tmp_path / "out")])
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    cal = doc["calibration"]
    assert cal["no_capacity"] and cal["held_nothing"] == ["frozen-a", "frozen-b"]
    assert doc["verdict"].startswith("No verdict: no arrangement kept 90% of requests good at any rate tried")
    assert "the other 1 repeat(s) were not run" in doc["verdict"] and "leave out arrivals.rate" in doc["verdict"]
    for arr in doc["arrangements"]:
        assert {r["repeat"] for r in arr["runs"]} == {0}            # searched once, in the first repeat
        assert not [r for r in arr["runs"] if r["purpose"] == "fixed"]


def _plan(n=10, gap=2.0):
    from splitserve.trial.workload import PlannedRequest
    return [PlannedRequest(i, "doc" if i % 5 == 0 else "chat", i * gap, [1, 2, i], 4) for i in range(n)]


def test_a_probe_spans_the_same_real_time_at_every_rate_and_repeats_the_plan_past_its_end():
    from splitserve.trial.workload import plan_period, probe_length, tiled

    plan = _plan()                                    # 10 requests, one every 2 s: period 20 s
    assert plan_period(plan) == pytest.approx(20.0)
    assert probe_length(plan, 1.0, 4, None) == 4      # no span asked: the old fixed count
    assert probe_length(plan, 0.5, 4, 30.0) == 8      # 30 s at half rate covers 15 plan-s: 8 arrivals
    assert probe_length(plan, 0.1, 4, 30.0) == 4      # a slow rate still replays the minimum
    assert probe_length(plan, 4.0, 4, 30.0) == 60     # 120 plan-s: the plan six times over
    copies = []
    out = tiled(plan, 25, lambda p, k: copies.append(k) or [r for r in p])
    assert len(out) == 25 and copies == [1, 2]
    assert [r.index for r in out] == list(range(25))  # unique ids: the probe judges by index
    gaps = {round(b.send_at_s - a.send_at_s, 9) for a, b in zip(out, out[1:])}
    assert gaps == {2.0}                              # the copies keep the plan's rate
    assert [r.class_name for r in out[10:20]] == [r.class_name for r in plan]
    assert tiled(plan, 3, None) == plan[:3]


@pytest.mark.timeout(60)
def test_a_probe_at_a_high_rate_replays_the_plan_more_than_once(tmp_path):
    from splitserve.trial.arrangements import launched

    raw = spec_dict([{"name": "fast", "command": fake()}])
    raw["capacity"] = {"probe_requests": 4, "probe_seconds": 1.0, "method": "bisect"}
    spec = parse_spec(raw)
    trial = Trial(spec, tmp_path)
    with launched(spec.arrangements[0], None, tmp_path / "logs") as endpoint:
        plan = trial._ensure_plan(endpoint)
        per_s = (len(plan) - 1) / (plan[-1].send_at_s - plan[0].send_at_s)
        m = 2 * len(plan) / per_s                   # 1 s at this rate covers the plan about twice
        run = trial._probe(endpoint, "fast", m, 0, 4, 1)
    assert len(run.records) > len(plan) and not run.summary["stopped_early"]
    assert sorted(r.index for r in run.records) == list(range(len(run.records)))
    assert [r.class_name for r in run.records[len(plan):2 * len(plan)]] == [r.class_name for r in plan]
    assert all(r.finish_reason for r in run.records)


def test_the_tuned_setting_takes_its_grid_probe_as_the_first_probe_of_its_search(tmp_path):
    from splitserve.trial.runner import ArrangementResult, RunResult

    spec = parse_spec(fake_spec())
    trial = Trial(spec, tmp_path)
    trial.main_multiplier = 0.5 * 2.0                      # the reference held x2: searches start there
    summary = {"attainment": 1.0, "offered_rate_rps": 8.0, "wall_s": 3.0}
    trial.tuning_probes["slow"] = RunResult(2.0, summary, [], {}, 0, "probe")
    replayed = []

    def fake_probe(endpoint, name, m, repeat, num, run):
        replayed.append(m)
        return RunResult(m, {**summary, "attainment": 1.0 if m < 3 else 0.0, "offered_rate_rps": 4.0 * m}, [], {},
                         repeat, "probe")

    trial._probe = fake_probe
    arr = next(a for a in spec.arrangements if a.name == "slow")
    result = trial.results.setdefault("slow", ArrangementResult("slow"))
    trial._search(None, arr, result, 0, False, None)
    assert 2.0 not in replayed and replayed[0] == 4.0      # x2 came from the grid, not a new replay
    assert result.runs[0].rate_multiplier == 2.0 and result.capacity[0]["probes"][0]["multiplier"] == 2.0
    assert "slow" not in trial.tuning_probes               # used once: later repeats probe afresh


def test_a_search_starts_at_its_own_earlier_capacity_else_at_the_highest_rate_held_so_far(tmp_path):
    from splitserve.trial.runner import ArrangementResult

    spec = parse_spec(fake_spec())
    trial = Trial(spec, tmp_path)
    fresh = ArrangementResult("slow")
    assert trial._search_start(fresh) == 1.0                       # nothing measured yet
    trial.main_multiplier = 0.5 * 0.25                            # the reference held x0.25
    assert trial._search_start(fresh) == pytest.approx(0.25)
    trial.results["other"] = ArrangementResult("other", capacity=[{"repeat": 0, "capacity_multiplier": 2.0}])
    assert trial._search_start(fresh) == 2.0                       # start high: failing probes stop early
    mine = ArrangementResult("slow", capacity=[{"repeat": 0, "capacity_multiplier": 0.5},
                                               {"repeat": 1, "capacity_multiplier": None}])
    assert trial._search_start(mine) == 0.5                        # a repeat starts at its own answer


def test_the_tuning_grid_probes_where_the_reference_failed_and_the_winner_starts_its_search_there(tmp_path,
                                                                                                monkeypatch):
    import contextlib

    from splitserve.trial import tuning
    from splitserve.trial.runner import ArrangementResult, RunResult

    raw = spec_dict([{"name": "colocated", "serve": ["--instances", "1", "--threads-per-instance", "2"],
                      "cores": 2}])
    raw["arrivals"]["rate"] = {"fraction_of_capacity": 0.5, "reference": "colocated", "nominal": 1.0}
    raw["capacity"] = {"probe_requests": 8, "method": "bisect"}
    raw["tune"] = {"base": "colocated", "instances_x_threads": ["1x2", "2x1"]}
    spec = parse_spec(raw)
    trial = Trial(spec, tmp_path)

    def run(m, good):
        return RunResult(m, {"attainment": good, "offered_rate_rps": m, "wall_s": 1.0,
                             "ttft_s": {"p99": 1.0}}, [], {}, 0, "probe")

    # the reference held x0.125 (both settings would keep 100% there) and failed x0.25
    trial.main_multiplier = 0.5 * 0.125
    trial.calibration = {"probes": [{"multiplier": 0.25, "attainment": 0.2}, {"multiplier": 0.125, "attainment": 1.0}]}
    trial.results["colocated"] = ArrangementResult("colocated", runs=[run(0.25, 0.2), run(0.125, 1.0)])
    probed = []
    monkeypatch.setattr(tuning, "launched", lambda *a, **k: contextlib.nullcontext(None))
    trial._warm_up = lambda endpoint: None
    trial._probe = lambda endpoint, name, m, *rest: probed.append((name, m)) or run(m, 1.0)
    found = tuning.tune_colocated(trial)
    assert probed == [("colocated@2x1", 0.25)]                 # 1x2 is the base: its failing probe is reused
    assert found["rate_multiplier"] == 0.25 and found["best"] == "colocated@2x1"
    assert found["joins_as"] == "colocated-best"
    best = ArrangementResult("colocated-best")
    assert trial._search_start(best) == 0.25                    # it held x0.25: its search starts there


def test_a_search_past_its_budget_is_narrowed_only_while_no_other_arrangement_held_its_failing_rate(tmp_path):
    from splitserve.trial.runner import ArrangementResult, RunResult

    spec = parse_spec(fake_spec(capacity={"probe_requests": 8, "max_probes": 6, "precision": 0.5}))
    trial = Trial(spec, tmp_path)
    summary = {"attainment": 1.0, "offered_rate_rps": 8.0, "wall_s": 30.0}

    def fake_probe(endpoint, name, m, repeat, num, run):
        return RunResult(m, {**summary, "attainment": 1.0 if m < 3 else 0.0, "offered_rate_rps": 4.0 * m}, [], {},
                         repeat, "probe")

    trial._probe = fake_probe
    arr = next(a for a in spec.arrangements if a.name == "slow")
    alone = trial.results.setdefault("slow", ArrangementResult("slow"))
    trial._search(None, arr, alone, 0, False, 1.0)             # 1 s of budget: spent by the first probe
    assert alone.capacity[0]["stopped_by"] == "precision"      # nobody else held anything: a contender
    assert alone.capacity[0]["failed_rps"] <= alone.capacity[0]["capacity_rps"] * (1 + spec.capacity.precision)
    trial.results.clear()
    trial.results["other"] = ArrangementResult("other", capacity=[{"repeat": 0, "capacity_multiplier": 8.0}])
    beaten = trial.results.setdefault("slow", ArrangementResult("slow"))
    trial._search(None, arr, beaten, 0, False, 1.0)
    assert beaten.capacity[0]["stopped_by"] == "budget"        # "other" held x8, above anything it fails
    assert len(beaten.capacity[0]["probes"]) < len(alone.capacity[0]["probes"])
