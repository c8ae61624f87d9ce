"""`splitserve trial SPEC.yaml [--sweep] [--out DIR]`: replay one workload against each arrangement.

Imports stay light (no torch): the spec is validated, and every arrival is generated,
before any server starts, so a bad spec fails in a second with the field named.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="trial spec (YAML); see examples/")
    parser.add_argument("--sweep", action="store_true",
                        help="per arrangement, raise the request rate until attainment drops below the target")
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
        spec = load_spec(args.spec)
        if args.url:
            if spec.faults:
                raise SpecError("faults: --url points at an external endpoint; the trial can only kill "
                                "engines of servers it launches itself")
            spec.arrangements = [Arrangement(name="external", url=args.url.rstrip("/"))]
        if args.only:
            unknown = set(args.only) - {a.name for a in spec.arrangements}
            if unknown:
                raise SpecError(f"--only: no arrangement named {sorted(unknown)}; "
                                f"the spec has {[a.name for a in spec.arrangements]}")
            spec.arrangements = [a for a in spec.arrangements if a.name in args.only]
        from splitserve.trial.runner import Trial

        out_dir = pathlib.Path(args.out or f"trial-results/{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        trial = Trial(spec, out_dir, progress=_progress_factory(console))
    except (SpecError, ValueError, OSError) as exc:
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
    results = trial.run(sweep=args.sweep)
    from splitserve.trial.report import print_summary, write_html, write_json
    from splitserve.trial.verdict import results_document

    doc = results_document(spec, trial.plan, results, args.sweep)
    write_json(doc, out_dir / "results.json")
    write_html(doc, out_dir / "report.html")
    print_summary(doc, console)
    console.print(f"results: {out_dir / 'results.json'}\nreport:  {out_dir / 'report.html'}")
    return 0 if any(r.runs for r in results) else 1


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
