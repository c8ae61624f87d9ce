"""An instance's role, defined once for config, engine, coordinator and control.

No imports: `splitserve trial` and `plan` (control/) read roles without paying for torch, which
config.py pulls in through kv_transfer.
"""
from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """A StrEnum: each member is its string, so wire structs and flags carry plain strings."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


ROLES = tuple(r.value for r in Role)  # ("colocated", "prefill", "decode"): plain strings, for messages
PREFILL_CAPABLE = (Role.PREFILL.value, Role.COLOCATED.value)  # a colocated instance plays both stages
DECODE_CAPABLE = (Role.DECODE.value, Role.COLOCATED.value)


def take_over_survivor(live: dict[str, tuple[str, float]]) -> str:
    """Which live instance takes over a stage that lost its last instance; one rule for the role
    changer and the mix controller.

    `live` maps instance id -> (role, load). The survivor comes from the role that still has the
    most instances (the one that can best spare one), then the least loaded, then the lowest id, so
    the choice is the same whichever side makes it.
    """
    if not live:
        raise ValueError("no live instance to take over a stage")
    count: dict[str, int] = {}
    for role, _ in live.values():
        count[role] = count.get(role, 0) + 1
    return min(live, key=lambda i: (-count[live[i][0]], live[i][1], i))
