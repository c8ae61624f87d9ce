"""`splitserve profile`: a quick profile of the tiny model end to end, and profile files that
are malformed are refused with a message naming the field."""
from __future__ import annotations

import copy
import json
import os

import pytest

from splitserve.cli import main
from splitserve.control.profile import num_neighbours
from splitserve.control.profile_file import FORMAT, ProfileError, load_profile, parse_profile
from splitserve.control.stepmodel import StepModel
from tiny_models import write_tiny_checkpoint

HAND_WRITTEN = {
    "format": FORMAT,
    "model": {"name": "gpu-box", "kv_bytes_per_token": 46080, "block_size": 16},
    "threads": {"1": {"step_model": {"overhead_s": 0.004, "per_prefill_token_s": 2e-5,
                                     "per_decode_seq_s": 1e-4, "per_decode_kv_token_s": 1e-8}}},
    "kv_transfer": {"shm": {"latency_s": 0.001, "gb_per_s": 5.0}},
}


def test_quick_profile_of_the_tiny_model_writes_a_profile_that_reads_back(tmp_path, capsys):
    model = write_tiny_checkpoint(tmp_path / "m")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model), "--quick", "--threads", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    kinds = {s["kind"] for s in doc["threads"]["1"]["samples"]}
    assert kinds == {"prefill", "chunk", "decode", "mixed"}
    assert all(len(s["seconds"]) == 2 for s in doc["threads"]["1"]["samples"])  # repeats, with their spread
    chunk = next(s for s in doc["threads"]["1"]["samples"] if s["kind"] == "chunk")
    assert chunk["prefill_tokens"] == 16 and chunk["prefill_attn_ktok2"] == pytest.approx(16 * (32 + 8) / 1000)
    assert set(doc["kv_transfer"]) == {"shm", "tcp"} and doc["kv_transfer"]["tcp"]["gb_per_s"] > 0
    assert doc["machine"]["num_cores"] >= 1 and "cpu_model" in doc["machine"]
    # the trial's host-speed loop, at start and end: a trial on another box is read at its speed
    assert doc["machine"]["speed_units_per_s"] > 0 and doc["machine"]["speed_units_per_s_end"] > 0
    assert "host_work" not in doc  # --quick leaves the served host-work pass out
    assert doc["startup_s"]["load_model"] > 0
    assert doc["model"]["weight_format"] == "fp32"  # an HF checkpoint: no GGUF blocks to keep
    profile = parse_profile(doc)
    assert profile.steps.for_threads(1).per_prefill_token_s >= 0
    # one lone prompt timed before each of the grid's items and after the last: the host's drift
    drift = doc["threads"]["1"]["drift"]
    assert drift["prompt_tokens"] == 16 and len(drift["readings"]) == len(doc["threads"]["1"]["samples"]) + 1
    times = [t for t, _ in drift["readings"]]
    assert times == sorted(times) and all(s > 0 for _, s in drift["readings"])
    assert profile.speed_band["readings"] == len(drift["readings"])
    assert profile.speed_band["span_s"] == pytest.approx(times[-1] - times[0], abs=1e-3)
    assert 0 < profile.speed_band["p10"] <= profile.speed_band["p50"] <= profile.speed_band["p90"]
    # the box holds a second 1-thread instance: the grid again beside a busy engine
    if (os.cpu_count() or 1) >= 2:
        contended = doc["threads"]["1"]["contended"]
        assert [(s["kind"], s["prefill_tokens"], s["decode_seqs"]) for s in contended["samples"]] == \
            [(s["kind"], s["prefill_tokens"], s["decode_seqs"]) for s in doc["threads"]["1"]["samples"]]
        assert contended["neighbours"]["count"] == (os.cpu_count() or 1) - 1
        assert set(contended["slowdown_median_by_kind"]) == kinds
        assert 1 in profile.contended
    else:
        assert "contended" not in doc["threads"]["1"] and not profile.contended


def test_profile_without_contended_steps_skips_the_neighbours(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "m")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model), "--quick", "--threads", "1", "--contended", "off",
                 "--transports", "shm", "--out", str(out)]) == 0
    assert "contended" not in json.loads(out.read_text())["threads"]["1"]


