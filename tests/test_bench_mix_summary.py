"""bench/mix_summary.py: the table of issue 31 from a trial's results.json, and the watched host's
line where the fixed-rate runs carry one (session 24), none where they do not."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import mix_summary  # noqa: E402


def _run(attainment: float, pause: float, host: dict | None = None, changes=None) -> dict:
    summary = {"attainment": attainment, "num_requests": 10, "makespan_s": 60.0,
               "longest_pause_s": {"p99": pause}, "failures": {},
               "by_phase": [{"attainment": attainment, "num_requests": 10}]}
    if changes is not None:
        summary["role_timeline"] = {"changes": changes}
    if host is not None:
        summary.update(host=host, speed_units_per_s=host.pop("speed"), disturbed=host["disturbed"],
                       decode_step_median_s=host.pop("step"))
    return {"purpose": "fixed", "rate_multiplier": 1.0, "summary": summary}


def _host(others: float, steal: float, disturbed: bool, speed: float, step: float) -> dict:
    return {"others_share": others, "steal_share": steal, "disturbed": disturbed, "speed": speed, "step": step}


def test_the_host_line_spans_every_watched_run_and_old_results_have_none():
    results = {"trial": "t", "arrangements": [
        {"name": "1P1D", "runs": [_run(0.9, 0.4, _host(0.02, 0.0, False, 900.0, 0.03)),
                                  _run(0.8, 0.5, _host(0.31, 0.01, True, 700.0, 0.05)),
                                  {"purpose": "fixed-disturbed", "summary": {}}]},
        {"name": "adaptive", "runs": [_run(0.95, 0.3, changes=[]), _run(0.85, 0.6, changes=[1])]},
    ]}
    doc = mix_summary.summarize(results)
    fixed, adaptive = doc["arrangements"]
    assert fixed["num_runs"] == 2  # a disturbed run kept for the record is not one of them
    host = fixed["host"]
    assert host["speed_units_per_s"] == {"median": 800.0, "min": 700.0, "max": 900.0}
    assert host["others_share_max"] == 0.31 and host["steal_share_max"] == 0.01
    assert (host["disturbed"], host["watched"]) == (1, 2)
    assert host["decode_step_median_s"]["max"] == 0.05
    assert adaptive["host"] is None  # results from before the watch: no line, no error
    text = mix_summary.render(doc)
    assert "host: speed 700-900 units/s, others up to 31%, steal up to 1%, 1 of 2 runs disturbed" in text
    assert "decode step median 30-50 ms" in text and text.count("host:") == 1
    assert adaptive["against_best_fixed"]["best_fixed"] == "1P1D"
