"""Equal resources, enforced: equal cores or a refusal that names them, KV split, pinning read back."""
import json
import os

import pytest
import yaml

from splitserve.cli import main
from splitserve.trial.resources import arrangement_resources, with_kv_split
from splitserve.trial.spec import SpecError, parse_spec

from test_trial_end_to_end import fake, spec_dict


def spec_with(arrangements, **top):
    raw = spec_dict(arrangements)
    raw.update(top)
    return raw


def test_arrangements_that_do_not_add_up_to_the_same_cores_are_refused_by_name():
    raw = spec_with([{"name": "x2", "serve": ["--instances", "2", "--threads-per-instance", "1"]},
                     {"name": "big-1P1D", "serve": ["--prefill", "1", "--decode", "1", "--threads-per-instance", "2"]}])
    with pytest.raises(SpecError, match=r"same cores.*x2 2, big-1P1D 4"):
        parse_spec(raw)
    with pytest.raises(SpecError, match=r"liar.*cores: 2.*= 4 cores"):
        parse_spec(spec_with([{"name": "liar", "serve": ["--instances", "2", "--threads-per-instance", "2"],
                               "cores": 2}]))
    parse_spec(spec_with(raw["arrangements"] + [{"name": "other", "serve": ["--instances", "1"], "cores": 8}],
                         allow_unequal_cores=True))


def test_total_kv_memory_is_split_between_instances_and_unequal_totals_are_refused():
    spec = parse_spec(spec_with([
        {"name": "one", "serve": ["--instances", "1", "--threads-per-instance", "2"]},
        {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1"]}],
        kv_cache_memory="1GiB"))
    split = [arrangement_resources(with_kv_split(a, spec.kv_cache_memory)) for a in spec.arrangements]
    assert [(r.kv_per_instance, r.kv_total, r.cores) for r in split] == [(2**30, 2**30, 2), (2**29, 2**30, 2)]
    with pytest.raises(SpecError, match=r"KV cache memory differs.*one 512 MiB, 1P1D 1024 MiB"):
        parse_spec(spec_with([
            {"name": "one", "serve": ["--instances", "1", "--kv-cache-memory", "512MiB"], "cores": 2},
            {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1", "--kv-cache-memory", "512MiB"],
             "cores": 2}]))


def test_more_cores_than_the_trial_may_use_is_refused_before_anything_starts(tmp_path, capsys):
    many = len(os.sched_getaffinity(0)) + 1
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_with([{"name": "huge", "command": fake(), "cores": many}])))
    assert main(["trial", str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"use {many} cores but the trial may run on only" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_every_launched_process_is_pinned_to_the_same_cores_and_read_back(tmp_path):
    first = sorted(os.sched_getaffinity(0))[:1]
    raw = spec_with([{"name": "a", "command": fake("--spawn-child"), "cores": 1},
                     {"name": "b", "command": fake("--spawn-child"), "cores": 1}])
    raw["arrivals"]["num_requests"] = 4
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["trial", str(path), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["cpus"] == first and "load generator" in doc["placement"]
    for arr in doc["arrangements"]:
        [launch] = arr["launches"]
        assert {p["process"] for p in launch["processes"]} == {"server", "fake-engine"}
        assert all(p["cpus"] == first for p in launch["processes"])
    assert "on cores" in (tmp_path / "out" / "report.html").read_text()


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    raw = spec_with([{"name": "colocated", "serve": ["--instances", "2", "--threads-per-instance", "1"]},
                     {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1"]}],
                    capacity={"probe_requests": 8})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--dry-run", "--repeat", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "20 requests over" in text
    assert "class chat:" in text and "class document:" in text
    assert "1P1D [separated]: 1 prefill + 1 decode, 1 thread(s) each: 2 cores, KV 1024 MiB (512 MiB each)" in text
    assert "repeat 2: 1P1D -> colocated" in text and "probes of the plan's first 8 requests" in text
    assert not out.exists()


def test_dry_run_says_a_phased_plan_is_probed_whole_or_on_its_named_phase(tmp_path, capsys):
    # what runner.Trial._probe replays: a phased plan's first requests are its first phase only
    raw = spec_with([{"name": "colocated", "serve": ["--instances", "2", "--threads-per-instance", "1"]}])
    raw["arrivals"] = {"pattern": "phases", "rate": {"fraction_of_capacity": 0.7, "reference": "colocated",
                                                     "probe_seconds": 20},
                       "phases": [{"duration_s": 5, "rate": 2.0, "mix": {"chat": 1}},
                                  {"duration_s": 5, "rate": 1.0, "mix": {"document": 1}}]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["trial", str(path), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "calibration probes: the whole plan, every phase" in text and "first 24" not in text
    raw["capacity"] = {"probe_requests": 8, "phase": 2}
    path.write_text(yaml.safe_dump(raw))
    assert main(["trial", str(path), "--dry-run"]) == 0
    assert "probes of phase 2 of the plan (at least 8 requests" in capsys.readouterr().out


def test_an_adaptive_server_is_its_own_kind_with_its_instances_counted():
    from splitserve.trial.results import arrangement_kind
    from splitserve.trial.spec import Arrangement

    arr = Arrangement("adaptive", serve_args=["--adaptive", "--instances", "2", "--threads-per-instance", "1"])
    assert arrangement_kind(arr) == "adaptive"
    res = arrangement_resources(with_kv_split(arr, "1GiB"))
    assert (res.instances, res.cores, res.kv_per_instance) == ("2 adaptive", 2, 2**29)
