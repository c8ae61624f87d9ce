"""Grammars for constrained decoding, as xgrammar builds them: the frontend builds and checks
them (a bad schema is a 400 before any engine), the engine compiles them against its tokenizer.

    JSON schema --xgrammar--> EBNF --bound_number_digits--> Grammar
    tool calls  --a tool parser's format around the JSON grammar--> Grammar --serialize_json--> wire

Numbers are bounded: JSON allows any number of digits, and a small model that starts writing
"1111..." into an unbounded `"type": "number"` keeps going until max_tokens (1 of 50 bench schemas
was cut that way). Each run of digits (integer part, fraction, exponent) may be at most
MAX_DIGITS long, which still holds every int64 and more precision than a double keeps.
"""
from __future__ import annotations

import re

MAX_DIGITS = 19  # digits of 2**63 - 1

_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.M)


def xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output needs the xgrammar package (pip install xgrammar); "
                         "this server was installed without it") from None
    return xgrammar


def bound_number_digits(ebnf: str, max_digits: int = MAX_DIGITS) -> str:
    """xgrammar's EBNF with every unbounded run of digits cut to max_digits. A digit run is
    `[1-9] [0-9]*` (an integer) or `rule{n, -1}` where `rule ::= (([0-9]))`; other repetitions
    (array items, object properties, string characters) are left as they are."""
    ebnf = ebnf.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {max_digits - 1}}}")
    for name in _DIGIT_RULE.findall(ebnf):
        ebnf = re.sub(rf"\b{re.escape(name)}\{{(\d+), -1\}}", rf"{name}{{\1, {max_digits}}}", ebnf)
    return ebnf


def json_schema_grammar(schema: str):
    """The xgrammar Grammar of compact JSON (no whitespace between tokens: with whitespace allowed a
    small model fills objects with newlines) valid under `schema`, numbers bounded.
    ValueError naming the problem if xgrammar cannot use the schema."""
    xgr = xgrammar()
    try:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        return xgr.Grammar.from_ebnf(bound_number_digits(str(grammar)))
    except Exception as e:  # noqa: BLE001 - whatever the converter rejects, the schema caused it
        raise ValueError(f"the JSON schema cannot be used for structured output: {e}") from None


def grammar_from_wire(text: str):
    """A Grammar the frontend sent (Grammar.serialize_json: it keeps the root rule's name, which
    EBNF text printed by xgrammar does not)."""
    try:
        return xgrammar().Grammar.deserialize_json(text)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed grammar from a client of the engine
        raise ValueError(f"the grammar cannot be read: {e}") from None
