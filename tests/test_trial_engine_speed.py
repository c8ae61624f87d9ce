"""The host through the engines' eyes: each run's steps against the same steps in its arrangement's
other runs (trial/engine_steps.run_speeds), flagged in the quote, the verdict and the table of runs.
The runs' steps are drawn from one known step model, some slowed by a known factor, so what the
reading must find is known; a run at a higher rate holds bigger batches whose decode steps are
longer with nothing wrong, which the older decode-median rule flagged and the speed must not."""
import random

import pytest

from splitserve.control.stepmodel import StepModel, StepShape
from splitserve.protocol import STEP_SAMPLE_FIELDS
from splitserve.trial import quote as quote_mod
from splitserve.trial.engine_steps import MIN_RUN_STEPS, run_speeds
from splitserve.trial.figure import probes_html
from splitserve.trial.verdict import _fitted_context

TRUE = {"prefill": StepModel(0.01, 0.002, 0.0008, 0.0, 0.0, 0.03, 0.0),
        "decode": StepModel(0.012, 0.0, 0.0, 0.004, 2.5e-6, 0.0, 0.0)}


def steps(seed: int, slow: float = 1.0, batch: int = 4, count: int = 60, roles=("prefill", "decode")) -> dict:
    """One run's engine_steps: prompts of 32-512 tokens on the prefill role, decode batches around
    `batch` on the decode role, each step `slow` times the true model (1-3% jitter)."""
    rng = random.Random(seed)
    instances = {}
    for k, role in enumerate(roles):
        rows = []
        for _ in range(count):
            if role == "prefill":
                n = rng.choice([32, 64, 128, 256, 512])
                shape = StepShape(n, n * n / 2 / 1000.0, 0, 0)
            else:
                b = max(1, batch + rng.randint(-1, 1))
                shape = StepShape(0, 0.0, b, b * rng.randint(100, 900))
            seconds = TRUE[role].predict(shape) * slow * rng.uniform(0.98, 1.03)
            rows.append([shape.prefill_tokens, shape.prefill_attn_ktok2, shape.decode_seqs, shape.decode_kv_tokens,
                         seconds, seconds * 1.05, seconds * 0.95])
        instances[f"e{k}"] = {"role": role, "samples": rows, "missing": 0}
    return {"fields": list(STEP_SAMPLE_FIELDS), "instances": instances}


def run(purpose: str, engine_steps: dict | None, rate: float = 1.0, step_s: float | None = None, round_: int = 0):
    summary = {"offered_rate_rps": rate, "round": round_, "num_requests": 20, "num_good": 20, "num_decided": 20,
               "attempt": 0, "disturbed": False, "outcomes": {"index": list(range(20)), "good": [True] * 20,
                                                              "class": ["chat"] * 20},
               "host": {"others_share": 0.0, "steal_share": 0.0}, "speed_units_per_s": 4e6,
               "idle_cpu_share": {}, "decode_step_median_s": step_s}
    if engine_steps is not None:
        summary["engine_steps"] = engine_steps
    if purpose == "fixed":
        del summary["round"]
        summary["by_class"] = {"chat": {"num_requests": 20}}
    return {"purpose": purpose, "repeat": 0, "rate_multiplier": rate, "summary": summary}


def test_a_run_slowed_by_a_factor_reads_as_that_factor_and_bigger_batches_do_not():
    runs = [run("probe", steps(1)), run("probe", steps(2, batch=24)), run("probe", steps(3, slow=1.5)),
            run("probe", steps(4)), run("probe", steps(5, batch=12))]
    speeds = run_speeds(runs)
    assert speeds[0] == pytest.approx(1.0, abs=0.04)
    assert speeds[1] == pytest.approx(1.0, abs=0.04)   # six times the batch, the same speed
    assert speeds[2] == pytest.approx(1.5, abs=0.08)
    assert speeds[3] == pytest.approx(1.0, abs=0.04)


def test_too_few_steps_or_readings_give_no_speed():
    few = steps(9, count=MIN_RUN_STEPS // 2 - 1)
    speeds = run_speeds([run("probe", steps(1)), run("probe", steps(2)), run("probe", few), run("probe", None)])
    assert speeds[2] is None and speeds[3] is None and speeds[0] is not None
    assert run_speeds([run("probe", steps(1)), run("probe", None)]) == [None, None]
    # older results: steps without the shape fields are not read
    old = {"fields": ["seconds"], "instances": {"e0": {"role": "decode", "samples": [[0.1]] * 40}}}
    assert run_speeds([run("probe", old), run("probe", old)]) == [None, None]


def doc_with(runs):
    arr = {"capacity": [{"method": "fitted"}], "error": None, "kind": "separated", "name": "1P1D", "runs": runs}
    return {"seed": 0, "slo": {"attainment": 0.9}, "side_by_side": [{"together": True}], "tuning": None,
            "arrangements": [arr]}


def test_the_quote_flags_the_slowed_run_not_the_busy_one_and_says_so():
    # the busy run's decode median is 3x the probes' (past the old rule's 2x): bigger batches only
    runs = [run("probe", steps(1), 1.0, 0.03, 0), run("probe", steps(2), 1.5, 0.03, 1),
            run("probe", steps(3, batch=30), 6.0, 0.09, 2), run("probe", steps(4, slow=1.6), 2.0, 0.05, 3),
            run("fixed", steps(5), 1.2, 0.03)]
    doc = doc_with(runs)
    q = doc["quote"] = quote_mod.quote(doc)
    check = q["steps"]["1P1D"]
    flags = {r["run"]: (r["slow"], r["fast"]) for r in check["runs"]}
    assert flags == {0: (False, False), 1: (False, False), 2: (False, False), 3: (True, False), 4: (False, False)}
    busy = next(r for r in check["runs"] if r["run"] == 2)
    assert busy["decode_step_median_s"] > quote_mod.SLOW_ENGINE * check["probe_median_s"]
    lo, hi = check["speed_range"]
    assert lo == pytest.approx(1.0, abs=0.05) and hi == pytest.approx(1.6, abs=0.1)
    e = q["engine_speed"]
    assert (e["runs"], e["slow"], e["fast"]) == (5, 1, 0)
    context = _fitted_context(doc, q)
    assert "Engines: the runs' steps took" in context and "1 ran more than 25% off it (1 slow, 0 fast)" in context
    table = probes_html(doc)
    slowed = next(r for r in check["runs"] if r["run"] == 3)
    assert table.count(": slow engine") == 1 and f"x{slowed['speed']:.2f}, 50 ms (40 ms): slow engine" in table


def test_a_fast_run_is_marked_and_without_steps_the_decode_rule_still_flags():
    runs = [run("probe", steps(1, slow=1.4), 1.0, 0.03, 0), run("probe", steps(2, slow=1.4), 1.5, 0.03, 1),
            run("probe", steps(3), 2.0, 0.03, 2), run("probe", steps(4, slow=1.4), 2.5, 0.03, 3)]
    q = quote_mod.quote(doc_with(runs))
    flags = {r["run"]: (r["slow"], r["fast"]) for r in q["steps"]["1P1D"]["runs"]}
    assert flags[2] == (False, True) and not any(f[0] for f in flags.values())
    old = [run("probe", None, 1.0, 0.03, 0), run("probe", None, 1.5, 0.03, 1), run("fixed", None, 1.2, 0.07)]
    q = quote_mod.quote(doc_with(old))
    assert [r["slow"] for r in q["steps"]["1P1D"]["runs"]] == [False, False, True]
    assert q["engine_speed"] is None and "Engines:" not in _fitted_context(doc_with(old), q)
