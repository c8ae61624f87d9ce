"""Predicted beside measured (compare.py) and the long-prompt overlap estimate (overlap.py)."""
from __future__ import annotations

import pytest

from splitserve.control.compare import compare_results, probe_workload, profile_of, render
from splitserve.control.overlap import analyze_overlap, analyze_records
from splitserve.control.predict import (arrangement_from_serve_args, capacity, offered_rate, predict,
                                        requests_from_results)
from splitserve.control.profile_file import FORMAT, parse_profile
from splitserve.control.simulator import SimRequest
from splitserve.trial.spec import SLO
from splitserve.trial.traces import TraceRecord

PROFILE = {
    "format": FORMAT, "model": {"name": "hand", "kv_bytes_per_token": 46080},
    "threads": {"1": {"step_model": {"overhead_s": 0.0, "per_prefill_token_s": 0.001, "per_decode_seq_s": 0.01}}},
    "kv_transfer": {"shm": {"latency_s": 0.005, "gb_per_s": 5.0}},
}
SLO_DOC = {"ttft_s": 2.0, "gap_s": 0.5, "e2e_s": 20.0, "max_pause_s": 1.0, "gap_percentile": 99.0}


def results_doc():
    plan = [{"index": i, "class": "chat", "send_at_s": i * 0.5, "num_prompt_tokens": 64, "max_tokens": 8}
            for i in range(20)]
    def arrangement(name, serve, attainment):
        summary = {"attainment": attainment, "ttft_s": {"p50": 0.1, "p99": 0.2}, "gap_s": {"p99": 0.02},
                   "longest_pause_s": {"p99": 0.03}}
        return {"name": name, "launch": {"serve": serve, "cores": 2}, "error": None, "sweep_capacity_rps": None,
                "runs": [{"rate_multiplier": 1.0, "summary": summary}]}
    return {"trial": "t", "slo": SLO_DOC, "sweep": False, "plan": plan, "arrangements": [
        arrangement("colo", ["--instances", "2", "--threads-per-instance", "1"], 0.9),
        arrangement("1P1D", ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1"], 1.0),
        {"name": "ext", "launch": {"serve": None, "url": "http://x"}, "error": None, "runs": []}]}


def test_serve_arguments_rebuild_the_arrangement_the_trial_launched():
    arr = arrangement_from_serve_args("x", ["--prefill", "1", "--decode", "2", "--threads-per-instance", "2",
                                            "--max-num-batched-tokens", "512"], 6)
    assert [i.role for i in arr.instances] == ["prefill", "decode", "decode"]
    assert {i.threads for i in arr.instances} == {2} and arr.instances[0].budget == 512
    assert arrangement_from_serve_args("y", ["--instances", "2"], 2).instances[0].threads == 1


def test_comparison_puts_the_exact_plans_prediction_beside_each_measurement():
    doc = results_doc()
    profile = parse_profile(PROFILE)
    out = compare_results(profile, doc)
    slo = SLO(**{k: SLO_DOC[k] for k in ("ttft_s", "gap_s", "e2e_s", "max_pause_s", "gap_percentile")})
    expected = predict(arrangement_from_serve_args("colo", doc["arrangements"][0]["launch"]["serve"], 2),
                       profile, requests_from_results(doc), slo)
    row = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "TTFT p99")
    assert row["predicted"] == pytest.approx(expected["ttft_s"]["p99"])
    assert row["error"] == pytest.approx((expected["ttft_s"]["p99"] - 0.2) / 0.2)
    att = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "attainment")
    assert att["error"] == pytest.approx(expected["attainment"] - 0.9)  # in points, not relative
    assert out["skipped"] == ["ext: not launched by serve"]
    assert out["ranking"]["measured_top_two"] == ["1P1D", "colo"]
    assert "predicted vs measured" in render(out)


def test_a_measured_percentile_that_is_infinite_gets_no_error_instead_of_nan():
    doc = results_doc()
    doc["arrangements"][0]["runs"][0]["summary"]["ttft_s"]["p99"] = float("inf")  # a request never answered
    out = compare_results(parse_profile(PROFILE), doc)
    row = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "TTFT p99")
    assert row["error"] is None and "nan" not in render(out)


