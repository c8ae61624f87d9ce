"""Read trials' results.json again with the current capacity code: the same probes, today's fit.

When the estimator changes after runs were made (docs/benchmarks.md says when), the probes those
runs measured are still observations; this prints each run's capacities, ratio and decision as the
current `trial/quote.py` reads them, beside what the run itself said, so both are on record. The
probe placement of those runs followed the estimator they ran with, which this cannot redo.

    python bench/requote.py bench/results/quote_s11/quiet/run*/results.json [--json out.json]
    python bench/requote.py --pool bench/results/quote_s11/quiet/run*/results.json

`--pool` reads several runs of one spec as the repeats of one trial (each run's rounds kept apart,
as `--repeat N` keeps its repeats): what N runs' probes say together.

`--then fit-only` puts today's fit with the bootstrap's interval alone (curve.REACH_PROBES off, the
estimator before session 37) where "then" would be what the run said: what reaching the probes
beside the estimate changes, with nothing else between the two readings.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.trial import curve  # noqa: E402
from splitserve.trial.quote import quote  # noqa: E402
from splitserve.trial.verdict import fitted_verdict  # noqa: E402


def _iv(c: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.2f}"
    if c["kind"] == "point":
        return f"{f(c['estimate_rps'])} [{f(c['lo_rps'])}-{f(c['hi_rps'])}]"
    return f"{c['kind'].replace('_', ' ')} {f(c['estimate_rps'])}"


def _ratio(r: dict | None) -> str:
    if not r:
        return "-"
    if r.get("estimate") is not None:
        return f"{r['estimate']:.2f}x [{r['lo']:.2f}-{r['hi']:.2f}]"
    if r.get("lo") is not None:
        return f"at least {r['lo']:.2f}x"
    return f"at most {r['hi']:.2f}x"


def pooled(docs: list[dict]) -> dict:
    """One results document whose arrangements carry every run's probes, run k as repeat k."""
    out = copy.deepcopy(docs[0])
    out["tuning_runs"] = []
    for arr in out["arrangements"]:
        arr["runs"] = []
        for k, doc in enumerate(docs):
            same = next((a for a in doc["arrangements"] if a["name"] == arr["name"]), None)
            for run in (same or {}).get("runs", []):
                arr["runs"].append({**run, "repeat": k})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--pool", action="store_true", help="read the runs as the repeats of one trial")
    ap.add_argument("--then", choices=("run", "fit-only"), default="run",
                    help="what to show beside today's reading: what the run said, or today's fit without "
                         "reaching the probes beside the estimate")
    args = ap.parse_args()
    if args.pool:
        now = quote(pooled([json.loads(p.read_text()) for p in args.results]))
        for n, c in now["arrangements"].items():
            print(f"  {n:28s} {_iv(c):26s} ({len(c['points'])} probes)")
        print(f"  ratio {_ratio(now['ratio'])} ({now['decision']})")
        print(fitted_verdict(now))
        return 0
    rows = []
    for path in args.results:
        doc = json.loads(path.read_text())
        if args.then == "fit-only":
            shipped, curve.REACH_PROBES = curve.REACH_PROBES, False
            try:
                then = quote(copy.deepcopy(doc)) or {}
            finally:
                curve.REACH_PROBES = shipped
        else:
            then = doc.get("quote") or {}
        now = quote(doc)
        if now is None:
            print(f"{path}: no fitted capacity in it", file=sys.stderr)
            continue
        row = {"results": str(path), "decision_then": then.get("decision"), "ratio_then": then.get("ratio"),
               "decision_now": now["decision"], "ratio_now": now["ratio"],
               "arrangements_then": {n: {k: c.get(k) for k in ("kind", "estimate_rps", "lo_rps", "hi_rps")}
                                     for n, c in (then.get("arrangements") or {}).items()},
               "arrangements_now": {n: {k: c.get(k) for k in ("kind", "estimate_rps", "lo_rps", "hi_rps")}
                                    for n, c in now["arrangements"].items()},
               "verdict_now": fitted_verdict(now)}
        rows.append(row)
        print(path)
        for n, c in now["arrangements"].items():
            was = (then.get("arrangements") or {}).get(n)
            print(f"  {n:28s} now {_iv(c):26s} then {_iv(was) if was else '-'}")
        print(f"  ratio now {_ratio(now['ratio'])} ({now['decision']}); then {_ratio(then.get('ratio'))} "
              f"({then.get('decision')})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
