"""Parsers for public request traces: each row becomes (arrival second, prompt tokens, answer tokens).

Formats (examples/traces/README.md says where each comes from):
- azure:    CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps as ISO date-times
            (Azure LLM inference trace 2023, Patel et al., Splitwise, ISCA 2024, CC-BY 4.0).
- burstgpt: CSV `Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,
            Total tokens,Log Type`, timestamps in seconds; failed requests have 0 response tokens.
- mooncake: JSONL `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`.
Times are returned relative to the first row, sorted.
"""
from __future__ import annotations

import csv
import datetime
import json
import pathlib
from dataclasses import dataclass

TRACE_FORMATS = ("azure", "burstgpt", "mooncake")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and column."""


@dataclass(slots=True, frozen=True)
class TraceRecord:
    time_s: float
    prompt_tokens: int
    answer_tokens: int


def detect_format(path: pathlib.Path) -> str:
    with open(path, newline="") as f:
        first = f.readline().strip()
    if first.startswith("{"):
        return "mooncake"
    header = [h.strip().lower() for h in first.split(",")]
    if "contexttokens" in header:
        return "azure"
    if "request tokens" in header:
        return "burstgpt"
    raise TraceError(f"{path}: cannot tell the trace format from its first line {first[:80]!r}; "
                     f"name it with format: one of {', '.join(TRACE_FORMATS)}")


def read_trace(path: str | pathlib.Path, fmt: str = "auto", skip_failed: bool = True) -> list[TraceRecord]:
    path = pathlib.Path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "azure":
        records = _read_azure(path)
    elif fmt == "burstgpt":
        records = _read_burstgpt(path, skip_failed)
    elif fmt == "mooncake":
        records = _read_mooncake(path)
    else:
        raise TraceError(f"unknown trace format {fmt!r}; use one of {', '.join(TRACE_FORMATS)}")
    if not records:
        raise TraceError(f"{path}: no requests in the trace")
    records.sort(key=lambda r: r.time_s)
    t0 = records[0].time_s
    return [TraceRecord(r.time_s - t0, r.prompt_tokens, r.answer_tokens) for r in records]


def _int(value: str, path, line: int, column: str) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{line}: column {column!r} is not a number: {value!r}") from None


def _read_azure(path: pathlib.Path) -> list[TraceRecord]:
    out = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                stamp = datetime.datetime.fromisoformat(_trim_fraction(row["TIMESTAMP"].strip()))
            except (KeyError, ValueError, AttributeError):
                raise TraceError(f"{path}:{line}: column 'TIMESTAMP' is not a date-time: "
                                 f"{row.get('TIMESTAMP')!r}") from None
            out.append(TraceRecord(stamp.timestamp(), _int(row.get("ContextTokens"), path, line, "ContextTokens"),
                                   _int(row.get("GeneratedTokens"), path, line, "GeneratedTokens")))
    return out


def _trim_fraction(stamp: str) -> str:
    # The Azure trace writes 7 fractional digits; older Pythons accept at most 6.
    if "." in stamp:
        head, frac = stamp.rsplit(".", 1)
        digits = "".join(c for c in frac if c.isdigit())
        return f"{head}.{digits[:6].ljust(6, '0')}{frac[len(digits):]}"
    return stamp


def _read_burstgpt(path: pathlib.Path, skip_failed: bool) -> list[TraceRecord]:
    out = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                stamp = float(row["Timestamp"])
            except (KeyError, TypeError, ValueError):
                raise TraceError(f"{path}:{line}: column 'Timestamp' is not a number: "
                                 f"{row.get('Timestamp')!r}") from None
            answer = _int(row.get("Response tokens"), path, line, "Response tokens")
            if answer == 0 and skip_failed:
                continue  # BurstGPT marks failed requests with zero response tokens
            out.append(TraceRecord(stamp, _int(row.get("Request tokens"), path, line, "Request tokens"), answer))
    return out


def _read_mooncake(path: pathlib.Path) -> list[TraceRecord]:
    out = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
                out.append(TraceRecord(float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                                       int(row["output_length"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{line}: not a Mooncake record with timestamp, input_length "
                                 f"and output_length ({exc})") from None
    return out
