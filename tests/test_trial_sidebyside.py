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
    # the fixed-rate runs are watched like the probes, and counted with them
    watched = [r for a in by_name.values() for r in a["runs"] if r["purpose"].startswith("fixed")]
    assert len(watched) >= 2 and all("attempt" in r["summary"] and "host" in r["summary"] for r in watched)
    assert q["host"]["fixed"] == len(watched)
    # every run first waited for an idle server (the fake exports the engine gauges)
    for a in by_name.values():
        for r in a["runs"]:
            assert r["summary"]["idle_before"]["checked"] and r["summary"]["idle_before"]["idle"], r["purpose"]


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


class _Curves:
    """A stand-in for runner.Trial: each arrangement's probe outcomes drawn from a known curve."""

    def __init__(self, crossings, base, budget_s=None, max_probes=6):
        from types import SimpleNamespace

        from splitserve.trial.method import CapacitySpec, TuneSpec

        self.crossings = crossings
        self.spec = SimpleNamespace(slo=SimpleNamespace(attainment=0.9), seed=0, tune=TuneSpec(base),
                                    capacity=CapacitySpec(probe_requests=30, precision=0.2, max_probes=max_probes,
                                                          budget_s=budget_s))
        self.results, self.rounds, self.tuning, self.renamed = {}, [], None, []
        self.rng = __import__("numpy").random.default_rng(7)

    def result_for(self, name):
        from splitserve.trial.runner import ArrangementResult

        return self.results.setdefault(name, ArrangementResult(name))

    def start_multiplier(self):
        return 1.0

    def _notify(self):
        pass

    def rename_tuned(self, point, name):
        self.renamed.append((point, name))
        self.results[name] = self.results.pop(point)
        self.crossings[name] = self.crossings[point]

    def _probe(self, ep, name, m, repeat, num, run, fitted=False):
        import math

        from splitserve.trial.runner import RunResult

        p = 1 / (1 + math.exp(-(math.log(9) - 6 * math.log(m / self.crossings[name]))))
        good = [bool(self.rng.random() < p) for _ in range(num)]
        summary = {"offered_rate_rps": m, "wall_s": 10.0, "num_requests": num, "num_good": sum(good),
                   "outcomes": {"index": list(range(num)), "good": good, "class": ["chat"] * num}}
        return RunResult(m, summary, [], {}, repeat, "probe")


def test_the_tuning_grid_halves_then_the_best_colocated_setting_continues_with_its_probes(monkeypatch):
    from types import SimpleNamespace

    from splitserve.trial import sidebyside

    monkeypatch.setattr(sidebyside, "HostWatch", None)
    monkeypatch.setattr(sidebyside, "speed_benchmark", None)
    crossings = {"base": 0.5, "1P1D": 0.8, "g-weak": 0.1, "g-strong": 2.0, "g-mid": 0.3}
    trial = _Curves(dict(crossings), "base")
    endpoints = {n: SimpleNamespace(pid=None) for n in crossings}
    searches = sidebyside._rounds(trial, endpoints, [SimpleNamespace(name=n) for n in ("g-weak", "g-strong", "g-mid")],
                                  0, None)
    orders = [r["order"] for r in trial.rounds]
    assert sorted(orders[0]) == sorted(crossings)                 # round 0: everyone, one rate
    assert sorted(orders[1]) == ["1P1D", "base", "g-strong"]      # the weaker half of the colocated ones stopped
    assert orders[1] == [n for n in sidebyside._rotated(list(crossings), 1) if n in orders[1]]  # rotated by one
    assert trial.renamed == [("g-strong", "colocated-best")] and trial.tuning["best"] == "g-strong"
    later = {n for order in orders[2:] for n in order}
    assert later <= {"base", "1P1D", "colocated-best"}
    best = searches["colocated-best"]
    assert len(best.probes) >= 3 and best.probes[0].round == 0    # it kept its tuning probes
    assert best.found.kind == "point" and 2.0 / 1.3 < best.found.estimate < 2.0 * 1.3