def processes_with(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a 1-core box holds no neighbour beside the timed engine")
def test_a_served_neighbour_runs_behind_its_own_frontend_and_is_stopped_with_everything_it_started(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "served-neighbour-model")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model), "--quick", "--threads", "1", "--contended", "served",
                 "--transports", "shm", "--out", str(out)]) == 0
    contended = json.loads(out.read_text())["threads"]["1"]["contended"]
    assert contended["neighbours"]["served"] is True and "streaming client" in contended["neighbours"]["work"]
    assert contended["samples"] and all(min(x["seconds"]) > 0 for x in contended["samples"])
    # the neighbour, its server and the server's engine are all gone
    assert not processes_with(str(model))


def test_a_thread_count_fills_the_cores_with_neighbours_of_its_size():
    assert num_neighbours(1, 2, "auto") == 1
    assert num_neighbours(2, 2, "auto") == 0  # one 2-thread instance fills a 2-core box: no one beside it
    assert num_neighbours(2, 8, "auto") == 3
    assert num_neighbours(1, 8, "off") == 0
    assert num_neighbours(1, 2, "served") == 1


CONTENDED = {"overhead_s": 0.008, "per_prefill_token_s": 3e-5, "per_decode_seq_s": 1.5e-4,
             "per_decode_kv_token_s": 1e-8}


def test_profile_with_contended_steps_round_trips_and_serves_several_instances_with_them():
    doc = copy.deepcopy(HAND_WRITTEN)
    doc["threads"]["1"]["contended"] = {"step_model": CONTENDED, "neighbours": {"count": 1}}
    profile = parse_profile(json.loads(json.dumps(doc)))
    assert profile.contended[1] == StepModel(**CONTENDED)
    assert profile.steps.for_threads(1) == StepModel(**HAND_WRITTEN["threads"]["1"]["step_model"])  # lone unchanged
    models, factor = profile.instance_models([1, 1])
    assert models == [StepModel(**CONTENDED)] * 2 and factor == 1.0
    models, _ = profile.instance_models([1])  # one instance: nobody beside it
    assert models == [profile.steps.for_threads(1)]
    assert "measured beside busy engines" in profile.contention_note([1])


def test_profile_without_contended_steps_falls_back_to_its_factor_and_says_so():
    profile = parse_profile({**HAND_WRITTEN, "host_contention": {"factor": 1.2}})
    assert not profile.contended
    models, factor = profile.instance_models([1, 1])
    assert models == [profile.steps.for_threads(1)] * 2 and factor == 1.2
    assert "no step times measured beside busy engines" in profile.contention_note([1])
    assert "x1.20" in profile.contention_note([1])
    # contended steps for 1 thread only: an arrangement with a 2-thread instance falls back as a whole
    doc = copy.deepcopy(HAND_WRITTEN)
    doc["threads"]["1"]["contended"] = {"step_model": CONTENDED}
    partial = parse_profile(doc)
    assert partial.instance_models([1, 2])[0] == [partial.steps.for_threads(1), partial.steps.for_threads(2)]
    assert "for 1 thread(s) only" in partial.contention_note([1, 2])


def test_the_bundled_profiles_from_before_contended_steps_still_load_and_fall_back():
    import pathlib
    paths = sorted(pathlib.Path(__file__).parents[1].glob("bench/results/profile_*.json"))
    old = [p for p in paths if all("contended" not in e for e in json.loads(p.read_text())["threads"].values())]
    assert old
    for path in old:
        profile = load_profile(path)
        assert not profile.contended
        assert profile.instance_models([1, 1]) == ([profile.steps.for_threads(1)] * 2, profile.host_contention)
        assert "no step times measured beside busy engines" in profile.contention_note([1])


def test_a_trial_calibration_drops_the_contended_steps():
    doc = copy.deepcopy(HAND_WRITTEN)
    doc["threads"]["1"]["contended"] = {"step_model": CONTENDED}
    doc["trial_calibration"] = {"threads": {"1": {"step_model": CONTENDED}}}
    assert not parse_profile(doc).contended  # a trial's steps ran beside their neighbours already


