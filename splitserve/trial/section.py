"""Reading one mapping of a YAML spec with errors that name the field's dotted path.

A `Section` remembers which keys were read; `finish()` then rejects any key nobody
asked for, so a typo (`ttft: 2` for `ttft_s: 2`) fails loudly instead of being ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_MISSING = object()
LENGTH_DISTS = ("fixed", "uniform", "lognormal", "choice")


class SpecError(ValueError):
    """A mistake in the trial spec; the message names the field and the fix."""


class Section:
    def __init__(self, raw: object, path: str):
        self.path = f"{path}." if path and not path.endswith(".") else path
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SpecError(f"{self.path.rstrip('.') or 'spec'}: expected a mapping of keys, got {raw!r}")
        self.raw = raw
        self.used: set[str] = set()

    @property
    def empty(self) -> bool:
        return not self.raw

    def keys(self) -> list[str]:
        self.used.update(self.raw)
        return [str(k) for k in self.raw]

    def _get(self, key: str, default):
        self.used.add(key)
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _MISSING:
            raise SpecError(f"{self.path}{key}: required field is missing")
        return default

    def str(self, key: str, default=_MISSING):
        value = self._get(key, default)
        if value is not default and not isinstance(value, str):
            raise SpecError(f"{self.path}{key}: expected text, got {value!r}")
        return value

    def int(self, key: str, default=_MISSING, minimum: int | None = None):
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.path}{key}: expected a whole number, got {value!r}")
        if minimum is not None and value < minimum:
            raise SpecError(f"{self.path}{key}: must be >= {minimum}, got {value}")
        return value

    def float(self, key: str, default=_MISSING, positive: bool = False, minimum: float | None = None):
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(f"{self.path}{key}: expected a number, got {value!r}")
        if positive and value <= 0:
            raise SpecError(f"{self.path}{key}: must be > 0, got {value}")
        if minimum is not None and value < minimum:
            raise SpecError(f"{self.path}{key}: must be >= {minimum}, got {value}")
        return float(value)

    def bool(self, key: str, default=_MISSING):
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self.path}{key}: expected true or false, got {value!r}")
        return value

    def choice(self, key: str, options: tuple, default=_MISSING):
        value = self._get(key, default)
        if value not in options:
            raise SpecError(f"{self.path}{key}: must be one of {', '.join(map(repr, options))}, got {value!r}")
        return value

    def list(self, key: str) -> list:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise SpecError(f"{self.path}{key}: expected a list, got {value!r}")
        return value

    def str_list(self, key: str, default=_MISSING):
        value = self._get(key, default)
        if value is default:
            return value
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise SpecError(f"{self.path}{key}: expected a list of arguments, got {value!r}")
        return [str(v) for v in value]

    def section(self, key: str, required: bool = True) -> "Section":
        value = self._get(key, _MISSING if required else None)
        return Section(value, f"{self.path}{key}")

    def finish(self) -> None:
        unknown = [str(k) for k in self.raw if k not in self.used]
        if unknown:
            known = ", ".join(sorted(self.used)) or "none"
            raise SpecError(f"{self.path}{unknown[0]}: unknown field (fields read here: {known})")


@dataclass(slots=True)
class LengthDist:
    """A token-length distribution; samples are whole numbers within [min, max]."""

    kind: str
    value: int = 0
    low: int = 1
    high: int = 1
    median: float = 1.0
    sigma: float = 0.5
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def max_value(self) -> int:
        return {"fixed": self.value, "choice": max(self.values or (0,))}.get(self.kind, self.high)

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return int(rng.integers(self.low, self.high + 1))
        if self.kind == "lognormal":
            drawn = rng.lognormal(math.log(self.median), self.sigma)
            return int(min(max(round(drawn), self.low), self.high))
        p = np.asarray(self.weights) / sum(self.weights)
        return int(self.values[rng.choice(len(self.values), p=p)])


def read_length_dist(parent: Section, key: str) -> LengthDist:
    raw = parent._get(key, _MISSING)
    path = f"{parent.path}{key}"
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1:
            raise SpecError(f"{path}: a token count must be >= 1, got {raw}")
        return LengthDist("fixed", value=raw)
    sec = Section(raw, path)
    kind = sec.choice("dist", LENGTH_DISTS)
    if kind == "fixed":
        dist = LengthDist(kind, value=sec.int("value", minimum=1))
    elif kind == "uniform":
        dist = LengthDist(kind, low=sec.int("min", minimum=1), high=sec.int("max", minimum=1))
    elif kind == "lognormal":
        dist = LengthDist(kind, median=sec.float("median", positive=True),
                          sigma=sec.float("sigma", default=0.5, positive=True),
                          low=sec.int("min", default=1, minimum=1), high=sec.int("max", minimum=1))
    else:
        values = tuple(int(v) for v in sec.list("values"))
        weights = tuple(float(w) for w in sec.list("weights")) or (1.0,) * len(values)
        if not values or min(values) < 1:
            raise SpecError(f"{path}.values: list one or more token counts, each >= 1")
        if len(weights) != len(values) or min(weights) < 0 or sum(weights) <= 0:
            raise SpecError(f"{path}.weights: one non-negative weight per value, not all zero")
        dist = LengthDist(kind, values=values, weights=weights)
    sec.finish()
    if dist.kind in ("uniform", "lognormal") and dist.low > dist.high:
        raise SpecError(f"{path}: min ({dist.low}) is above max ({dist.high})")
    return dist
