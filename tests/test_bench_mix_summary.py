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


def test_misses_names_the_deadline_missed_and_the_settings_in_force_when_the_request_was_sent():
    timeline = {"roles_at_start": {"engine-0": "colocated", "engine-1": "colocated"}, "changes": [1],
                "decisions": [
                    {"at_s": 1.0, "held": "calm", "reason": "held (calm)", "stream_caps": {"engine-0": 9, "engine-1": 9}},
                    {"at_s": 2.0, "held": None, "reason": "chunk budget 256 -> 64 tokens", "chunk_tokens": 64},
                    {"at_s": 3.0, "held": None, "reason": "engine-1 to decode", "instance_id": "engine-1",
                     "from_role": "colocated", "to_role": "decode", "stream_caps": {"engine-0": 2}},
                    {"at_s": 9.0, "held": None, "reason": "later", "chunk_tokens": 32},
                ]}
    run = _run(0.5, 0.3, changes=[1])
    run["rate_multiplier"] = 0.5  # the plan's send times stretched twice
    run["summary"]["role_timeline"] = timeline
    run["summary"]["per_request"] = [
        {"index": 0, "good": True, "ttft_s": 0.5, "longest_pause_s": 0.1, "e2e_s": 2.0, "failure": None},
        {"index": 1, "good": False, "ttft_s": 4.5, "longest_pause_s": 0.7, "e2e_s": 9.0, "failure": None},
        {"index": 2, "good": False, "ttft_s": 1.0, "longest_pause_s": 0.2, "e2e_s": 50.0, "failure": None},
    ]
    results = {"trial": "t", "slo": {"ttft_s": 4.0, "gap_s": 0.5, "e2e_s": 20.0},
               "classes": {"doc": {"slo": {"ttft_s": 15.0, "gap_s": 0.5, "e2e_s": 45.0}}},
               "plan": [{"index": 0, "class": "chat", "send_at_s": 0.1, "num_prompt_tokens": 30},
                        {"index": 1, "class": "chat", "send_at_s": 1.75, "num_prompt_tokens": 40},
                        {"index": 2, "class": "doc", "send_at_s": 0.25, "num_prompt_tokens": 900}],
               "arrangements": [{"name": "1P1D", "runs": [_run(0.9, 0.4)]},
                                {"name": "adaptive", "runs": [run]}]}
    rows = mix_summary.misses(results)
    assert [r["index"] for r in rows] == [1, 2]  # the good request and the fixed arrangement: none
    late, slow = rows
    assert late["sent_s"] == 3.5  # 1.75 s of plan at x0.5
    assert late["missed"] == ["first token 4.5 s > 4.0", "longest pause 0.70 s > 0.5"]
    assert late["roles"] == {"engine-0": "colocated", "engine-1": "decode"}
    assert late["chunk_tokens"] == 64 and late["stream_caps"] == {"engine-0": 2, "engine-1": 9}
    assert late["last_decision"]["at_s"] == 3.0
    assert slow["sent_s"] == 0.5 and slow["last_decision"] is None and slow["chunk_tokens"] is None
    assert slow["missed"] == ["end to end 50.0 s > 45.0"]  # its own class's targets, not the trial's
    text = mix_summary.render_misses(rows)
    assert "#1 chat (40 tokens) sent 3.5 s: first token 4.5 s > 4.0; longest pause 0.70 s > 0.5" in text
    assert "stream caps engine-0 2, engine-1 9" in text
