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
    python bench/curve_coverage.py --queue --settings 0.01:bounds:fit,0.01:bounds [--max-probes 4]

--queue draws probes from a queue instead of a logistic: Poisson arrivals at the probed rate into
one first-come-first-served server that starts each probe empty, a request good when it leaves
within its deadline. Its share good per probe is flat near its ceiling up to the server's
capacity, then falls over a short stretch, and probes near there scatter widely (a queue that
grows or recovers by chance): the shape real probes had (session 37: doc-heavy's colocated pair
held 0.93-0.97 up to 1.33 req/s and gave 0.88, 0.87, 0.75, 0.37 and 0.23 at 1.42), which no
logistic draws. The truth is the rate whose expected share good is the target (Monte Carlo on
common random numbers). A setting's third field: `fit` is the bootstrap's interval alone
(curve.REACH_PROBES off: before session 37), none the shipped one (reaches the probes beside the
estimate, and the placement probes between them).
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


def use_setting(ridge: float, kind: str, reach: bool = True) -> None:
    """The class slope penalty, the asymptotes `kind` allows and whether the interval reaches the
    probes beside the estimate, set on trial/curve.py itself (a pool worker runs jobs of several
    settings, so each sets all of them)."""
    curve.CLASS_RIDGE = ridge
    curve.CEILINGS = () if kind == "none" else SHIPPED_CEILINGS
    curve.FLOORS = SHIPPED_FLOORS if kind == "bounds" else ()
    curve.REACH_PROBES = reach


def placed(rng: np.random.Generator, draw, max_probes: int, start: float = 1.0) -> curve.Capacity:
    """The trial's placement (next_rate) against draw(x, k) -> ProbeOutcomes, to the precision 0.2."""
    probes, x = [], start
    for k in range(max_probes):
        probes.append(draw(x, k))
        found = curve.capacity(probes, TARGET, rng)
        if found.kind == "point" and found.width() < 0.2:
            break
        x = curve.next_rate(probes, found, 2.0, 0.2)
    return found


def label(kind: str, reach: bool) -> str:
    """A setting's asymptotes and interval as the output names them (RIDGE:KIND:reach|fit)."""
    return f"{kind}:{'reach' if reach else 'fit':5s}"


def tally(found: list[curve.Capacity], true: float) -> str:
    points = [f for f in found if f.kind == "point"]
    covered = sum(f.lo <= true <= f.hi for f in points)
    width = float(np.median([f.width() for f in points])) if points else math.nan
    return (f"{covered}/{len(points)} covered, {sum(f.hi < true for f in points)} under the truth, "
            f"{sum(f.lo > true for f in points)} over, median width {width:.0%}")


# (service-time CV, chat deadline, document share, document service time / chat's, document deadline),
# deadlines in mean service times (the server does 1 request per unit of time at the mix's mean)
QUEUE_SHAPES = [(0.5, 5.0, 0.0, 1.0, 0.0), (1.0, 10.0, 0.0, 1.0, 0.0),
                (0.5, 4.0, 0.15, 6.0, 12.0), (0.5, 3.0, 0.15, 10.0, 15.0)]


def queue_probes(rng: np.random.Generator, x: float, requests: int, shape, reps: int = 1):
    """reps probes of `requests` requests at rate x into one FIFO server that starts empty:
    (good (reps, requests), is_document (reps, requests))."""
    cv, chat_deadline, doc_share, doc_size, doc_deadline = shape
    gaps = rng.exponential(1.0, (reps, requests)) / x
    is_doc = rng.random((reps, requests)) < doc_share
    mean = (1 - doc_share) + doc_share * doc_size
    size = np.where(is_doc, doc_size, 1.0) / mean
    service = rng.gamma(1 / cv ** 2, cv ** 2, (reps, requests)) * size
    arrive = np.cumsum(gaps, axis=1)
    done = np.zeros(reps)
    good = np.zeros((reps, requests), bool)
    for i in range(requests):
        done = np.maximum(done, arrive[:, i]) + service[:, i]
        good[:, i] = done - arrive[:, i] <= np.where(is_doc[:, i], doc_deadline, chat_deadline)
    return good, is_doc