def test_a_plan_json_carries_its_profile():
    assert profile_of({"arrangements": [], "profile": PROFILE}).model_name == "hand"
    assert profile_of(PROFILE).model_name == "hand"


def test_overlap_counts_arrivals_and_streams_that_meet_a_long_prefill():
    # 1 ms per prompt token, 10 ms per decode step: the 1000-token prompt at t=1 prefills in [1, 2).
    profile = parse_profile(PROFILE)
    times = [1.0, 0.0, 3.0, 1.5]
    prompts = [1000, 10, 10, 10]
    answers = [1, 101, 5, 1]   # the stream from t=0 runs to about 1.01 s: it meets the prefill
    result = analyze_overlap(times, prompts, answers, profile, long_input_tokens=1000)
    assert result["long_share"] == pytest.approx(0.25)
    assert result["mean_long_prefill_s"] == pytest.approx(1.0)
    assert result["arrivals_during_long_prefill"] == pytest.approx(1 / 3)
    assert result["streams_hit_by_long_prefill"] == pytest.approx(1 / 2)
    assert result["recommendation"].startswith("Separation likely pays: 50% of answers")


def test_overlap_without_long_prompts_recommends_colocated():
    result = analyze_overlap([0.0, 1.0], [10, 20], [5, 5], parse_profile(PROFILE), long_input_tokens=1000)
    assert result["recommendation"].startswith("Keep colocated: no prompt reaches 1000 tokens")
    with pytest.raises(ValueError, match="long-input-tokens"):
        analyze_overlap([0.0], [10], [5], parse_profile(PROFILE), long_input_tokens=0)


def test_repeats_are_pooled_and_a_searched_capacity_is_compared():
    # the trial's capacity-search layout: repeated runs per rate, capacity_rps as {median, ...},
    # the attainment target inside slo, the fixed rate chosen by calibration
    doc = results_doc()
    doc["slo"] = {**SLO_DOC, "attainment": 0.8}
    doc["calibration"] = {"rate_multiplier": 2.0}
    for arr in doc["arrangements"][:2]:
        run = arr["runs"][0]
        arr["runs"] = [{**run, "rate_multiplier": 2.0, "summary": {**run["summary"], "attainment": a}}
                       for a in (0.5, 0.7, 0.9)]
        arr["capacity_rps"] = {"median": 3.0, "min": 2.0, "max": 4.0}
    out = compare_results(parse_profile(PROFILE), doc)
    att = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "attainment")
    assert (att["rate_multiplier"], att["num_runs"], att["measured"]) == (2.0, 3, 0.7)
    cap = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"].startswith("capacity"))
    assert cap["metric"] == "capacity at 80%" and cap["measured"] == 3.0
    assert cap["measured_range"] == [2.0, 4.0]
    assert cap["in_measured_range"] == (2.0 <= cap["predicted"] <= 4.0)
    assert out["ranking"]["by"] == "capacity"
    assert "x2(3)" in render(out) and "repeats 2.00-4.00/s: " in render(out)


def test_overlap_reads_trace_records_in_any_order():
    records = [TraceRecord(1.5, 10, 1), TraceRecord(1.0, 1000, 1), TraceRecord(0.0, 10, 101), TraceRecord(3.0, 10, 5)]
    result = analyze_records(records, parse_profile(PROFILE), long_input_tokens=1000)
    assert result["streams_hit_by_long_prefill"] == pytest.approx(1 / 2)


def test_each_run_is_simulated_on_the_requests_it_replayed():
    # a probe replays the plan's first requests compressed in time, not the whole plan: here the
    # first two at x2 (sent at 0 and 0.25 s). Alone on its instance each prefills 64 tokens in 64 ms.
    doc = results_doc()
    run = doc["arrangements"][0]["runs"][0]
    run["rate_multiplier"] = 2.0
    run["summary"]["ttft_s"] = {"p50": 0.128, "p99": 0.128}
    run["requests"] = [{"index": i, "class_name": "chat", "scheduled_s": t, "num_prompt_tokens": 64, "max_tokens": 8}
                       for i, t in ((0, 0.0), (1, 0.25))]
    out = compare_results(parse_profile(PROFILE), doc)
    row = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "TTFT p50")
    assert row["predicted"] == pytest.approx(0.064) and row["error"] == pytest.approx(-0.5)


