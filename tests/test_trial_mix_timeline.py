"""The trial reads an adaptive arrangement's role timeline (GET /admin/mix) after each run and shows it."""
import pytest

from test_trial_end_to_end import fake, run_trial, spec_dict


@pytest.mark.timeout(120)
def test_the_role_timeline_of_an_adaptive_arrangement_is_stored_and_shown(tmp_path):
    spec = spec_dict([{"name": "fake-adaptive", "command": fake("--adaptive")},
                      {"name": "fake-fixed", "command": fake()}])
    out, doc = run_trial(tmp_path, spec)
    adaptive, fixed = doc["arrangements"]
    assert adaptive["kind"] == "adaptive" and fixed["kind"] != "adaptive"
    timeline = adaptive["runs"][0]["summary"]["role_timeline"]
    wall = adaptive["runs"][0]["summary"]["wall_s"]
    [change] = timeline["changes"]  # the decision logged before the run (at server start) is left out
    assert (change["instance"], change["from_role"], change["to_role"], change["applied"]) == \
        ("engine-1", "colocated", "prefill", True)
    assert 0 <= change["at_s"] <= wall
    # switch time: from the decision that first read the shift (its TTFT estimate past the target)
    assert 0 < change["switch_s"] <= change["at_s"]
    assert 0.0 <= change["attainment_after"] <= 1.0 and change["num_after"] >= 1
    # every decision of the run in brief, held ones too, in time order; the change among them
    brief = timeline["decisions"]
    assert len(brief) == timeline["num_decisions"] >= 1
    assert [d["at_s"] for d in brief] == sorted(d["at_s"] for d in brief)
    assert any(d.get("instance_id") == "engine-1" and d.get("to_role") == "prefill" for d in brief)
    assert timeline["roles_at_start"] == {"engine-0": "colocated", "engine-1": "colocated"}
    assert timeline["roles_at_end"]["engine-1"] == "prefill"
    assert "role_timeline" not in fixed["runs"][0]["summary"]
    page = (out / "report.html").read_text()
    assert "Role timeline" in page and "prefill is short" in page and "colocated &rarr; prefill" in page
    assert "switch time" in page and f"{change['switch_s']:.1f} s" in page
