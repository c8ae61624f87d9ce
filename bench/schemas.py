"""Generated JSON schemas for the structured-output checks: nested objects, enums, arrays,
integers and numbers with bounds, booleans, bounded strings, required and optional fields.

Bounded on purpose (maxLength, maxItems, integer ranges) so that even a random-weight model
finishes its answer within a few dozen tokens: validity is what is tested, not the model."""
from __future__ import annotations

import random

NAMES = ["id", "name", "count", "price", "tags", "ok", "kind", "owner", "items", "level", "score", "note"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["integer", "number", "boolean", "string", "enum"])
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(1, 100)}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randrange(1, 8)}
    return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "x", "y z"], rng.randrange(1, 4))}


def _node(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return random_object(rng, depth - 1)
    if depth > 0 and roll < 0.45:
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": rng.randrange(0, 2),
                "maxItems": rng.randrange(2, 4)}
    return _leaf(rng)


def random_object(rng: random.Random, depth: int = 2) -> dict:
    names = rng.sample(NAMES, rng.randrange(1, 4))
    properties = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_object(rng) for _ in range(count)]
