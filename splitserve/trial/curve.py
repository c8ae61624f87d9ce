"""Capacity from a fitted curve: every request's outcome at every probed rate, one monotone model.

A probe at offered rate x sends n requests; k of them meet every SLO. All probes of one
arrangement feed one logistic model of P(good | x) in log rate,

    P(good | x) = 1 / (1 + exp(-(a + b * (log x - c))))     b < 0: more load, fewer good

fitted by penalized maximum likelihood (Newton on two parameters; a weak ridge on b keeps the
fit finite when the probes separate perfectly: all good below some rate, all bad above). The
capacity is where the curve crosses the target attainment. Its interval is a percentile
bootstrap over requests within probes: each replicate redraws every probe's n requests (a
binomial draw of its good count, at the fitted P(good) of its rate) and refits.

A ratio of two arrangements' capacities gets a *paired* bootstrap: arrangements probed on the
same requests (the same round, the same request indices) redraw the same indices in a replicate,
so a hard request (a long document) that sinks both counts against both.

Where the data do not bracket the crossing (no probe held, or none failed, or the fit crosses
outside the probed rates) the answer is a bound: "at least" the highest rate probed (all held)
or "at most" the lowest (none held).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LEVEL = 0.9          # the intervals' confidence
BOOTSTRAP = 400      # replicates per interval
RIDGE = 0.02         # penalty on the slope: finite under perfect separation, negligible otherwise


@dataclass(slots=True)
class ProbeOutcomes:
    """One probe: its offered rate and the outcome of each request that ran (index -> good)."""

    rate: float
    good: dict[int, bool]
    round: int = 0
    classes: dict[int, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.good)

    @property
    def k(self) -> int:
        return sum(self.good.values())

    def of_class(self, name: str) -> "ProbeOutcomes":
        keep = {i: g for i, g in self.good.items() if self.classes.get(i) == name}
        return ProbeOutcomes(self.rate, keep, self.round, {i: name for i in keep})


@dataclass(slots=True)
class Capacity:
    kind: str                      # point | at_least | at_most | none (no probe ran)
    estimate: float | None         # the crossing (point), else the bound
    lo: float | None = None        # the 90% interval (point); for a bound, the bound itself
    hi: float | None = None
    fit: tuple[float, float, float] | None = None   # (a, b, c)

    def width(self) -> float:
        """Relative width hi/lo - 1 (infinite for a bound)."""
        if self.kind != "point" or not self.lo:
            return math.inf
        return self.hi / self.lo - 1.0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "estimate_rps": self.estimate, "lo_rps": self.lo, "hi_rps": self.hi,
                "fit": list(self.fit) if self.fit else None}


def fit_logistic(logx: np.ndarray, k: np.ndarray, n: np.ndarray, c: float) -> np.ndarray:
    """Penalized MLE of (a, b) for every row at once: logx (P,), k and n (R, P) -> (R, 2).
    Newton steps on the 2x2 system, vectorized over the R replicates."""
    k, n = np.atleast_2d(k).astype(float), np.atleast_2d(n).astype(float)
    z = logx - c
    theta = np.zeros((k.shape[0], 2))
    total = np.maximum(n.sum(axis=1), 1.0)
    theta[:, 0] = np.log((k.sum(axis=1) + 0.5) / (total - k.sum(axis=1) + 0.5))
    for _ in range(50):
        eta = theta[:, :1] + theta[:, 1:] * z
        p = 1.0 / (1.0 + np.exp(-np.clip(eta, -30, 30)))
        w = n * p * (1 - p)
        r = k - n * p
        g = np.stack([r.sum(axis=1), (r * z).sum(axis=1) - RIDGE * theta[:, 1]], axis=1)
        h00 = w.sum(axis=1) + 1e-9
        h01 = (w * z).sum(axis=1)
        h11 = (w * z * z).sum(axis=1) + RIDGE
        det = h00 * h11 - h01 * h01
        step = np.stack([(h11 * g[:, 0] - h01 * g[:, 1]) / det, (h00 * g[:, 1] - h01 * g[:, 0]) / det], axis=1)
        step = np.clip(step, -5.0, 5.0)
        theta += step
        if np.max(np.abs(step)) < 1e-7:
            break
    return theta


def _crossings(theta: np.ndarray, c: float, target: float) -> np.ndarray:
    """log rate where each fit crosses the target; nan where the fit does not fall with the rate."""
    a, b = theta[:, 0], theta[:, 1]
    logit = math.log(target / (1 - target))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = c + (logit - a) / b
    out[b >= -1e-6] = np.nan
    return out


def _grouped(probes: list[ProbeOutcomes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ran = [p for p in probes if p.n > 0]
    return (np.log([p.rate for p in ran]), np.array([p.k for p in ran], float), np.array([p.n for p in ran], float))


def capacity(probes: list[ProbeOutcomes], target: float, rng: np.random.Generator,
             replicates: int = BOOTSTRAP, level: float = LEVEL) -> Capacity:
    """The fitted crossing and its bootstrap interval, or a bound where the data do not bracket it."""
    ran = [p for p in probes if p.n > 0]
    if not ran:
        return Capacity("none", None)
    logx, k, n = _grouped(ran)
    c = float(np.average(logx, weights=n))
    theta = fit_logistic(logx, k, n, c)
    cross = _crossings(theta, c, target)[0]
    share = k / n
    held, failed = share >= target, share < target
    top, bottom = float(np.exp(logx.max())), float(np.exp(logx.min()))
    if not failed.any() or (held.any() and np.isfinite(cross) and cross > logx.max()):
        best = float(np.exp(logx[held].max())) if held.any() else top
        return Capacity("at_least", best, best, None, (float(theta[0, 0]), float(theta[0, 1]), c))
    if not held.any() or not np.isfinite(cross) or cross < logx.min():
        worst = float(np.exp(logx[failed].min())) if failed.any() else bottom
        return Capacity("at_most", worst, None, worst, (float(theta[0, 0]), float(theta[0, 1]), c))
    # each probe's requests redrawn from the fitted curve at its rate: redrawn from its own outcomes,
    # a probe with every request good would have no variance at all (that covered 85% of 200 seeds
    # in tests/test_trial_curve.py against 90% for this)
    fitted = 1.0 / (1.0 + np.exp(-(theta[0, 0] + theta[0, 1] * (logx - c))))
    kb = rng.binomial(n.astype(int), fitted, size=(replicates, len(n)))
    boot = _crossings(fit_logistic(logx, kb, np.broadcast_to(n, kb.shape), c), c, target)
    # a replicate whose fit does not fall (nan) or crosses far outside: clip to the probed range
    boot = np.clip(np.nan_to_num(boot, nan=logx.max()), logx.min() - 1.0, logx.max() + 1.0)
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return Capacity("point", float(np.exp(cross)), float(np.exp(lo)), float(np.exp(hi)),
                    (float(theta[0, 0]), float(theta[0, 1]), c))


def paired_ratio(first: list[ProbeOutcomes], second: list[ProbeOutcomes], target: float,
                 rng: np.random.Generator, replicates: int = BOOTSTRAP, level: float = LEVEL) -> dict | None:
    """capacity(first) / capacity(second) with a paired bootstrap: in each replicate every round's
    request indices are redrawn once, and both arrangements' probes of that round keep the draws
    they ran. Probes of a round one arrangement skipped are redrawn on their own."""
    a_cap = capacity(first, target, rng, replicates, level)
    b_cap = capacity(second, target, rng, replicates, level)
    if a_cap.kind != "point" or b_cap.kind != "point":
        return None
    draws_a, draws_b = _paired_counts(first, second, rng, replicates)
    out = []
    for probes, (kb, nb) in ((first, draws_a), (second, draws_b)):
        logx, _, n = _grouped(probes)
        c = float(np.average(logx, weights=n))
        boot = _crossings(fit_logistic(logx, kb, nb, c), c, target)
        out.append(np.clip(np.nan_to_num(boot, nan=logx.max()), logx.min() - 1.0, logx.max() + 1.0))
    tail = (1 - level) / 2
    lo, hi = np.quantile(np.exp(out[0] - out[1]), [tail, 1 - tail])
    return {"estimate": a_cap.estimate / b_cap.estimate, "lo": float(lo), "hi": float(hi), "paired": True}


def _paired_counts(first, second, rng, replicates):
    """Bootstrap (good, ran) counts per probe for both lists, sharing index draws within a round."""
    counts = {id(p): (np.zeros(replicates), np.zeros(replicates)) for p in (*first, *second) if p.n}
    rounds: dict[int, list[ProbeOutcomes]] = {}
    for p in (*first, *second):
        if p.n:
            rounds.setdefault(p.round, []).append(p)
    for group in rounds.values():
        indices = sorted(set().union(*(p.good for p in group)))
        weights = rng.multinomial(len(indices), [1 / len(indices)] * len(indices), size=replicates)
        for p in group:
            cols = [j for j, i in enumerate(indices) if i in p.good]
            good = np.array([p.good[indices[j]] for j in cols], float)
            w = weights[:, cols]
            kb, nb = counts[id(p)]
            kb += w @ good
            nb += w.sum(axis=1)
    def stack(probes):
        ran = [p for p in probes if p.n]
        kb = np.stack([counts[id(p)][0] for p in ran], axis=1)
        nb = np.stack([counts[id(p)][1] for p in ran], axis=1)
        return kb, nb
    return stack(first), stack(second)


def next_rate(probes: list[ProbeOutcomes], found: Capacity, grow: float, precision: float) -> float:
    """Where the next probe narrows the interval most: outside the data while they do not bracket
    the crossing (x grow up from the highest held, down from the lowest failed), else at the
    estimate unless probes already sit there, then at the interval's edge with the fewest
    requests nearby (the edge the interval is least sure of)."""
    if found.kind == "none":
        return min(p.rate for p in probes) / grow
    if found.kind == "at_least":
        return max(p.rate for p in probes) * grow
    if found.kind == "at_most":
        return min(p.rate for p in probes) / grow
    near = math.log1p(precision) / 2

    def crowd(x: float) -> int:
        return sum(p.n for p in probes if abs(math.log(p.rate / x)) < near)

    candidates = [found.estimate, found.lo, found.hi]
    return min(candidates, key=lambda x: (crowd(x), candidates.index(x)))


def wilson(k: int, n: int, z: float = 1.645) -> tuple[float, float]:
    """A binomial interval for k good of n (90%), for the figure's points."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at k = 0 or k = n a bound equals the share exactly in arithmetic, but rounding can put it a
    # hair on the wrong side (1 - 1e-16 for 6 of 6): the interval must contain its own share
    return min(max(0.0, mid - half), p), max(min(1.0, mid + half), p)