def test_a_grid_point_within_noise_of_the_base_does_not_replace_it(monkeypatch):
    # g-close's crossing is 10% above the base's: after two tuning rounds the intervals overlap, so
    # the base stays the colocated setting and keeps being probed (picked by the point estimate
    # alone, g-close won here)
    from types import SimpleNamespace

    from splitserve.trial import sidebyside

    monkeypatch.setattr(sidebyside, "HostWatch", None)
    monkeypatch.setattr(sidebyside, "speed_benchmark", None)
    crossings = {"base": 0.5, "1P1D": 0.8, "g-close": 0.55, "g-weak": 0.1}
    trial = _Curves(dict(crossings), "base")
    searches = sidebyside._rounds(trial, {n: SimpleNamespace(pid=None) for n in crossings},
                                  [SimpleNamespace(name=n) for n in ("g-close", "g-weak")], 0, None)
    assert trial.tuning["best"] == "base" and trial.renamed == []
    assert searches["g-close"].done
    later = {n for r in trial.rounds[sidebyside.TUNE_ROUNDS:] for n in r["order"]}
    assert "base" in later and "g-close" not in later


def test_the_budget_ends_the_rounds_after_the_first(monkeypatch):
    from types import SimpleNamespace

    from splitserve.trial import sidebyside

    monkeypatch.setattr(sidebyside, "HostWatch", None)
    monkeypatch.setattr(sidebyside, "speed_benchmark", None)
    trial = _Curves({"base": 0.5, "1P1D": 0.8}, "base", budget_s=35.0)
    sidebyside._rounds(trial, {n: SimpleNamespace(pid=None) for n in ("base", "1P1D")}, [], 0, 35.0)
    # each probe takes 10 s: round 0 (20 s) fits, round 1 would end at 40 s, past the 35 s budget
    assert len(trial.rounds) == 1


def test_a_tuning_point_halved_out_never_wins_on_the_upper_bound_of_its_one_failed_probe(monkeypatch):
    # round 0 at x1 fails everywhere (crossings far below): every point reads "at most x1"; the
    # survivors then fail lower too, so their bound is lower than the halved points' untested one
    from types import SimpleNamespace

    from splitserve.trial import sidebyside

    monkeypatch.setattr(sidebyside, "HostWatch", None)
    monkeypatch.setattr(sidebyside, "speed_benchmark", None)
    crossings = {"base": 0.04, "1P1D": 0.05, "g-a": 0.03, "g-b": 0.02, "g-c": 0.035}
    trial = _Curves(dict(crossings), "base")
    sidebyside._rounds(trial, {n: SimpleNamespace(pid=None) for n in crossings},
                       [SimpleNamespace(name=n) for n in ("g-a", "g-b", "g-c")], 0, None)
    survivors = set(trial.rounds[1]["order"])
    best = trial.tuning["best"]
    assert best in survivors


@pytest.mark.timeout(120)
def test_a_run_waits_until_the_server_has_dropped_what_an_earlier_run_left():
    import asyncio
    import subprocess
    import sys

    from splitserve.trial.arrangements import free_port, stop_process_group, wait_ready
    from splitserve.trial.client import run_load
    from splitserve.trial.idle import busy_requests, wait_idle
    from splitserve.trial.workload import PlannedRequest

    from test_trial_end_to_end import FAKE

    port = free_port()
    # the fake counts a stream its client left as running 2 s longer: an abort still in flight
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--gap-s", "0.05", "--abort-lag-s", "2.0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 60, proc)
        quiet = wait_idle(url)
        assert quiet["checked"] and quiet["idle"] and quiet["wait_s"] < 1.0
        stop = asyncio.Event()

        async def stop_soon(t0):
            await asyncio.sleep(0.5)
            stop.set()                                  # a probe that stopped early, mid-stream

        [rec] = asyncio.run(run_load(url, [PlannedRequest(0, "chat", 0.0, [5, 6, 7], 200)], 10.0, "fake-model",
                                     side_tasks=[stop_soon], stop=stop))
        assert rec.error_kind == "probe_stopped"
        assert busy_requests(url) == 1
        short = wait_idle(url, deadline_s=0.5)          # past its deadline: said so, and the run goes ahead
        assert short["checked"] and short["idle"] is False and short["busy_requests"] == 1
        assert short["wait_s"] >= 0.5
        full = wait_idle(url)
        assert full["idle"] and full["busy_requests"] == 0
        assert short["wait_s"] + full["wait_s"] >= 1.0  # it did wait for the leftover stream
    finally:
        stop_process_group(proc)


