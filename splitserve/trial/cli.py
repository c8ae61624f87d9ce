"""`splitserve trial SPEC.yaml [--repeat N] [--capacity] [--sweep] [--dry-run] [--out DIR]`.

Imports stay light (no torch): the spec is validated, and every arrival is generated,
before any server starts, so a bad spec fails in a second with the field named; --dry-run
stops there and prints the plan. results.json is rewritten after every run, so a trial cut
short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="trial spec (YAML); see examples/")
    parser.add_argument("--sweep", action="store_true",
                        help="per arrangement, raise the request rate until attainment drops below the target")
    parser.add_argument("--capacity", action="store_true",
                        help="search each arrangement's capacity within the SLOs (on when the spec has capacity:)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every arrangement N times in rotating order (ABCD, BCDA, ...); the table "
                             "shows median and min-max, and a winner needs ranges that do not overlap")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the spec and print the plan (requests, arrivals, arrangements, "
                             "cores, threads, KV memory) without starting anything")
    parser.add_argument("--plan", default=None, metavar="PROFILE_OR_PLAN",
                        help="a profile.json or plan.json: put the planner's prediction beside what was measured")
    parser.add_argument("--out", default=None, help="output folder (default: trial-results/<name>-<time>)")
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="run only this arrangement (repeatable)")
    parser.add_argument("--url", default=None,
                        help="replace the spec's arrangements with one external endpoint at this URL")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from splitserve.trial.spec import Arrangement, SpecError, load_spec

    console = Console(stderr=False)
    try:
        if args.repeat < 1:
            raise SpecError(f"--repeat: run each arrangement at least once, got {args.repeat}")
        spec = load_spec(args.spec)
        if args.url:
            if spec.faults:
                raise SpecError("faults: --url points at an external endpoint; the trial can only kill "
                                "engines of servers it launches itself")
            spec.arrangements = [Arrangement(name="external", url=args.url.rstrip("/"))]
            spec.tune = None
            if spec.arrivals.relative_rate is not None:
                spec.arrivals.relative_rate.reference = "external"
        if args.only:
            unknown = set(args.only) - {a.name for a in spec.arrangements}
            if unknown:
                raise SpecError(f"--only: no arrangement named {sorted(unknown)}; "
                                f"the spec has {[a.name for a in spec.arrangements]}")
            spec.arrangements = [a for a in spec.arrangements if a.name in args.only]
        if args.dry_run:
            from splitserve.trial.dryrun import describe_plan

            print(describe_plan(spec, repeat=args.repeat, capacity=args.capacity, sweep=args.sweep))
            return 0
        from splitserve.trial.report import write_json
        from splitserve.trial.results import results_document
        from splitserve.trial.runner import Trial

        out_dir = pathlib.Path(args.out or f"trial-results/{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")

        def save(t: Trial) -> None:
            done = [t.results[a.name] for a in t.arrangements if a.name in t.results]
            write_json(results_document(spec, t.plan, done, args.sweep, t), out_dir / "results.json")

        profile = None
        if args.plan:
            from splitserve.control.compare import profile_of

            profile = profile_of(json.loads(pathlib.Path(args.plan).read_text()), args.plan)
        trial = Trial(spec, out_dir, progress=_progress_factory(console), on_update=save)
    except (SpecError, ValueError, OSError) as exc:  # ProfileError and JSONDecodeError are ValueErrors
        print(f"splitserve trial: {exc}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so every launched server is torn down
    # by its `launched` context instead of being left running.
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    console.print(f"trial {spec.name}: {len(trial.arrivals)} requests over "
                  f"{trial.arrivals[-1].time_s:.0f} s, arrangements {[a.name for a in spec.arrangements]}")
    results = trial.run(sweep=args.sweep, repeat=args.repeat, capacity=args.capacity)
    from splitserve.trial.report import print_summary, write_html

    doc = results_document(spec, trial.plan, results, args.sweep, trial)
    write_json(doc, out_dir / "results.json")
    write_html(doc, out_dir / "report.html")
    print_summary(doc, console)
    if profile is not None:
        _predicted_beside_measured(profile, doc, spec, out_dir, console)
    console.print(f"results: {out_dir / 'results.json'}\nreport:  {out_dir / 'report.html'}")
    return 0 if any(r.runs for r in results) else 1


def _predicted_beside_measured(profile, doc: dict, spec, out_dir: pathlib.Path, console) -> None:
    """The planner re-simulates the trial's exact plan; a failure here never loses the results."""
    from splitserve.control.compare import compare_results, render
    from splitserve.trial.report import write_json

    try:
        comparison = compare_results(profile, doc, spec.slo.attainment)
    except (ValueError, KeyError) as exc:
        console.print(f"predicted vs measured: not computed ({exc})")
        return
    write_json(comparison, out_dir / "predicted_vs_measured.json")
    console.print(render(comparison))


def _progress_factory(console):
    """A live progress bar per replay; the bar finishes when its last request does."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def start(label: str, total: int):
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False)
        task = progress.add_task(label, total=total)
        progress.start()
        state = {"done": 0}

        def on_done(record) -> None:
            state["done"] += 1
            progress.advance(task)
            if state["done"] == total:
                progress.stop()

        return on_done

    return start