def test_a_probe_that_stopped_early_is_compared_on_whether_it_held_only():
    doc = results_doc()
    run = doc["arrangements"][0]["runs"][0]
    run["summary"] = {**run["summary"], "attainment": 0.3, "stopped_early": True}
    out = compare_results(parse_profile(PROFILE), doc)
    att = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "attainment")
    assert att["error"] is None and att["num_stopped"] == 1
    assert att["held"] == [(True, False)]  # predicted to hold 90%, measured a failure
    assert "x1S1" in render(out)


def test_each_request_is_judged_by_its_own_class_deadlines():
    # a 1000-token document prefills in 1 s: past the 0.5 s TTFT SLO, but its class checks no TTFT
    slo = SLO(0.5, 0.5, 20.0, 1.0, 99.0)
    requests = [SimRequest(0, 0.0, 1000, 2, "document"), SimRequest(1, 5.0, 10, 2, "chat")]
    arr = arrangement_from_serve_args("colo", ["--instances", "1", "--threads-per-instance", "1"], 1)
    profile = parse_profile(PROFILE)
    assert predict(arr, profile, requests, slo)["attainment"] == pytest.approx(0.5)
    lenient = {"document": SLO(None, None, 20.0, None, 99.0)}
    assert predict(arr, profile, requests, slo, class_slos=lenient)["attainment"] == pytest.approx(1.0)


def test_a_capacity_probe_replays_the_plans_first_requests_tiled_past_its_end():
    plan = [SimRequest(i, i * 0.5, 64, 8) for i in range(20)]  # span 9.5 s, so one period is 10 s
    slow = probe_workload(plan, 0.5, 4, 1.0)  # 1 s at x0.5 covers 0.5 s of the plan: one request, so 4
    assert [r.arrival_s for r in slow] == [0.0, 1.0, 2.0, 3.0]
    fast = probe_workload(plan, 2.0, 4, 10.0)  # 10 s at x2 covers 20 s of the plan: two periods
    assert len(fast) == 40 and fast[20].index == 20 and fast[20].arrival_s == pytest.approx(5.0)


def test_capacity_searches_over_the_workload_each_rate_replays():
    slo = SLO(0.5, 0.5, 20.0, 1.0, 99.0)
    arr = arrangement_from_serve_args("colo", ["--instances", "1", "--threads-per-instance", "1"], 1)
    tried = []

    def workload(m):  # up to x3 a short prompt, past it one the 0.5 s TTFT cannot hold
        tried.append(m)
        return [SimRequest(0, 0.0, 10 if m <= 3.0 else 1000, 2)]
    cap = capacity(arr, parse_profile(PROFILE), [], slo, 0.9, workload=workload)
    assert 3.0 * 0.9 < cap <= 3.0 and len(tried) > 3


def test_settings_the_simulator_lacks_are_named_and_kept_out_of_the_ranking():
    doc = results_doc()
    doc["arrangements"][1]["launch"]["serve"] += ["--adaptive"]
    out = compare_results(parse_profile(PROFILE), doc)
    assert "1P1D: simulated without --adaptive (not modelled), not ranked" in out["skipped"]
    assert "1P1D" not in out["ranking"]["measured_top_two"]
    assert any(r["arrangement"] == "1P1D" for r in out["rows"])  # still shown beside its measurement


def test_the_priority_policy_is_simulated_with_each_class_priority():
    # the simulator runs the engine's scheduler, priority policy included: nothing is skipped, and
    # the arrangement is rebuilt with it, its requests carrying their classes' priorities
    from splitserve.control.predict import arrangement_from_serve_args

    doc = results_doc()
    doc["arrangements"][1]["launch"]["serve"] += ["--scheduling-policy", "priority"]
    out = compare_results(parse_profile(PROFILE), doc)
    assert not any("scheduling-policy" in s for s in out["skipped"])
    arr = arrangement_from_serve_args("1P1D", doc["arrangements"][1]["launch"]["serve"], 2)
    assert {i.scheduling for i in arr.instances} == {"priority"}
    doc["classes"] = {"chat": {"priority": -1}}
    assert {r.class_name: r.priority for r in requests_from_results(doc)}.get("chat") == -1