@pytest.mark.parametrize("args, field", [
    (["--threads", "1,x"], "--threads"),
    (["--threads", "0"], "--threads"),
    (["--threads", "4096"], "--threads"),
    (["--repeats", "0"], "--repeats"),
    (["--transports", "shm,rdma"], "--transports"),
])
def test_profile_refuses_bad_arguments_naming_them(tmp_path, capsys, args, field):
    assert main(["profile", "--out", str(tmp_path / "p.json"), *args]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def _broken(path: str, value):
    doc = copy.deepcopy(HAND_WRITTEN)
    keys = path.split(".")
    target = doc
    for key in keys[:-1]:
        target = target[key]
    if value is KeyError:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return doc


@pytest.mark.parametrize("path, value, message", [
    ("format", "v0", "format"),
    ("model.kv_bytes_per_token", -1, "model.kv_bytes_per_token"),
    ("model.block_size", "16", "model.block_size"),
    ("threads", {}, "threads"),
    ("threads.1.step_model.overhead_s", KeyError, "threads.1.step_model.overhead_s"),
    ("threads.1.step_model.per_prefill_token_s", -0.1, "threads.1.step_model.per_prefill_token_s"),
    ("threads.1.step_model.per_token_s", 0.1, "threads.1.step_model.per_token_s"),
    ("threads.1.step_model", None, "threads.1.step_model"),
    ("threads.1", {"samples": [{"prefill_tokens": 5, "seconds": []}]}, "threads.1.samples[0].seconds"),
    ("threads.1", {"samples": [{"prefill_tokens": "x", "seconds": [0.1]}]}, "threads.1.samples[0].prefill_tokens"),
    ("threads.1", {}, "threads.1"),
    ("kv_transfer.shm.gb_per_s", 0, "kv_transfer.shm.gb_per_s"),
    ("serial_fraction", 1.5, "serial_fraction"),
    ("host_contention", {"factor": 0.8}, "host_contention.factor"),
    ("host_contention", 1.2, "host_contention"),
    ("threads.1.contended", 1.2, "threads.1.contended"),
    ("threads.1.contended", {"step_model": {"overhead_s": -1, "per_prefill_token_s": 0}},
     "threads.1.contended.step_model.overhead_s"),
    ("threads.1.contended", {}, "threads.1.contended"),
    ("fit_statistic", "mean", "fit_statistic"),
    ("threads.1.drift", [], "threads.1.drift"),
    ("threads.1.drift", {"prompt_tokens": 0, "readings": []}, "threads.1.drift.prompt_tokens"),
    ("threads.1.drift", {"prompt_tokens": 128, "readings": 3}, "threads.1.drift.readings"),
    ("threads.1.drift", {"prompt_tokens": 128, "readings": [[0.0, 0.3], [1.0]]}, "threads.1.drift.readings[1]"),
    ("threads.1.drift", {"prompt_tokens": 128, "readings": [[0.0, 0.3], [1.0, 0]]},
     "threads.1.drift.readings[1][1]"),
    ("threads.1.drift", {"prompt_tokens": 128, "began_unix": "now", "readings": []}, "threads.1.drift.began_unix"),
])
def test_malformed_profiles_are_refused_naming_the_field(path, value, message):
    with pytest.raises(ProfileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_profile(_broken(path, value))


def test_a_thread_count_key_that_is_not_a_number_is_named():
    doc = copy.deepcopy(HAND_WRITTEN)
    doc["threads"]["two"] = doc["threads"]["1"]
    with pytest.raises(ProfileError, match="threads.two"):
        parse_profile(doc)


def test_hand_written_profile_reads_and_extrapolates_threads():
    profile = parse_profile(HAND_WRITTEN)
    assert profile.steps.for_threads(8).overhead_s < profile.steps.for_threads(1).overhead_s
    assert profile.transfer_s("shm", 1000) == pytest.approx(0.001 + 46080 * 1000 / 5e9)
    with pytest.raises(ProfileError, match="kv_transfer.tcp"):
        profile.transfer_s("tcp", 10)
    assert profile.host_contention == 1.0  # not measured: steps beside busy instances are not slowed
    assert parse_profile({**HAND_WRITTEN, "host_contention": {"factor": 1.2}}).host_contention == 1.2


def test_profile_times_threads_as_serve_runs_them_sleeping_between_parallel_regions(monkeypatch):
    # serve sets OMP_WAIT_POLICY=PASSIVE for engines whose threads fill the cores; OpenMP reads it
    # when torch loads, so the profile can only set it before then, and never over the user's own
    import sys

    from splitserve.control.profile import set_omp_wait_policy
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setitem(sys.modules, "torch", object())
    assert set_omp_wait_policy("passive") == "default"  # torch already loaded: too late, say so
    monkeypatch.delitem(sys.modules, "torch")
    assert set_omp_wait_policy("passive") == "passive"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert set_omp_wait_policy("passive") == "active"


def test_the_profile_command_reaches_set_omp_wait_policy_before_torch_loads():
    """`splitserve profile` imports its module, then sets the policy: if anything that module
    imports pulls torch in (the step model once did, through the engine protocol), the policy is
    silently ignored and 2-thread steps are timed spinning, unlike every engine `serve` runs."""
    import subprocess
    import sys

    code = ("import sys, splitserve.cli, splitserve.control.profile, splitserve.control.stepmodel; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_profile_can_be_fitted_on_each_steps_median_repeat_instead_of_its_fastest():
    """Repeats of 1x, 1.1x and 2x a step's cost (a straight line in prompt tokens): fitted on the fastest
    repeat by default, on the median one when the file asks (`fit_statistic: median`), never the mean."""
    def cost(p: int) -> float:
        return 0.01 + 0.002 * p
    samples = [{"kind": "prefill", "prefill_tokens": p, "seconds": [cost(p) * 2.0, cost(p), cost(p) * 1.1]}
               for p in (16, 32, 64, 128, 256, 512)]
    doc = {**copy.deepcopy(HAND_WRITTEN), "threads": {"1": {"samples": samples}}}
    fastest = parse_profile(doc).steps.for_threads(1)
    median = parse_profile({**doc, "fit_statistic": "median"}).steps.for_threads(1)
    assert parse_profile({**doc, "fit_statistic": "fastest"}).steps.for_threads(1) == fastest
    assert fastest.prefill_s(128) == pytest.approx(cost(128), rel=0.02)
    assert median.prefill_s(128) == pytest.approx(1.1 * cost(128), rel=0.02)


def test_host_work_reads_back_is_checked_and_is_dropped_by_a_trial_calibration():
    from splitserve.control.predict import host_load
    from splitserve.control.simulator import SimRequest

    doc = {**HAND_WRITTEN, "host_work": {"idle_cores": 0.01, "per_request_s": 0.01, "per_token_s": 0.001}}
    profile = parse_profile(json.loads(json.dumps(doc)))
    assert profile.host_work.load(2.0, 100.0) == pytest.approx(0.01 + 0.02 + 0.1)
    # 11 requests of 20 tokens over 10 s: 1.1 requests and 22 tokens a second
    requests = [SimRequest(i, float(i), 50, 20) for i in range(11)]
    assert host_load(profile, requests) == pytest.approx(0.01 + 1.1 * 0.01 + 22 * 0.001)
    assert host_load(parse_profile(HAND_WRITTEN), requests) == 0.0  # not profiled: nothing taken
    with pytest.raises(ProfileError, match="host_work.per_token_s"):
        parse_profile({**HAND_WRITTEN, "host_work": {"per_token_s": -1}})
    calibrated = {**doc, "trial_calibration": {"threads": {"1": {"step_model": HAND_WRITTEN["threads"]["1"]["step_model"]}}}}
    assert parse_profile(calibrated).host_work is None  # a trial's steps ran beside that work already


def test_steps_beside_busy_engines_are_fitted_on_their_median_repeat_unless_the_profile_says_fastest():
    # the same shapes alone (fastest and median alike) and beside a neighbour whose phase spreads
    # them: one repeat caught it between chunks (1.0x), two beside a chunk (1.5x)
    shapes = [(32, 0), (128, 0), (512, 0), (0, 1), (0, 4), (0, 16), (128, 8)]
    def sample(p, d, seconds):
        return {"kind": "mixed" if p and d else "prefill" if p else "decode", "prefill_tokens": p,
                "prefill_attn_ktok2": p * p / 2000, "decode_seqs": d, "decode_kv_tokens": 64 * d, "seconds": seconds}
    base = [0.01 + 0.001 * p + 0.002 * d for p, d in shapes]
    doc = copy.deepcopy(HAND_WRITTEN)
    doc["threads"]["1"] = {"samples": [sample(p, d, [t, t]) for (p, d), t in zip(shapes, base)],
                           "contended": {"samples": [sample(p, d, [t, 1.5 * t, 1.5 * t]) for (p, d), t in zip(shapes, base)]}}
    profile = parse_profile(json.loads(json.dumps(doc)))
    lone, beside = profile.steps.for_threads(1), profile.contended[1]
    assert beside.step_s(128) == pytest.approx(1.5 * lone.step_s(128), rel=0.02)
    fastest = parse_profile({**doc, "contended_fit_statistic": "fastest"}).contended[1]
    assert fastest.step_s(128) == pytest.approx(lone.step_s(128), rel=0.02)
    with pytest.raises(ProfileError, match="contended_fit_statistic"):
        parse_profile({**doc, "contended_fit_statistic": "mean"})
