"""Bad trial specs fail before anything starts, with a message that names the field."""
import copy
import pathlib

import pytest
import yaml

from splitserve.trial.spec import SpecError, load_spec, parse_spec

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

GOOD = {
    "name": "t", "seed": 1,
    "workload": {"classes": {"chat": {"prompt_tokens": 16, "answer_tokens": 4},
                             "document": {"prompt_tokens": {"dist": "uniform", "min": 100, "max": 200},
                                          "answer_tokens": 4, "question": "Why?"}},
                 "mix": {"chat": 3, "document": 1}},
    "arrivals": {"pattern": "poisson", "rate": 2.0, "num_requests": 10},
    "slo": {"ttft_s": 1.0, "gap_s": 0.2, "max_pause_s": 1.0, "e2e_s": 10.0},
    "arrangements": [{"name": "a", "url": "http://127.0.0.1:1"}],
}


def with_change(path: str, value):
    raw = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return raw


DELETE = object()


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_bundled_examples_are_valid(example):
    spec = load_spec(example)
    assert spec.arrangements and spec.classes


def test_a_good_spec_reads_into_settings():
    spec = parse_spec(GOOD)
    assert spec.mix == {"chat": 3.0, "document": 1.0}
    assert spec.classes["document"].prompt_tokens.high == 200
    assert spec.slo.gap_percentile == 99.0


def test_omitting_arrangements_gives_the_four_equal_core_defaults():
    spec = parse_spec(with_change("arrangements", DELETE))
    assert [a.name for a in spec.arrangements] == ["colocated-whole", "colocated-chunked",
                                                   "colocated-chunked-x2", "1P1D"]
    assert {a.cores for a in spec.arrangements} == {2}


@pytest.mark.parametrize("path, value, field", [
    ("slo.ttft", 1.0, "slo.ttft"),                                           # unknown key (typo)
    ("colour", "red", "colour"),                                             # unknown top-level key
    ("workload.classes.chat.answer_tokns", 3, "workload.classes.chat.answer_tokns"),
    ("slo.e2e_s", 0.5, "slo.e2e_s"),                                         # finishes before first token
    ("slo.ttft_s", -1, "slo.ttft_s"),
    ("slo.max_pause_s", 0.1, "slo.max_pause_s"),                             # below the gap SLO
    ("slo.gap_percentile", 120, "slo.gap_percentile"),
    ("arrivals.pattern", "bursty", "arrivals.pattern"),
    ("arrivals.rate", "fast", "arrivals.rate"),
    ("workload.mix.video", 1, "workload.mix.video"),
    ("workload.classes.document.prompt_tokens", {"dist": "uniform", "min": 300, "max": 200},
     "workload.classes.document.prompt_tokens"),
    ("workload.classes.chat.prompt_tokens", 0, "workload.classes.chat.prompt_tokens"),
    ("arrangements", [{"name": "a", "url": "http://x", "serve": ["--instances", "1"]}], "arrangements[0]"),
    ("arrangements", [{"name": "a", "serve": ["--port", "9"]}], "arrangements[0].serve"),
    ("arrangements", [{"name": "a", "command": ["server"]}], "arrangements[0].command"),
    ("arrangements", [{"name": "a", "url": "http://x", "cores": 2}, {"name": "b", "url": "http://y", "cores": 4}],
     "cores"),
    ("arrangements", [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}], "arrangements"),
])
def test_bad_field_fails_with_its_name(path, value, field):
    with pytest.raises(SpecError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(with_change(path, value))


def test_missing_required_field_is_named():
    with pytest.raises(SpecError, match=r"slo\.gap_s: required"):
        parse_spec(with_change("slo.gap_s", DELETE))


def test_missing_trace_file_is_named_before_anything_starts(tmp_path):
    raw = with_change("arrivals", {"pattern": "trace", "path": "nowhere.csv"})
    with pytest.raises(SpecError, match=r"arrivals\.path: trace file .*nowhere\.csv.* not found"):
        parse_spec(raw, base_dir=tmp_path)


def test_missing_spec_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


def test_prompt_plus_answer_beyond_the_context_is_refused():
    raw = with_change("max_context_tokens", 150)
    with pytest.raises(SpecError, match=r"workload\.classes\.document.*max_context_tokens"):
        parse_spec(raw)


def test_on_off_needs_known_classes():
    raw = with_change("arrivals", {"pattern": "on_off", "rate": 1, "duration_s": 10,
                                   "quiet_class": "chat", "burst_class": "novel"})
    with pytest.raises(SpecError, match=r"arrivals\.burst_class"):
        parse_spec(raw)


def test_trial_cli_reports_a_bad_spec_and_starts_nothing(tmp_path, capsys):
    from splitserve.cli import main

    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump(with_change("slo.ttft_seconds", 1)))
    assert main(["trial", str(spec), "--out", str(tmp_path / "out")]) == 2
    assert "slo.ttft_seconds: unknown field" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


PHASES = {"pattern": "phases", "rate": {"fraction_of_capacity": 0.7, "reference": "a"},
          "phases": [{"duration_s": 30, "rate": 1.0, "mix": {"chat": 9, "document": 1}},
                     {"duration_s": 30, "rate": 0.5, "mix": {"document": 1}}, {"duration_s": 10, "rate": 1.0}]}


def test_phases_take_a_rate_relative_to_the_reference_and_their_own_mix():
    spec = parse_spec(with_change("arrivals", PHASES))
    rel = spec.arrivals.relative_rate
    assert (rel.fraction_of_capacity, rel.reference) == (0.7, "a")
    assert [p.mix for p in spec.arrivals.phases] == [{"chat": 9.0, "document": 1.0}, {"document": 1.0}, None]
    for change, field in (({"mix": {"poem": 1}}, "phases[0].mix.poem"), ({"mix": {"chat": 0}}, "phases[0].mix"),
                          ({"rate": {"fraction_of_capacity": 0.7, "reference": "a", "nominal": 2}}, "rate.nominal"),
                          ({"rate": {"fraction_of_capacity": 0.7, "reference": "nope"}}, "rate.reference")):
        raw = copy.deepcopy(PHASES)
        if "mix" in change:
            raw["phases"][0]["mix"] = change["mix"]
        else:
            raw["rate"] = change["rate"]
        with pytest.raises(SpecError, match=field.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
            parse_spec(with_change("arrivals", raw))


def test_a_relative_rate_sets_how_its_calibration_probes_unless_a_capacity_section_does():
    from splitserve.trial.method import CapacitySpec, search_settings

    raw = copy.deepcopy(PHASES)
    raw["rate"] = {"fraction_of_capacity": 0.7, "reference": "a", "probe_requests": 40, "probe_seconds": 30}
    spec = parse_spec(with_change("arrivals", raw))
    cal = search_settings(spec)
    assert (cal.probe_requests, cal.probe_seconds) == (40, 30.0)
    # without the fields the calibration keeps the defaults
    assert search_settings(parse_spec(with_change("arrivals", PHASES))) == CapacitySpec()
    # a capacity: section governs every search, the calibration's too
    both = with_change("arrivals", raw)
    both["capacity"] = {"probe_requests": 12}
    assert search_settings(parse_spec(both)).probe_requests == 12
    raw["rate"]["probe_requests"] = 2
    with pytest.raises(SpecError, match=r"rate\.probe_requests"):
        parse_spec(with_change("arrivals", raw))
