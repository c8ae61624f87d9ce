"""The serving stack's CPU outside engine steps (control/host_work.py): the two busy windows are
solved for per request and per token, and a live measurement of the tiny model's server reads
sensible, self-consistent figures."""
from __future__ import annotations

import pytest

from splitserve.control.host_work import measure_host_work, solve
from tiny_models import write_tiny_checkpoint


def window(requests, tokens, host_cpu_s, wall_s=10.0):
    return {"requests": requests, "tokens": tokens, "host_cpu_s": host_cpu_s, "wall_s": wall_s}


def test_the_two_busy_windows_give_back_the_costs_that_made_them_less_the_idle_rate():
    # 0.1 core idle, 8 ms a request, 0.5 ms a token
    idle = window(0, 0, 0.3, wall_s=3.0)
    requests = window(48, 48, 0.1 * 8 + 48 * 0.008 + 48 * 0.0005, wall_s=8.0)
    tokens = window(12, 1152, 0.1 * 11 + 12 * 0.008 + 1152 * 0.0005, wall_s=11.0)
    got = solve({"idle": idle, "requests": requests, "tokens": tokens})
    assert got["idle_cores"] == pytest.approx(0.1)
    assert got["per_request_s"] == pytest.approx(0.008, rel=1e-3)
    assert got["per_token_s"] == pytest.approx(0.0005, rel=1e-3)


def test_a_coefficient_the_noise_makes_negative_is_zero_and_the_other_carries_both_windows():
    idle = window(0, 0, 0.0)
    # the token window is cheaper per request than the request window says: per request < 0
    got = solve({"idle": idle, "requests": window(48, 48, 0.05), "tokens": window(12, 1152, 1.2)})
    assert got["per_request_s"] == 0.0 and got["per_token_s"] > 0
    assert got["per_token_s"] == pytest.approx((48 * 0.05 + 1152 * 1.2) / (48 ** 2 + 1152 ** 2), rel=1e-3)


def test_a_served_tiny_model_costs_the_host_something_per_request_and_per_token(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "m")
    got = measure_host_work(str(model), 1, log=lambda line: None, requests_window=(24, 1, 12.0),
                            tokens_window=(6, 48, 4.0), idle_s=1.0)
    windows = got["windows"]
    assert windows["requests"]["tokens"] == windows["requests"]["requests"] == 24  # one token each
    assert windows["tokens"]["tokens"] == 6 * 48
    for w in windows.values():  # the engines' steps are part of the server tree's CPU, never more
        assert w["engine_step_cpu_s"] <= w["server_cpu_s"] + 0.05
    assert windows["requests"]["host_cpu_s"] > 0 and windows["tokens"]["host_cpu_s"] > 0
    assert got["per_request_s"] + got["per_token_s"] > 0
    assert got["per_request_s"] < 0.5 and got["per_token_s"] < 0.05  # a server, not a busy loop