def queue_crossing(shape, requests: int, reps: int = 20000) -> float:
    """The rate whose expected share good is the target (the same draws at every rate, so the
    share falls monotonically with it)."""
    lo, hi = math.log(0.05), math.log(20.0)
    for _ in range(40):
        mid = (lo + hi) / 2
        good, _ = queue_probes(np.random.default_rng(12345), math.exp(mid), requests, shape, reps)
        lo, hi = (mid, hi) if good.mean() >= TARGET else (lo, mid)
    return math.exp(lo)


def one_queue(job) -> str:
    (ridge, kind, reach), shape, seeds, max_probes, requests = job
    use_setting(ridge, kind, reach)
    true = queue_crossing(shape, requests)
    found = []
    for seed in seeds:
        rng = np.random.default_rng(seed)

        def draw(x, k):
            good, is_doc = queue_probes(rng, x, requests, shape)
            classes = {i: ("document" if is_doc[0, i] else "chat") for i in range(requests)} if shape[2] else {}
            return curve.ProbeOutcomes(x, {i: bool(good[0, i]) for i in range(requests)}, k, classes)
        found.append(placed(rng, draw, max_probes, start=0.6 * true))
    cv, chat_deadline, doc_share, doc_size, doc_deadline = shape
    what = (f"documents {doc_share:.0%} x{doc_size:g} deadline {doc_deadline:g}" if doc_share else "one class")
    return (f"{ridge}:{label(kind, reach)} queue cv {cv} deadline {chat_deadline:g}, {what} "
            f"(crossing {true:.3f}): {tally(found, true)}")


def one_single(job) -> str:
    """One class: P(good) = floor + (1 - floor) * logistic, crossing the target at 0.5; 'ceiling'
    is the single curve as it was (no floors), 'bounds' with floors."""
    (ridge, kind, reach), (slope, floor), seeds, max_probes, requests = job
    use_setting(ridge, "bounds" if kind == "bounds" else "ceiling", reach)
    share = (TARGET - floor) / (1 - floor)
    eta0 = math.log(share / (1 - share))
    found = []
    for seed in seeds:
        rng = np.random.default_rng(seed)

        def draw(x, k):
            p = floor + (1 - floor) / (1 + math.exp(-(eta0 + slope * (math.log(x) - math.log(0.5)))))
            return curve.ProbeOutcomes(x, {i: bool(rng.random() < p) for i in range(requests)}, k)
        found.append(placed(rng, draw, max_probes))
    return f"single curve, {label(kind, reach)} slope {slope:6.1f} floor {floor:.2f}: {tally(found, 0.5)}"


def one(job) -> str:
    (ridge, kind, reach), (chat, doc, slope, always_bad, always_good), seeds, max_probes, requests = job
    use_setting(ridge, kind, reach)
    found = []
    for seed in seeds:
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
    return (f"{ridge}:{label(kind, reach)} chat {chat:4.1f} doc {doc:4.1f} slope {slope:6.1f} always-bad chats {always_bad}, "
            f"always-good documents {always_good}: {tally(found, true)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="0.05:none,0.01:bounds")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--shapes", default=None, help="only these shapes, by position in the list (0-based: 0,7)")
    ap.add_argument("--max-probes", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--single", action="store_true", help="one class: the single curve with and without floors")
    ap.add_argument("--queue", action="store_true", help="probes drawn from a queue (module docstring)")
    args = ap.parse_args()
    settings = []
    for s in args.settings.split(","):
        ridge, kind, *rest = s.split(":")
        if kind not in KINDS or rest not in ([], ["fit"]):
            ap.error(f"a setting is RIDGE:{'|'.join(KINDS)}[:fit], got {s!r}")
        settings.append((float(ridge), kind, not rest))
    shapes = QUEUE_SHAPES if args.queue else SINGLE_SHAPES if args.single else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    run = one_queue if args.queue else one_single if args.single else one
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(s, shape, seeds, args.max_probes, args.requests) for s in settings for shape in shapes]
    with Pool(2) as pool:
        for line in pool.imap(run, jobs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
