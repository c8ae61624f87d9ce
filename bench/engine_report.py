"""Turns the engine benchmark's rows into ratios, target verdicts and a terminal table.

Targets (issue 2), each at every thread count measured:
  prefill_vs_matmul    2,048-token prefill GFLOP/s >= 85% of the matmul rate on the model's shapes
  decode_b32_vs_hf     decode tok/s at batch 32 >= 3x HF transformers'
  decode_b1_vs_memory  batch-1 decode step <= 1.3x (fp32 weight bytes / measured read bandwidth)
All of them use the "quiet" figures (records.quiet): CPU time at 1 thread, wall time at 2,
for the engine, the baselines and the hardware limits alike.
"""
from __future__ import annotations

import hardware
from flops import ModelShape

GIB = 1 << 30
PREFILL_TARGET = 0.85
DECODE_B32_TARGET = 3.0
DECODE_B1_TARGET = 1.3


def find(rows: list[dict], system: str, kind: str, threads: int, size: int) -> dict | None:
    key = "num_tokens" if kind == "prefill" else "batch_size"
    return next((r for r in rows if r["system"] == system and r["kind"] == kind
                 and r["threads"] == threads and r[key] == size), None)


def quiet_seconds(row: dict) -> float:
    """Prefill: time to the first token; decode: time of one step (quiet figures)."""
    size = row["num_tokens"] if row["kind"] == "prefill" else row["batch_size"]
    return size / row["quiet_tokens_per_s"]


def achieved_gflops(row: dict, shape: ModelShape) -> float:
    if row["kind"] == "prefill":
        return shape.prefill_flops(row["num_tokens"]) / quiet_seconds(row) / 1e9
    flops = shape.decode_step_flops(row["batch_size"], row["context_len"])
    return flops / quiet_seconds(row) / 1e9


def targets(report: dict, shape: ModelShape) -> list[dict]:
    """One verdict per (target, thread count, system); `met` is None when a side is missing."""
    rows, hw = report["rows"], report["hardware"]
    out = []
    for threads in sorted({r["threads"] for r in rows}):
        matmul = hardware.model_shape_gflops(hw, threads)
        bound_s = shape.weight_bytes() / (hardware.bandwidth(hw, threads, "read") * 1e9)
        for system in ("splitserve", "hf"):
            prefill = find(rows, system, "prefill", threads, 2048)
            if prefill:
                fraction = achieved_gflops(prefill, shape) / matmul
                out.append(_verdict("prefill_vs_matmul", system, threads, fraction, PREFILL_TARGET,
                                    f"{achieved_gflops(prefill, shape):.1f} of {matmul:.1f} GFLOP/s"))
            b1 = find(rows, system, "decode", threads, 1)
            if b1:
                step_s = quiet_seconds(b1)
                out.append(_verdict("decode_b1_vs_memory", system, threads, step_s / bound_s,
                                    DECODE_B1_TARGET, f"step {step_s * 1e3:.1f} ms, bound "
                                    f"{bound_s * 1e3:.1f} ms", lower_is_better=True))
        ours, hf = (find(rows, s, "decode", threads, 32) for s in ("splitserve", "hf"))
        if ours and hf:
            out.append(_verdict("decode_b32_vs_hf", "splitserve", threads,
                                ours["quiet_tokens_per_s"] / hf["quiet_tokens_per_s"], DECODE_B32_TARGET,
                                f"{ours['quiet_tokens_per_s']:.1f} vs {hf['quiet_tokens_per_s']:.1f} tok/s"))
    return out


def _verdict(name: str, system: str, threads: int, value: float, target: float, detail: str,
             lower_is_better: bool = False) -> dict:
    met = value <= target if lower_is_better else value >= target
    return {"target": name, "system": system, "threads": threads, "value": round(value, 3),
            "goal": f"{'<=' if lower_is_better else '>='} {target}", "met": met, "detail": detail}


def format_report(report: dict, shape: ModelShape | None) -> str:
    rows = report["rows"]
    lines = [f"load average at start {_load(report['loadavg_start'])}, "
             f"at end {_load(report['loadavg_end'])} (2 cores shared: a quiet rerun is cleaner)",
             "tok/s: wall clock; quiet: CPU time at 1 thread (what a quiet core gives), wall at 2;",
             "ms, GFLOP/s and the ratios use the quiet figures", ""]
    header = (f"{'system':<16}{'kind':<9}{'size':>6}{'thr':>4}{'tok/s':>9}{'quiet':>9}{'ms':>9}"
              f"{'GFLOP/s':>9}{'vs hf':>7}{'vs llama.cpp':>13}")
    lines += [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: (r["kind"] != "prefill", r.get("num_tokens") or r["batch_size"],
                                            r["threads"], r["system"])):
        size = row["num_tokens"] if row["kind"] == "prefill" else row["batch_size"]
        ms = quiet_seconds(row) * 1e3
        gflops = f"{achieved_gflops(row, shape):9.1f}" if shape else f"{'':9}"
        lines.append(f"{row['system']:<16}{row['kind']:<9}{size:>6}{row['threads']:>4}"
                     f"{row['tokens_per_s']:9.1f}{row['quiet_tokens_per_s']:9.1f}{ms:9.1f}{gflops}"
                     f"{_ratio(row, rows, 'hf'):>7}{_ratio(row, rows, 'llama.cpp'):>13}")
    if report.get("targets"):
        lines += ["", "targets (issue 2):"]
        for t in report["targets"]:
            mark = "MET" if t["met"] else "NOT MET"
            lines.append(f"  {t['target']:<20} {t['system']:<16} {t['threads']} thr: "
                         f"{t['value']:.2f} (goal {t['goal']}) {mark} - {t['detail']}")
    rss = report.get("peak_rss")
    if rss:
        lines += ["", f"peak RSS, bundled model + {rss['kv_cache_memory'] / GIB:.0f} GiB KV cache: "
                      f"{rss['peak_rss'] / GIB:.2f} GiB (after load {rss['peak_rss_after_load'] / GIB:.2f} GiB)"]
    for name, why in report.get("skipped", {}).items():
        lines.append(f"SKIPPED {name}: {why.splitlines()[0]}")
    return "\n".join(lines)


def _ratio(row: dict, rows: list[dict], baseline: str) -> str:
    if row["system"] == baseline:
        return ""
    size = row["num_tokens"] if row["kind"] == "prefill" else row["batch_size"]
    other = find(rows, baseline, row["kind"], row["threads"], size)
    return f"{row['quiet_tokens_per_s'] / other['quiet_tokens_per_s']:.2f}x" if other else ""


def _load(loadavg) -> str:
    return "/".join(f"{x:.1f}" for x in loadavg)
