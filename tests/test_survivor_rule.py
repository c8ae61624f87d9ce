"""The one rule for which live instance takes over a stage that lost its last instance
(splitserve.roles.take_over_survivor), shared by the role changer and the mix controller."""
from __future__ import annotations

import pytest

from splitserve.roles import take_over_survivor


def test_takes_from_the_role_with_the_most_instances_even_if_busier():
    live = {"p0": ("prefill", 0.0), "c0": ("colocated", 5.0), "c1": ("colocated", 9.0)}
    assert take_over_survivor(live) == "c0"


def test_least_loaded_within_the_role_then_lowest_id():
    assert take_over_survivor({"d1": ("decode", 3.0), "d0": ("decode", 7.0)}) == "d1"
    assert take_over_survivor({"d1": ("decode", 3.0), "d0": ("decode", 3.0)}) == "d0"


def test_a_lone_survivor_and_no_survivor():
    assert take_over_survivor({"x": ("prefill", 100.0)}) == "x"
    with pytest.raises(ValueError):
        take_over_survivor({})