def test_a_server_without_the_gauges_is_not_waited_on(monkeypatch):
    from splitserve.trial import idle

    monkeypatch.setattr(idle, "scrape_counters", lambda url, prefixes: {"splitserve_requests_total": 3.0})
    got = idle.wait_idle("http://unused")
    assert got["checked"] is False and got["idle"] is None and got["busy_requests"] is None
    seen = iter([{'splitserve_instance_running_requests{instance="e0",role="prefill"}': 1.0,
                  'splitserve_instance_queued_requests{instance="e1",role="decode"}': 2.0}] * 2 + [
                 {'splitserve_instance_running_requests{instance="e0",role="prefill"}': 0.0,
                  'splitserve_instance_queued_requests{instance="e1",role="decode"}': 0.0}])
    monkeypatch.setattr(idle, "scrape_counters", lambda url, prefixes: next(seen))
    got = idle.wait_idle("http://unused", poll_s=0.01)
    assert got["idle"] and got["checked"]           # both gauges on every instance had to reach 0
    assert next(seen, None) is None                 # it read until the third reading, no sooner


def test_a_disturbed_fixed_rate_run_is_kept_for_the_record_and_redone_once_on_other_text(monkeypatch):
    from types import SimpleNamespace

    from splitserve.trial import sidebyside
    from splitserve.trial.runner import RunResult

    readings = iter([True, True])   # the busy loop outlasts the redo too: it is not redone twice

    class Watch:
        def __init__(self, pids, threshold):
            pass

        def start(self):
            pass

        def stop(self):
            disturbed = next(readings)
            return SimpleNamespace(disturbed=disturbed, to_json=lambda: {"others_share": 0.4, "disturbed": disturbed})

    monkeypatch.setattr(sidebyside, "HostWatch", Watch)
    monkeypatch.setattr(sidebyside, "speed_benchmark", lambda: 1e6)
    trial = _Curves({"base": 0.5}, "base")
    streams = []

    def fixed_replay(ep, name, repeat, started, run=0):
        streams.append(run)
        return RunResult(1.0, {"wall_s": 5.0, "num_requests": 19, "num_good": 4}, [], {}, repeat, "fixed")

    trial.fixed_replay = fixed_replay
    sidebyside._watched_fixed(trial, {"base": SimpleNamespace(pid=None)}, "base", 0, 0.0)
    runs = trial.results["base"].runs
    assert [r.purpose for r in runs] == ["fixed-disturbed", "fixed"]
    assert streams == [0, sidebyside.REDO_STREAM]          # the redo: the same requests, other prompt text
    assert [r.summary["attempt"] for r in runs] == [0, 1] and all(r.summary["disturbed"] for r in runs)
    assert runs[1].summary["host"]["others_share"] == 0.4 and runs[1].summary["speed_units_per_s"] == 1e6


def test_a_budget_that_affords_few_probes_per_arrangement_is_warned_about():
    from splitserve.trial.method import CapacitySpec
    from splitserve.trial.sidebyside import affordable_probes, budget_for, budget_warning

    short = CapacitySpec(probe_requests=16, probe_seconds=30, precision=0.15, max_probes=6, budget_s=300)
    assert affordable_probes(short, 4) < 2           # chat_only's old budget: one round of four
    text = budget_warning(short, 4)
    assert text.startswith("budget_s 300 affords about 2 probes per arrangement") and "wide" in text
    enough = CapacitySpec(probe_requests=16, probe_seconds=30, precision=0.15, max_probes=6,
                          budget_s=budget_for(short, 4))
    assert affordable_probes(enough, 4) >= 5 and budget_warning(enough, 4) is None


def test_the_budget_counts_the_tuning_grid_as_successive_halving_runs_it():
    """A grid of three beside the base: three probes in round one, then the better half of the
    four colocated settings (the base and one point) in round two, so four grid probes, as the
    demo's runs took (session 11: 4 grid probes each); the warning's count follows."""
    from splitserve.trial.method import CapacitySpec
    from splitserve.trial.sidebyside import affordable_probes, budget_for, grid_probes

    assert [grid_probes(n) for n in (0, 1, 2, 3, 4)] == [0, 1, 3, 4, 6]
    demo = CapacitySpec(probe_requests=10, probe_seconds=30, precision=0.2, max_probes=8, budget_s=540)
    assert 3 <= affordable_probes(demo, 2, 3) < 4
    assert abs(affordable_probes(CapacitySpec(probe_requests=10, probe_seconds=30, precision=0.2, max_probes=8,
                                              budget_s=budget_for(demo, 2, 3)), 2, 3) - 5) < 1e-9


