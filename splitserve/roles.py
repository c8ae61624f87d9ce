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
