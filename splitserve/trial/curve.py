"""Capacity from a fitted curve: every request's outcome at every probed rate, one monotone model.

A probe at offered rate x sends n requests; k of them meet every SLO. All probes of one
arrangement feed one logistic model of P(good | x) in log rate,

    P(good | x) = 1 / (1 + exp(-(a + b * (log x - c))))     b < 0: more load, fewer good

fitted by penalized maximum likelihood (Newton on two parameters; a weak ridge on b keeps the
fit finite when the probes separate perfectly: all good below some rate, all bad above). The
capacity is where the curve crosses the target attainment. The curve may level off under 1:
P(good | x) = u * (the logistic), the ceiling u kept only where it fits clearly better than 1
(fit_ceiling); a ceiling at or under the target means the curve never reaches it, and the answer
is "at most" the lowest rate probed rather than a crossing bent out of a plateau.

Its interval is a two-stage parametric bootstrap, probes then requests within. Requests of one
probe are not independent: a document burst fails several chats at once, a slow second of the
host slows all requests in flight. So a replicate first draws each probe's own P(good) around the
fitted curve (a beta with the probes' overdispersion phi), then its n requests from that P.
phi is how far the probes scatter around the fit beyond binomial noise (Pearson X^2, widened by
each probe's leverage), drawn per replicate over a chi-square on P - 2 degrees of freedom since
6-8 probes pin it down poorly, and never under 1. Why not resample whole probes: with 6-8 probes
at different rates a resample often loses every probe on one side of the crossing, and the fit
is then not a crossing at all. Why not a wild bootstrap on the probes' residuals: it keeps the
rates but its width follows this run's residuals, and the search stops at the first narrow
interval, so it stopped on lucky ones (89 of 200 seeds covered). Measured in
tests/test_trial_curve.py on 200 seeds: independent outcomes 185 covered (requests alone: 171),
a N(0, 0.7) per-probe shift on the logit 177 (requests alone: 132).

A ratio of two arrangements' capacities gets a *paired* bootstrap: arrangements probed on the
same requests (the same round, the same request indices) redraw the same indices in a replicate,
so a hard request (a long document) that sinks both counts against both; each probe's fate beyond
its requests (phi above) is then added apart for each arrangement, which is wider than sharing it
when the host's drift hits both alike, and never narrower than the truth when it does not.

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
CEILINGS = (0.7, 0.75, 0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98)   # the upper asymptotes tried below 1
LR_CHI2 = 3.84       # chi-square(1) at 95%: how much better a lower ceiling must fit to be kept


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
    ceiling: float = 1.0           # the curve's upper asymptote: P(good) = ceiling * sigmoid(...)

    def width(self) -> float:
        """Relative width hi/lo - 1 (infinite for a bound)."""
        if self.kind != "point" or not self.lo:
            return math.inf
        return self.hi / self.lo - 1.0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "estimate_rps": self.estimate, "lo_rps": self.lo, "hi_rps": self.hi,
                "fit": list(self.fit) if self.fit else None, "ceiling": self.ceiling}


def fit_logistic(logx: np.ndarray, k: np.ndarray, n: np.ndarray, c: float, ceiling=1.0) -> np.ndarray:
    """Penalized MLE of (a, b) for every row at once: logx (P,), k and n (R, P) -> (R, 2), for
    P(good) = ceiling * sigmoid(a + b z), the ceiling one for all rows or one per row (R,). Fisher scoring on the 2x2 system, vectorized over the R
    replicates (at ceiling 1 these are Newton's steps for the plain logistic)."""
    k, n = np.atleast_2d(k).astype(float), np.atleast_2d(n).astype(float)
    ceiling = np.broadcast_to(np.asarray(ceiling, float), (k.shape[0],))[:, None]   # (R, 1)
    z = logx - c
    theta = np.zeros((k.shape[0], 2))
    total = np.maximum(n.sum(axis=1), 1.0)
    share = np.clip((k.sum(axis=1) + 0.5) / (total + 1.0) / ceiling[:, 0], 0.01, 0.99)
    theta[:, 0] = np.log(share / (1 - share))
    for _ in range(50):
        eta = theta[:, :1] + theta[:, 1:] * z
        s = 1.0 / (1.0 + np.exp(-np.clip(eta, -30, 30)))
        p = np.clip(ceiling * s, 1e-12, 1 - 1e-12)
        slope = ceiling * s * (1 - s)                  # dp / d eta
        r = (k - n * p) / (p * (1 - p)) * slope        # d loglik / d eta
        w = n * slope * slope / (p * (1 - p))          # Fisher information on eta
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


def fit_ceiling(logx, k, n, c) -> tuple[float, np.ndarray]:
    """The curve's upper asymptote and its (a, b): 1 unless a lower one on CEILINGS fits clearly
    better (a likelihood-ratio test at 95% on the one extra parameter), so a curve that plateaus
    under the target is not bent into a crossing it never makes, and one that reaches 1 keeps the
    two-parameter fit its coverage was measured on. All ceilings are fitted at once, one per row."""
    ceilings = np.array((1.0, *CEILINGS))
    rows = len(ceilings)
    theta = fit_logistic(logx, np.broadcast_to(k, (rows, len(k))), np.broadcast_to(n, (rows, len(n))), c, ceilings)
    eta = np.clip(theta[:, :1] + theta[:, 1:] * (logx - c), -30, 30)
    p = np.clip(ceilings[:, None] / (1.0 + np.exp(-eta)), 1e-12, 1 - 1e-12)
    loglik = (k * np.log(p) + (n - k) * np.log(1 - p)).sum(axis=1)     # (rows,)
    best = int(np.argmax(loglik))
    if 2 * (loglik[best] - loglik[0]) < LR_CHI2:
        best = 0
    return float(ceilings[best]), theta[best]


def _crossings(theta: np.ndarray, c: float, target: float, ceiling: float = 1.0) -> np.ndarray:
    """log rate where each fit crosses the target; nan where the fit does not fall with the rate
    or its ceiling is not above the target (it never reaches it)."""
    a, b = theta[:, 0], theta[:, 1]
    if ceiling <= target:
        return np.full(len(a), np.nan)
    share = target / ceiling
    logit = math.log(share / (1 - share))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = c + (logit - a) / b
    out[b >= -1e-6] = np.nan
    return out


def dispersed_counts(logx: np.ndarray, k: np.ndarray, n: np.ndarray, theta: np.ndarray, c: float,
                    rng: np.random.Generator, replicates: int, ceiling: float = 1.0) -> np.ndarray:
    """Replicate good counts (R, P), two stages: each replicate draws an overdispersion phi, then
    each probe's own P(good) from a beta around the fitted curve carrying that extra variance
    (a probe's shared fate), then its n requests from that P."""
    p, phi = probe_scatter(logx, k, n, theta, c, rng, replicates, ceiling)
    rho = np.clip((phi[:, None] - 1.0) / np.maximum(n - 1.0, 1.0), 0.0, 0.5)   # (R, P) within-probe correlation
    pc = np.clip(p, 1e-4, 1 - 1e-4)
    spread = (1.0 - rho) / np.maximum(rho, 1e-12)
    q = np.where(rho > 0, rng.beta(pc * spread, (1 - pc) * spread), p)
    return rng.binomial(n.astype(int), q).astype(float)


def probe_scatter(logx, k, n, theta, c, rng, replicates, ceiling=1.0) -> tuple[np.ndarray, np.ndarray]:
    """The fitted P(good) at each probe (P,) and an overdispersion phi per replicate (R,), never
    under 1 (binomial): the fit's Pearson X^2, each probe's term widened by its leverage (two
    parameters through six probes pull the curve toward them), over a chi-square draw on P - 2
    degrees of freedom, so few probes give a spread of phi rather than one lucky value."""
    z = logx - c
    s = 1.0 / (1.0 + np.exp(-np.clip(theta[0] + theta[1] * z, -30, 30)))
    p = ceiling * s
    dof = len(n) - 2
    if dof < 1:
        return p, np.ones(replicates)
    w = n * (ceiling * s * (1 - s)) ** 2 / np.maximum(p * (1 - p), 1e-12)
    x = np.stack([np.ones_like(z), z], axis=1)                            # (P, 2)
    info = x.T @ (w[:, None] * x) + np.diag([1e-9, RIDGE])
    leverage = w * np.einsum("pi,ij,pj->p", x, np.linalg.inv(info), x)    # (P,)
    pc = np.clip(p, 0.02, 0.98)
    pearson = float(((k - n * pc) ** 2 / (n * pc * (1 - pc)) / np.maximum(1.0 - leverage, 0.1)).sum())
    return p, np.maximum(1.0, pearson / rng.chisquare(dof, size=replicates))


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
    ceiling, fitted = fit_ceiling(logx, k, n, c)
    theta = fitted[None, :]
    cross = _crossings(theta, c, target, ceiling)[0]
    fit = (float(theta[0, 0]), float(theta[0, 1]), c)
    share = k / n
    held, failed = share >= target, share < target
    top, bottom = float(np.exp(logx.max())), float(np.exp(logx.min()))
    if not failed.any() or (held.any() and np.isfinite(cross) and cross > logx.max()):
        best = float(np.exp(logx[held].max())) if held.any() else top
        return Capacity("at_least", best, best, None, fit, ceiling)
    if ceiling <= target:   # a plateau under the target: not reached at any probed rate
        return Capacity("at_most", bottom, None, bottom, fit, ceiling)
    if not held.any() or not np.isfinite(cross) or cross < logx.min():
        worst = float(np.exp(logx[failed].min())) if failed.any() else bottom
        return Capacity("at_most", worst, None, worst, fit, ceiling)
    kb = dispersed_counts(logx, k, n, theta[0], c, rng, replicates, ceiling)
    boot = _crossings(fit_logistic(logx, kb, np.broadcast_to(n, kb.shape), c, ceiling), c, target, ceiling)
    # a replicate whose fit does not fall (nan) or crosses far outside: clip to the probed range
    boot = np.clip(np.nan_to_num(boot, nan=logx.max()), logx.min() - 1.0, logx.max() + 1.0)
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return Capacity("point", float(np.exp(cross)), float(np.exp(lo)), float(np.exp(hi)), fit, ceiling)


def paired_ratio(first: list[ProbeOutcomes], second: list[ProbeOutcomes], target: float,
                 rng: np.random.Generator, replicates: int = BOOTSTRAP, level: float = LEVEL) -> dict | None:
    """capacity(first) / capacity(second) with a paired bootstrap: in each replicate every round's
    request indices are redrawn once, and both arrangements' probes of that round keep the draws
    they ran (probes of a round one arrangement skipped are redrawn on their own), then each probe's
    scatter beyond its requests is added on its own (module docstring)."""
    a_cap = capacity(first, target, rng, replicates, level)
    b_cap = capacity(second, target, rng, replicates, level)
    if a_cap.kind != "point" or b_cap.kind != "point":
        return None
    draws_a, draws_b = _paired_counts(first, second, rng, replicates)
    out = []
    for probes, found, (kb, nb) in ((first, a_cap, draws_a), (second, b_cap, draws_b)):
        logx, k, n = _grouped(probes)
        a, b, c = found.fit
        p, phi = probe_scatter(logx, k, n, np.array([a, b]), c, rng, replicates, found.ceiling)
        # the probes' shared fate beyond their requests, drawn apart for each arrangement
        extra = np.sqrt(phi - 1.0)[:, None] * np.sqrt(nb * p * (1 - p)) * rng.standard_normal(kb.shape)
        kb = np.clip(kb + extra, 0.0, nb)
        boot = _crossings(fit_logistic(logx, kb, nb, c, found.ceiling), c, target, found.ceiling)
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