def test_a_disturbed_tuning_probe_is_counted_with_the_rest():
    """The grid's points that stop keep no place in `arrangements`; their watched probes go to
    `tuning_runs`, so a busy loop that lands on them is counted as detected and redone (a disturbed
    demo run said "0 of 8 disturbed" while its grid probes were redone out of sight)."""
    from types import SimpleNamespace

    from splitserve.trial.quote import host_summary
    from splitserve.trial.results import tuning_runs
    from splitserve.trial.runner import ArrangementResult, RunResult

    def probe(purpose, disturbed, attempt):
        return RunResult(2.0, {"wall_s": 30.0, "attempt": attempt, "disturbed": disturbed, "speed_units_per_s": 1e3,
                               "host": {"others_share": 0.5 if disturbed else 0.01}, "per_request": ["left out"]},
                         [], {}, 0, purpose)

    grid = ArrangementResult("base@128tok-2x1")
    grid.runs = [probe("probe-disturbed", True, 0), probe("probe", False, 1)]
    base = ArrangementResult("base")
    base.runs = [probe("probe", False, 0)]
    trial = SimpleNamespace(results={"base": base, "base@128tok-2x1": grid})
    runs = tuning_runs(trial, {"base": None})
    assert [(r["name"], r["purpose"]) for r in runs] == [("base@128tok-2x1", "probe-disturbed"),
                                                          ("base@128tok-2x1", "probe")]
    assert "per_request" not in runs[0]["summary"]            # the host's reading, not the requests
    doc = {"arrangements": [{"runs": [{"purpose": r.purpose, "summary": r.summary} for r in base.runs]}],
           "tuning_runs": runs}
    got = host_summary(doc)
    assert (got["probes"], got["disturbed"], got["redone"]) == (3, 1, 1)
    assert host_summary({**doc, "tuning_runs": []})["disturbed"] == 0


def test_intervals_that_reached_one_probed_rate_from_either_side_are_apart_and_others_that_touch_are_not():
    """A grid point that held 30 of 30 at 1.0 req/s where the base held 3 of 30: each interval reached
    that probe from its own side (the fits' own intervals ended short of it), so the two crossings lie
    on either side of it. Equal ends that are a fit's own interval prove nothing."""
    from splitserve.trial.curve import Capacity
    from splitserve.trial.sidebyside import clearly_above

    strong = Capacity("point", 1.9, 1.0, 2.9, fit_lo=1.6, fit_hi=2.9)
    base = Capacity("point", 0.57, 0.49, 1.0, fit_lo=0.49, fit_hi=0.66)
    assert clearly_above(strong, base) and not clearly_above(base, strong)
    own_end = Capacity("point", 1.9, 1.0, 2.9, fit_lo=1.0, fit_hi=2.9)     # 1.0 is the bootstrap's own lower end
    assert not clearly_above(own_end, base)
    assert not clearly_above(Capacity("point", 1.9, 0.9, 2.9, fit_lo=1.6, fit_hi=2.9), base)   # overlapping


def test_a_grid_point_that_held_the_rate_the_base_failed_is_above_it_though_their_ends_are_equal():
    """Session 38's doc-heavy tuning: colocated-chunked-x2@128tok-1x2 held 40 of 40 at 1.42 req/s
    (every rate probed held: at least 1.42) where the base held 17 of 40, its interval [0.77-1.16]
    reaching up to that probe (1.42). The grid point is above; the tuning kept the base."""
    from splitserve.trial.curve import Capacity, meet_apart
    from splitserve.trial.sidebyside import clearly_above

    r = 1.4181818181818182
    held = Capacity("at_least", r, r, None)
    base = Capacity("point", 1.04, 0.77, r, fit_lo=0.77, fit_hi=1.16)
    assert clearly_above(held, base) and not clearly_above(base, held)
    assert meet_apart(held, base) == r and meet_apart(base, held) is None
    failed = Capacity("at_most", r, None, r)       # failed the rate the other held: below it
    assert clearly_above(held, failed) and not clearly_above(failed, held)
    point_below = Capacity("point", 1.3, 1.1, r, fit_lo=1.1, fit_hi=1.5)   # r is its own fit's, not a probe
    assert not clearly_above(held, point_below)
    assert not clearly_above(Capacity("at_least", 1.2, 1.2, None), base)    # inside the base's interval