def test_an_engine_other_than_the_profiled_one_is_named_and_kept_out_of_the_ranking():
    """`--kernels off` or a weight format the profile did not time (a before/after trial of the
    engine) is not what the profile measured: compare says so instead of ranking it."""
    from splitserve.control.compare import unmodelled

    assert unmodelled(["--weight-format", "fp32", "--kernels", "off"], "gguf") == [
        "--kernels off", "--weight-format fp32"]
    assert unmodelled(["--weight-format", "gguf"], "gguf") == []
    assert unmodelled(["--weight-format", "auto"], "gguf") == []
    doc = results_doc()
    doc["arrangements"][1]["launch"]["serve"] += ["--kernels", "off"]
    out = compare_results(parse_profile(PROFILE), doc)
    assert "1P1D: simulated without --kernels off (not modelled), not ranked" in out["skipped"]
    assert "1P1D" not in out["ranking"]["measured_top_two"]


def with_engine_steps(doc: dict, factor: float, loop_factor: float, n: int = 40) -> dict:
    """Every run of the two served arrangements gets n decode steps of 4 sequences and n prompt steps
    of 64 tokens, measured `factor` times what PROFILE says (10 ms per sequence: 40 ms; 1 ms per prompt
    token: 64 ms), each loop turn `loop_factor` times."""
    fields = ["prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds", "loop_seconds"]
    for arr in doc["arrangements"][:2]:
        role = "decode" if arr["name"] == "1P1D" else "colocated"
        for run in arr["runs"]:
            run["summary"]["engine_steps"] = {"fields": fields, "instances": {
                "e0": {"role": role, "missing": 0, "samples": [[0, 0.0, 4, 400, 0.04 * factor, 0.04 * loop_factor]] * n
                       + [[64, 2.048, 0, 0, 0.064 * factor, 0.064 * loop_factor]] * n},
                "e9": {"role": "no-such-role", "missing": 0, "samples": [[0, 0.0, 4, 400, 9.0, 9.0]] * n}}}
    return doc


def test_a_trials_engine_steps_are_put_beside_the_profile_and_capacity_is_predicted_again_at_their_speed():
    from splitserve.control.trial_steps import refit, trial_samples, with_models

    doc = with_engine_steps(results_doc(), factor=3.0, loop_factor=4.0)
    doc["arrangements"][0]["capacity_rps"] = 1.0
    profile = parse_profile(PROFILE)
    out = compare_results(profile, doc)
    colo = next(r for r in out["steps"] if r["arrangement"] == "colo")
    assert colo["all"]["model"]["median"] == pytest.approx(3.0)
    assert colo["all"]["loop"]["time_weighted"] == pytest.approx(4.0)
    assert colo["all"]["model"]["num_steps"] == 80  # the instance whose role the arrangement lacks is left out
    assert set(colo) == {"arrangement", "all", "role:colocated", "kind:decode", "kind:prefill",
                         "threads:1:kind:decode", "threads:1:kind:prefill"}
    first = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "capacity at 90%")
    again = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "capacity, its steps refit")
    assert again["refit"]["1"]["num_steps"] == 80
    arr = arrangement_from_serve_args("colo", doc["arrangements"][0]["launch"]["serve"], 2)
    refitted = refit(profile, trial_samples({"colocated": 1}, doc["arrangements"][0]["runs"]))
    # the loop turns (4x the profile) are what the instance's time went to
    assert refitted[1].model.decode_step_s(4, 400) == pytest.approx(0.16, rel=0.05)
    assert refitted[1].model.prefill_s(64) == pytest.approx(0.256, rel=0.05)
    slo = SLO(**{k: SLO_DOC[k] for k in ("ttft_s", "gap_s", "e2e_s", "max_pause_s", "gap_percentile")})
    slowed = capacity(arr, with_models(profile, {1: refitted[1].model}), requests_from_results(doc), slo, 0.9)
    assert again["predicted"] == pytest.approx(slowed * offered_rate(requests_from_results(doc)), rel=1e-6)
    assert again["predicted"] < first["predicted"]  # four times the step time: less capacity
    assert "engine steps in the trial" in render(out) and "tw 4.00" in render(out)


