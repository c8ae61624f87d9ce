"""Coverage of the mixture capacity's 90% interval on synthetic probes, per class-curve setting.

Each shape draws probes of chats and documents (15% documents) from known logistic curves in log
rate, runs the trial's probe placement (trial/curve.py next_rate, up to --max-probes probes of
--requests requests), and counts over --seeds seeds how often the interval covers the true
crossing of the whole mix, and how often it lies wholly under or over it. A setting is a class
slope penalty and which asymptotes each class may get: none (0 and 1), ceiling (a ceiling on
curve.CEILINGS) or bounds (a ceiling and a floor on curve.FLOORS, fit_bounds); the shipped one is
CLASS_RIDGE with bounds. Session 36 chose it with this (docs/benchmarks.md, "A capacity you can
quote"; curve.py, "Classes").

    python bench/curve_coverage.py --settings 0.05:none,0.01:bounds [--max-probes 8 --requests 40]
"""
from __future__ import annotations

import argparse
import math
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitserve.trial import curve  # noqa: E402

TARGET = 0.9
DOC_SHARE = 0.15
# (chat crossing, document crossing, slope in log rate, chats at the head of each probe that fail at
# every rate, documents at the head of each probe that meet their SLOs at every rate)
SHAPES = [(8.0, 0.6, -6.0, 0, 0), (1.2, 0.8, -6.0, 0, 0), (0.5, 0.6, -6.0, 0, 0), (0.5, 0.6, -20.0, 0, 0),
          (0.5, 0.6, -20.0, 1, 0), (8.0, 0.6, -20.0, 0, 0), (8.0, 0.6, -20.0, 0, 1), (8.0, 0.6, -6.0, 0, 1)]
KINDS = ("none", "ceiling", "bounds")
SHIPPED_CEILINGS, SHIPPED_FLOORS = curve.CEILINGS, curve.FLOORS
# one class (the single curve's path, which has always had its ceiling): (slope, floor of P(good))
SINGLE_SHAPES = [(-6.0, 0.0), (-20.0, 0.0), (-6.0, 0.15), (-20.0, 0.15)]


def truth(x: float, crossing: float, slope: float) -> float:
    eta = math.log(TARGET / (1 - TARGET)) + slope * (math.log(x) - math.log(crossing))
    return 1 / (1 + math.exp(-eta))


def expected_share(x: float, chat: float, doc: float, slope: float, requests: int, always_bad: int,
                   always_good: int) -> float:
    """The share of a probe's requests that are good in expectation, the always-failing chats and
    the always-good documents included (what the probes measure, so the crossing to cover)."""
    pc, pd = truth(x, chat, slope), truth(x, doc, slope)
    docs = DOC_SHARE * requests
    # the first always_good documents of a probe (if it has that many) are good whatever the rate
    sure = sum(1 - sum(math.comb(requests, j) * DOC_SHARE ** j * (1 - DOC_SHARE) ** (requests - j) for j in range(m))
               for m in range(1, always_good + 1))
    good = ((1 - DOC_SHARE) * (requests - always_bad) * pc + docs * pd + sure * (1 - pd))
    return good / requests


def mix_crossing(chat: float, doc: float, slope: float, requests: int = 40, always_bad: int = 0,
                 always_good: int = 0) -> float:
    lo, hi = math.log(0.01), math.log(100.0)
    for _ in range(100):
        mid = (lo + hi) / 2
        share = expected_share(math.exp(mid), chat, doc, slope, requests, always_bad, always_good)
        lo, hi = (mid, hi) if share >= TARGET else (lo, mid)
    return math.exp(lo)


def use_setting(ridge: float, kind: str) -> None:
    """The class slope penalty and the asymptotes `kind` allows, set on trial/curve.py itself (a pool
    worker runs jobs of several settings, so each sets all three)."""
    curve.CLASS_RIDGE = ridge
    curve.CEILINGS = () if kind == "none" else SHIPPED_CEILINGS
    curve.FLOORS = SHIPPED_FLOORS if kind == "bounds" else ()


def placed(rng: np.random.Generator, draw, max_probes: int) -> curve.Capacity:
    """The trial's placement (next_rate) against draw(x, k) -> ProbeOutcomes, to the precision 0.2."""
    probes, x = [], 1.0
    for k in range(max_probes):
        probes.append(draw(x, k))
        found = curve.capacity(probes, TARGET, rng)
        if found.kind == "point" and found.width() < 0.2:
            break
        x = curve.next_rate(probes, found, 2.0, 0.2)
    return found


def tally(found: list[curve.Capacity], true: float) -> str:
    points = [f for f in found if f.kind == "point"]
    covered = sum(f.lo <= true <= f.hi for f in points)
    return (f"{covered}/{len(points)} covered, {sum(f.hi < true for f in points)} under the truth, "
            f"{sum(f.lo > true for f in points)} over")


def one_single(job) -> str:
    """One class: P(good) = floor + (1 - floor) * logistic, crossing the target at 0.5; 'ceiling'
    is the single curve as it was (no floors), 'bounds' with floors."""
    (ridge, kind), (slope, floor), seeds, max_probes, requests = job
    use_setting(ridge, "bounds" if kind == "bounds" else "ceiling")
    share = (TARGET - floor) / (1 - floor)
    eta0 = math.log(share / (1 - share))
    found = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)

        def draw(x, k):
            p = floor + (1 - floor) / (1 + math.exp(-(eta0 + slope * (math.log(x) - math.log(0.5)))))
            return curve.ProbeOutcomes(x, {i: bool(rng.random() < p) for i in range(requests)}, k)
        found.append(placed(rng, draw, max_probes))
    return f"single curve, {kind:8s} slope {slope:6.1f} floor {floor:.2f}: {tally(found, 0.5)}"


def one(job) -> str:
    (ridge, kind), (chat, doc, slope, always_bad, always_good), seeds, max_probes, requests = job
    use_setting(ridge, kind)
    found = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)

        def draw(x, k):
            good, classes, docs = {}, {}, 0
            for i in range(requests):
                klass = "document" if rng.random() < DOC_SHARE else "chat"
                ok = rng.random() < truth(x, chat if klass == "chat" else doc, slope)
                if klass == "document":
                    docs += 1
                    ok = ok or docs <= always_good
                good[i], classes[i] = bool(ok) and not (i < always_bad and klass == "chat"), klass
            return curve.ProbeOutcomes(x, good, k, classes)
        found.append(placed(rng, draw, max_probes))
    true = mix_crossing(chat, doc, slope, requests, always_bad, always_good)
    return (f"{ridge}:{kind:8s} chat {chat:4.1f} doc {doc:4.1f} slope {slope:6.1f} always-bad chats {always_bad}, "
            f"always-good documents {always_good}: {tally(found, true)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="0.05:none,0.01:bounds")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--max-probes", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--single", action="store_true", help="one class: the single curve with and without floors")
    args = ap.parse_args()
    settings = []
    for s in args.settings.split(","):
        ridge, kind = s.split(":")
        if kind not in KINDS:
            ap.error(f"a setting is RIDGE:{'|'.join(KINDS)}, got {s!r}")
        settings.append((float(ridge), kind))
    shapes = SINGLE_SHAPES if args.single else SHAPES
    jobs = [(s, shape, args.seeds, args.max_probes, args.requests) for s in settings for shape in shapes]
    with Pool(2) as pool:
        for line in pool.imap(one_single if args.single else one, jobs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
