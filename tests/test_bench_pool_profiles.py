"""bench/pool_profiles.py: two profiles of one box pooled into one that reads back, whose step times
lie between the two it came from, and which refuses what cannot be pooled."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import pool_profiles  # noqa: E402

from splitserve.control.profile_file import parse_profile  # noqa: E402
from splitserve.control.stepmodel import StepShape, prefill_attn_ktok2  # noqa: E402

BUNDLED = ROOT / "bench/results/profile_bundled_amd-epyc-zen4-2core_2026-12-03.json"


def _slower(doc: dict, factor: float) -> dict:
    out = copy.deepcopy(doc)
    for entry in out["threads"].values():
        for group in (entry["samples"], entry.get("contended", {}).get("samples", [])):
            for s in group:
                s["seconds"] = [t * factor for t in s["seconds"]]
    return out


def test_pooled_steps_lie_between_the_two_profiles_and_keep_every_sample(tmp_path):
    fast = json.loads(BUNDLED.read_text())
    slow = _slower(fast, 1.3)
    out = tmp_path / "pooled.json"
    assert pool_profiles.main([str(BUNDLED), _write(tmp_path / "slow.json", slow), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    for t, entry in pooled["threads"].items():
        assert len(entry["samples"]) == 2 * len(fast["threads"][t]["samples"])
        if "contended" in fast["threads"][t]:
            assert len(entry["contended"]["samples"]) == 2 * len(fast["threads"][t]["contended"]["samples"])
    shape = StepShape(256, prefill_attn_ktok2(0, 256), 8, 8 * 512)
    one, two, both = (parse_profile(d).steps.for_threads(1).predict(shape) for d in (fast, slow, pooled))
    assert two == pytest.approx(1.3 * one, rel=1e-6)
    assert one < both < two


def test_profiles_of_different_models_or_one_alone_are_refused(tmp_path, capsys):
    doc = json.loads(BUNDLED.read_text())
    other = copy.deepcopy(doc)
    other["model"]["num_layers"] += 1
    out = tmp_path / "pooled.json"
    assert pool_profiles.main([str(BUNDLED), _write(tmp_path / "o.json", other), "--out", str(out)]) == 2
    assert "different models" in capsys.readouterr().err
    assert pool_profiles.main([str(BUNDLED), "--out", str(out)]) == 2
    assert "at least two" in capsys.readouterr().err
    assert not out.exists()


def _write(path: Path, doc: dict) -> str:
    path.write_text(json.dumps(doc))
    return str(path)
