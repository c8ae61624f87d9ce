"""`splitserve workload analyze FILE`: the buyer's first questions about a trace or request log.

How long are the prompts (distribution, share of long inputs)? How long are the answers?
How bursty is the traffic (coefficient of variation of inter-arrival gaps: 1 for Poisson,
above 1 for bursts; peak over mean request rate across fixed windows)? FILE is a trace
(Azure, BurstGPT, Mooncake) or a trial's results.json (its plan is the request log).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from splitserve.trial.arrivals import burstiness_stats
from splitserve.trial.traces import TRACE_FORMATS, TraceError, TraceRecord, read_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    p = sub.add_parser("analyze", help="prompt lengths, long-input share and burstiness of a trace")
    p.add_argument("file", help="trace (CSV/JSONL) or a trial's results.json")
    p.add_argument("--format", default="auto", choices=("auto",) + TRACE_FORMATS)
    p.add_argument("--long-input-tokens", type=int, default=1000,
                   help="a prompt this long or longer counts as a long input (default 1000)")
    p.add_argument("--window-s", type=float, default=10.0, help="window for the peak/mean rate (default 10 s)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--profile", default=None, metavar="PROFILE_JSON",
                   help="a `splitserve profile` file: also estimate how often a long prefill would meet "
                        "requests arriving or answers streaming, and recommend an arrangement")
    p.add_argument("--threads", type=int, default=1, help="threads per instance for --profile (default 1)")


def read_requests(path: pathlib.Path, fmt: str = "auto") -> list[TraceRecord]:
    if path.suffix == ".json":
        try:
            plan = json.loads(path.read_text())["plan"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TraceError(f"{path}: a .json file must be a trial's results.json with a 'plan' list") from None
        return [TraceRecord(p["send_at_s"], p["num_prompt_tokens"], p["max_tokens"]) for p in plan]
    return read_trace(path, fmt)


def _distribution(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in (10, 50, 90, 99)},
            "max": int(values.max())}


def analyze(records: list[TraceRecord], long_input_tokens: int = 1000, window_s: float = 10.0) -> dict:
    prompts = np.asarray([r.prompt_tokens for r in records])
    answers = np.asarray([r.answer_tokens for r in records])
    edges = [0, 256, 512, 1024, 2048, 4096, 8192]
    counts = [int(((prompts >= lo) & (prompts < hi)).sum()) for lo, hi in zip(edges, edges[1:])]
    counts.append(int((prompts >= edges[-1]).sum()))
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    return {
        "num_requests": len(records),
        "prompt_tokens": _distribution(prompts),
        "answer_tokens": _distribution(answers),
        "prompt_histogram": dict(zip(labels, counts)),
        "long_input_tokens": long_input_tokens,
        "long_input_share": float((prompts >= long_input_tokens).mean()),
        "long_input_token_share": float(prompts[prompts >= long_input_tokens].sum() / prompts.sum()),
        "burstiness": burstiness_stats(np.asarray([r.time_s for r in records]), window_s),
    }


def render(result: dict) -> str:
    p, a, b = result["prompt_tokens"], result["answer_tokens"], result["burstiness"]
    lines = [
        f"requests: {result['num_requests']} over {b['span_s']:.0f} s (mean {b['mean_rate']:.2f} req/s)",
        f"prompt tokens: mean {p['mean']:.0f}, p10 {p['p10']:.0f}, p50 {p['p50']:.0f}, p90 {p['p90']:.0f}, "
        f"p99 {p['p99']:.0f}, max {p['max']}",
        f"answer tokens: mean {a['mean']:.0f}, p50 {a['p50']:.0f}, p90 {a['p90']:.0f}, p99 {a['p99']:.0f}",
        f"long inputs (>= {result['long_input_tokens']} tokens): {result['long_input_share']:.0%} of requests, "
        f"{result['long_input_token_share']:.0%} of prompt tokens",
        f"burstiness: inter-arrival CV {b['interarrival_cv']:.2f} (Poisson = 1), peak/mean rate over "
        f"{b['window_s']:g} s windows {b['peak_to_mean_rate']:.1f}",
        "prompt length histogram:"]
    total = max(result["num_requests"], 1)
    for label, count in result["prompt_histogram"].items():
        lines.append(f"  {label:>10} {count:7d} {'#' * round(40 * count / total)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.file)
    if not path.is_file():
        print(f"splitserve workload analyze: file {str(path)!r} not found", file=sys.stderr)
        return 2
    try:
        records = read_requests(path, args.format)
        result = analyze(records, args.long_input_tokens, args.window_s)
        if args.profile:
            from splitserve.control.overlap import analyze_records
            from splitserve.control.profile_file import load_profile

            result["overlap"] = analyze_records(records, load_profile(args.profile), args.long_input_tokens,
                                                args.threads)
    except (TraceError, ValueError, OSError) as exc:  # ProfileError is a ValueError
        print(f"splitserve workload analyze: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(render(result))
    if "overlap" in result:
        from splitserve.control.overlap import render_overlap

        print(render_overlap(result["overlap"]))
    return 0