def test_each_run_is_simulated_again_at_the_step_speed_its_own_engines_ran():
    """A run whose engines stepped 8x the profile's model: compare simulates it again with the model
    times 8, and counts, per arrangement, the runs each simulation lands on (session 34: a VM's
    speed moves minute to minute; a run's miss at its own speed reads as scheduling, else as the
    step time of its minute)."""
    from splitserve.control.trial_steps import run_speed

    doc = with_engine_steps(results_doc(), factor=8.0, loop_factor=8.0)
    doc["arrangements"][0]["capacity_rps"] = 1.0
    profile = parse_profile(PROFILE)
    colo = doc["arrangements"][0]
    arr = arrangement_from_serve_args("colo", colo["launch"]["serve"], 2)
    # the pair's steps against the models the simulation gives it (no contended pass: the lone one)
    assert run_speed(profile, [1, 1], {"colocated": 1}, colo["runs"][0]) == pytest.approx(8.0)
    slo = SLO(**{k: SLO_DOC[k] for k in ("ttft_s", "gap_s", "e2e_s", "max_pause_s", "gap_percentile")})
    plan = requests_from_results(doc)
    as_profiled = predict(arr, profile, plan, slo, 1.0)["attainment"]
    at_eight = predict(arr, profile.slowed(8.0), plan, slo, 1.0)["attainment"]
    assert at_eight < as_profiled - 0.1  # the speed matters for this workload
    for measured, own_lands in ((at_eight, True), (as_profiled, False)):
        colo["runs"][0]["summary"]["attainment"] = measured
        out = compare_results(profile, doc)
        row = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "attainment, own steps")
        assert row["predicted"] == pytest.approx(at_eight) and row["step_speed"] == [pytest.approx(8.0)]
        cap = next(r for r in out["rows"] if r["arrangement"] == "colo" and r["metric"] == "capacity at 90%")
        assert cap["runs_agreeing"] == {"runs": 1, "profile": int(not own_lands), "with_steps": 1,
                                        "own_steps": int(own_lands)}
        assert "at their own step speed" in render(out)


def test_a_stopped_probe_agrees_with_a_simulation_on_the_same_side_of_the_target():
    from splitserve.control.compare import _agrees

    stopped = {"attainment": 0.38, "stopped_early": True}
    assert _agrees({"attainment": 0.5}, stopped, 0.9) and not _agrees({"attainment": 0.93}, stopped, 0.9)
    ran = {"attainment": 0.8}
    assert _agrees({"attainment": 0.9}, ran, 0.9) and not _agrees({"attainment": 0.95}, ran, 0.9)


def test_too_few_engine_steps_give_no_ratio_and_no_second_prediction():
    doc = with_engine_steps(results_doc(), factor=1.5, loop_factor=2.0, n=5)
    doc["arrangements"][0]["capacity_rps"] = 1.0
    out = compare_results(parse_profile(PROFILE), doc)
    assert out["steps"] == [] and not any(r["metric"] == "capacity, its steps refit" for r in out["rows"])


def mixed_steps() -> list:
    """PROFILE says 1 ms per prompt token and 10 ms per decode: prompt steps ran 1.5x, decode steps 0.8x."""
    return [[100, 5.0, 0, 0, 0.15, 0.0]] * 30 + [[0, 0.0, 2, 100, 0.016, 0.016]] * 30


def test_prompt_steps_and_decode_steps_are_told_apart():
    from splitserve.control.stepmodel import StepShape
    from splitserve.control.trial_steps import refit, step_ratios, trial_samples, with_models

    fields = ["prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds", "loop_seconds"]
    runs = [{"summary": {"engine_steps": {"fields": fields, "instances": {"e": {"role": "colocated",
                                                                              "samples": mixed_steps()}}}}}]
    profile = parse_profile(PROFILE)
    ratios = step_ratios(profile, {"colocated": 1}, runs)
    assert ratios["kind:prefill"]["model"]["median"] == pytest.approx(1.5)
    assert ratios["kind:decode"]["model"]["median"] == pytest.approx(0.8)
    assert ratios["kind:prefill"]["loop"] is None  # no loop turn measured: the model's time stands in
    model = refit(profile, trial_samples({"colocated": 1}, runs))[1].model
    assert model.predict(StepShape(100, 5.0)) == pytest.approx(0.15, rel=0.05)
    assert model.predict(StepShape(0, 0.0, 2, 100)) == pytest.approx(0.016, rel=0.05)
    assert with_models(parse_profile({**PROFILE, "host_contention": {"factor": 1.3}}), {1: model}).host_contention == 1.0


