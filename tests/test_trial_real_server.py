"""The trial against the project's own `splitserve serve` on a tiny random-weight model.

One colocated server is started separately (an external endpoint, reached by URL) and the
trial launches a 1P1D arrangement itself; both get the same 20 requests, and the separated
one's per-request KV-transfer reports must reach the results.
"""
import json

import pytest
import yaml

from serve_support import ServerProcess
from splitserve.cli import main
from tiny_models import write_tiny_checkpoint

SERVE_ARGS = ["--threads-per-instance", "1", "--kv-cache-memory", "8MiB", "--log-level", "warning"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("trial") / "tiny", arch="llama")


@pytest.fixture
def own_server(tiny_model, tmp_path):
    srv = ServerProcess(str(tiny_model), "--prefill-policy", "whole", "--kv-cache-memory", "8MiB",
                        log_path=tmp_path / "own-server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.mark.timeout(300)
def test_trial_of_twenty_requests_on_an_external_colocated_and_a_launched_1p1d_splitserve(tiny_model, own_server, tmp_path):
    spec = {
        "name": "tiny-real", "seed": 5, "model": str(tiny_model), "warmup_requests": 1,
        "max_context_tokens": 512,
        "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 16, "max": 48},
                                          "answer_tokens": 8},
                                 "document": {"prompt_tokens": 300, "answer_tokens": 8, "question": " Why?"}},
                     "mix": {"chat": 3, "document": 1}},
        "arrivals": {"pattern": "poisson", "rate": 8.0, "num_requests": 20},
        "slo": {"ttft_s": 10.0, "gap_s": 2.0, "max_pause_s": 5.0, "e2e_s": 30.0},
        "arrangements": [
            {"name": "own-server-whole", "url": own_server.base_url},
            {"name": "1P1D", "serve": ["--prefill", "1", "--decode", "1", "--kv-transport", "shm", *SERVE_ARGS]}],
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["trial", str(path), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert (out / "report.html").read_text().count("data:image/png;base64,") >= 4
    prompts = [p["num_prompt_tokens"] for p in doc["plan"]]
    assert prompts.count(300) == sum(p["class"] == "document" for p in doc["plan"])
    for arr in doc["arrangements"]:
        assert arr["error"] is None, arr["error"]
        summary = arr["runs"][0]["summary"]
        assert summary["num_requests"] == 20
        # ignore_eos: every answer has exactly its 8 tokens, by the server's own count
        assert [r["num_tokens"] for r in arr["runs"][0]["requests"]] == [8] * 20
        assert summary["num_complete"] == 20 and sum(summary["failures"].values()) == 0
        assert summary["token_timing"] == "token"    # splitserve honours return_token_ids
        assert summary["attainment"] > 0.5
    external, separated = doc["arrangements"]
    assert (external["kind"], separated["kind"]) == ("external", "separated")
    # the server's per-request KV report reaches the trial: one transfer per request, none failed
    kv = separated["runs"][0]["summary"]["kv_transfer"]
    assert kv["num_reports"] == 20 and kv["bytes"] > 0
    assert separated["runs"][0]["summary"]["kv_transfer"]["failed"] == 0
    # the engines' own steps for the run: the prefill instance prefilled every prompt, the decode
    # instance decoded every answer token after the first (each of 7 in one step of its own)
    steps = separated["runs"][0]["summary"]["engine_steps"]["instances"]
    by_role = {inst["role"]: inst["samples"] for inst in steps.values()}
    assert set(by_role) == {"prefill", "decode"}
    assert sum(s[0] for s in by_role["prefill"]) >= sum(prompts) * 0.5 and sum(s[2] for s in by_role["prefill"]) == 0
    assert sum(s[2] for s in by_role["decode"]) == 20 * 7 and sum(s[0] for s in by_role["decode"]) == 0