def test_the_engine_threads_cpu_time_tells_a_step_that_waited_for_a_core_from_a_slow_one():
    """Prompt steps 1.5x the profile's wall time but on the CPU for only 2/3 of it (another process held
    the core: the cpu ratio is 1.0); decode steps 0.8x and on the CPU throughout. Rows are read by the
    run's field names, so a layout with cpu_seconds reads as well as the older one without it."""
    from splitserve.control.trial_steps import step_ratios

    fields = ["prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds", "loop_seconds",
              "cpu_seconds"]
    rows = [[100, 5.0, 0, 0, 0.15, 0.0, 0.10]] * 30 + [[0, 0.0, 2, 100, 0.016, 0.016, 0.016]] * 30
    runs = [{"summary": {"engine_steps": {"fields": fields, "instances": {"e": {"role": "colocated", "samples": rows}}}}}]
    ratios = step_ratios(parse_profile(PROFILE), {"colocated": 1}, runs)
    assert ratios["kind:prefill"]["model"]["median"] == pytest.approx(1.5)
    assert ratios["kind:prefill"]["cpu"]["median"] == pytest.approx(1.0)
    assert ratios["kind:prefill"]["on_cpu_share"] == pytest.approx(2 / 3)
    assert ratios["kind:decode"]["cpu"]["median"] == pytest.approx(0.8)
    assert ratios["kind:decode"]["on_cpu_share"] == pytest.approx(1.0)
    # the older layout (no cpu_seconds): no cpu ratio, the rest as before
    old = [{"summary": {"engine_steps": {"fields": fields[:-1], "instances": {"e": {
        "role": "colocated", "samples": [r[:-1] for r in rows]}}}}}]
    before = step_ratios(parse_profile(PROFILE), {"colocated": 1}, old)
    assert before["kind:prefill"]["model"]["median"] == pytest.approx(1.5)
    assert before["kind:prefill"]["cpu"] is None and before["kind:prefill"]["on_cpu_share"] is None


def test_a_trial_calibrates_the_profile_per_thread_count_and_the_calibrated_profile_reads_back(tmp_path):
    import json

    from splitserve.control.compare import calibrated_profile, main
    from splitserve.control.profile_file import ProfileError
    from splitserve.control.stepmodel import StepShape

    fields = ["prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds", "loop_seconds"]
    doc = results_doc()
    for arr in doc["arrangements"][:2]:  # both 1 thread per instance: their steps pool
        role = "prefill" if arr["name"] == "1P1D" else "colocated"
        arr["runs"][0]["summary"]["engine_steps"] = {"fields": fields,
                                                     "instances": {"e": {"role": role, "samples": mixed_steps()}}}
    stale = {"threads": {"1": {"step_model": {"overhead_s": 9.0, "per_prefill_token_s": 9.0}}}}
    raw = {**PROFILE, "host_contention": {"factor": 1.3}, "trial_calibration": stale}
    out = calibrated_profile(raw, doc, "results.json")  # refitted against the uncalibrated profile
    entry = out["trial_calibration"]["threads"]["1"]
    assert entry["num_steps"] == 120 and entry["num_prompt_steps"] == 60 and entry["median_abs_rel_error"] < 0.05
    profile = parse_profile(out)
    assert profile.host_contention == 1.0  # the trial's steps already ran beside their neighbours
    model = profile.steps.for_threads(1)
    assert model.predict(StepShape(100, 5.0)) == pytest.approx(0.15, rel=0.05)
    assert model.predict(StepShape(0, 0.0, 2, 100)) == pytest.approx(0.016, rel=0.05)
    with pytest.raises(ProfileError, match=r"trial_calibration.threads.4: calibrates a thread count"):
        parse_profile({**PROFILE, "trial_calibration": {"threads": {"4": {"step_model": {}}}}})
    with pytest.raises(ProfileError, match=r"trial_calibration.threads.1.step_model"):
        parse_profile({**PROFILE, "trial_calibration": {"threads": {"1": {"prefill": 1.2}}}})
    # the command line writes it; a trial without steps is refused with the reason
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    (tmp_path / "r.json").write_text(json.dumps(doc))
    assert main([str(tmp_path / "p.json"), str(tmp_path / "r.json"), "--calibrate-out", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["trial_calibration"]["threads"]["1"]["num_steps"] == 120
    assert main([str(tmp_path / "p.json"), str(tmp_path / "r.json"), "--calibrate-out", str(tmp_path / "c2.json"),
                 "--calibrate-with", str(tmp_path / "r.json")]) == 0  # two trials' steps pool
    assert json.loads((tmp_path / "c2.json").read_text())["trial_calibration"]["threads"]["1"]["num_steps"] == 240
    (tmp_path / "r0.json").write_text(json.dumps(results_doc()))
    assert main([str(tmp_path / "p.json"), str(tmp_path / "r0.json"), "--calibrate-out", str(tmp_path / "d.json")]) == 2
    assert not (tmp_path / "d.json").exists()


def test_a_fitted_interval_says_whether_the_prediction_falls_inside():
    # the interval method: results.json's quote gives each arrangement a fitted capacity [lo, hi]
    doc = results_doc()
    doc["slo"] = {**SLO_DOC, "attainment": 0.8}
    names = [a["name"] for a in doc["arrangements"][:2]]
    first = compare_results(parse_profile(PROFILE), {**doc, "quote": {"arrangements": {
        n: {"kind": "point", "estimate_rps": 1.0, "lo_rps": 0.9, "hi_rps": 1.1} for n in names}}})
    caps = {r["arrangement"]: r["predicted"] for r in first["rows"] if r["metric"].startswith("capacity")}
    assert set(caps) == set(names) and all(caps.values())
    p, q = caps[names[0]], caps[names[1]]
    # one interval around its prediction, one far below its prediction: inside, then flagged outside
    doc["quote"] = {"arrangements": {
        names[0]: {"kind": "point", "estimate_rps": p, "lo_rps": p * 0.9, "hi_rps": p * 1.1},
        names[1]: {"kind": "point", "estimate_rps": q / 10, "lo_rps": q / 12, "hi_rps": q / 8}}}
    out = compare_results(parse_profile(PROFILE), doc)
    rows = {r["arrangement"]: r for r in out["rows"] if r["metric"].startswith("capacity")}
    assert rows[names[0]]["in_measured_interval"] is True
    assert rows[names[1]]["in_measured_interval"] is False
    assert rows[names[1]]["measured"] == q / 10  # no searched capacity: the fitted crossing is the measurement
    assert "OUTSIDE" in render(out) and f"fitted {p * 0.9:.2f}-{p * 1.1:.2f}/s: inside" in render(out)


def test_a_trial_on_a_slower_box_is_also_predicted_at_the_speed_its_box_ran_the_benchmark():
    # the profile's box ran the speed loop at 2,000 units/s, the trial's at 1,000: the same steps
    # take twice as long there, so the capacity at the trial's speed is about half
    doc = results_doc()
    doc["slo"] = {**SLO_DOC, "attainment": 0.8}
    for arr in doc["arrangements"][:2]:
        arr["capacity_rps"] = {"median": 3.0, "min": 2.0, "max": 4.0}
        for run in arr["runs"]:
            run["summary"]["speed_units_per_s"] = 1000.0
    steps = {"overhead_s": 0.01, "per_prefill_token_s": 0.01, "per_decode_seq_s": 0.05}  # capacity inside the search
    fast = parse_profile({**PROFILE, "threads": {"1": {"step_model": steps}}, "machine": {"speed_units_per_s": 2000.0}})
    assert fast.speed_units_per_s == 2000.0
    slow = fast.slowed(2.0)
    assert slow.steps.for_threads(1).per_prefill_token_s == pytest.approx(0.02)
    out = compare_results(fast, doc)
    for name in ("colo", "1P1D"):
        rows = {r["metric"]: r for r in out["rows"] if r["arrangement"] == name and r["rate_multiplier"] is None}
        at_speed = rows["capacity at the trial's speed"]
        assert at_speed["speed_factor"] == 2.0
        assert at_speed["predicted"] < 0.7 * rows["capacity at 80%"]["predicted"]
    assert "ran the speed benchmark 0.50x the profile's" in render(out)
    # a profile made before the benchmark was recorded (or a trial without it): no such row
    old = compare_results(parse_profile(PROFILE), doc)
    assert not [r for r in old["rows"] if r["metric"] == "capacity at the trial's speed"]
    with pytest.raises(ValueError, match="speed factor"):
        fast.slowed(0)


def test_a_profile_with_a_watched_step_predicts_each_capacity_at_its_slow_and_fast_ends():
    # the watched 16-token step ran 1.0-2.0x the model through the profile: at its 90th percentile
    # every step takes ~1.9x, so the capacity there is well under the one at the model's speed
    from splitserve.control.stepmodel import StepModel
    from splitserve.stepfeatures import prefill_attn_ktok2

    doc = results_doc()
    doc["slo"] = {**SLO_DOC, "attainment": 0.8}
    for arr in doc["arrangements"][:2]:
        arr["capacity_rps"] = {"median": 3.0, "min": 2.0, "max": 4.0}
    steps = {"overhead_s": 0.01, "per_prefill_token_s": 0.01, "per_decode_seq_s": 0.05}
    step = StepModel(**steps).step_s(16, prefill_attn_ktok2(0, 16))
    drift = {"prompt_tokens": 16, "readings": [[2.0 * i, step * (1.0 + i / 20)] for i in range(21)]}
    profile = parse_profile({**PROFILE, "threads": {"1": {"step_model": steps, "drift": drift}}})
    assert profile.speed_band["p90"] == pytest.approx(1.9) and profile.speed_band["p10"] == pytest.approx(1.1)
    out = compare_results(profile, doc)
    for name in ("colo", "1P1D"):
        rows = {r["metric"]: r for r in out["rows"] if r["arrangement"] == name and r["rate_multiplier"] is None}
        point, slow, mid, fast = (rows[m]["predicted"] for m in (
            "capacity at 80%", "capacity at the profile's slow end", "capacity at the profile's median speed",
            "capacity at the profile's fast end"))
        assert rows["capacity at the profile's slow end"]["speed_factor"] == pytest.approx(1.9)
        assert rows["capacity at the profile's median speed"]["speed_factor"] == pytest.approx(1.5)
        assert slow < 0.75 * point and slow <= mid <= fast <= point * 1.02 and slow < fast
    assert "capacity at the profile's slow end" in render(out)
    # without the watch: no such rows
    plain = compare_results(parse_profile({**PROFILE, "threads": {"1": {"step_model": steps}}}), doc)
    assert not [r for r in plain["rows"] if "profile's" in r["metric"]]


def test_the_predicted_capacity_is_searched_past_every_rate_the_trial_ran():
    # the trial held a probe at x32 (a lower bound above predict.capacity's default 16x ceiling): the
    # prediction must be able to say more than "16x", or it reads as a miss under the measured bound
    doc = results_doc()
    doc["slo"] = {**SLO_DOC, "attainment": 0.8}
    base = offered_rate(requests_from_results(doc))
    for arr in doc["arrangements"][:2]:
        arr["runs"].append({"rate_multiplier": 32.0, "summary": dict(arr["runs"][0]["summary"])})
        arr["capacity_rps"] = 32.0 * base
    fast = parse_profile({**PROFILE, "threads": {"1": {"step_model": {"overhead_s": 1e-5, "per_prefill_token_s": 1e-7,
                                                                      "per_decode_seq_s": 1e-6}}}})
    out = compare_results(fast, doc)
    caps = {r["arrangement"]: r["predicted"] for r in out["rows"] if r["metric"] == "capacity at 80%"}
    assert set(caps) == {"colo", "1P1D"}
    assert all(p >= 32.0 * base * 0.999 for p in caps.values()), (caps, base)
