"""Engine benchmark: splitserve vs HF transformers vs llama.cpp, against this CPU's limits.

One run measures, at each thread count: prefill tok/s for 512- and 2,048-token
prompts; decode tok/s at batch 1, 8, 32 and 64 with a ~256-token context; fp32
matmul FLOP/s and memory-read bandwidth; and (in a subprocess) the engine's peak
RSS with the bundled model and a 1 GiB KV cache. Ratios to the baselines and the
verdict on each target of issue 2 are computed from the same run.

    .venv/bin/python bench/engine.py                 # full run, ~10 minutes on 2 cores
    .venv/bin/python bench/engine.py --quick         # smoke run: small sizes, nothing saved

llama.cpp runs from its own venv (.venv-llamacpp, see docs/benchmarks.md) in a
subprocess; without it that part is skipped with a message, as is the engine part
when splitserve's engine cannot be imported.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

import torch

import engine_report
import hardware
from flops import ModelShape
from records import as_row

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
LLAMACPP_PYTHON = REPO_DIR / ".venv-llamacpp" / "bin" / "python"
DEFAULT_JSON = BENCH_DIR / "results" / "engine.json"


def llamacpp_missing(python: pathlib.Path) -> str | None:
    """Why the llama.cpp baseline cannot run with this interpreter, or None when it can."""
    if not python.exists():
        return (f"{python} not found: build llama-cpp-python there with `bash bench/setup_llamacpp.sh` "
                "(a source build: ~10 minutes on a quiet 2-core machine), or pass --llamacpp-python")
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import llama_cpp: run `bash bench/setup_llamacpp.sh`"
    return None


def bundled_gguf() -> pathlib.Path:
    from splitserve.models.loader import bundled_model_path

    return bundled_model_path()


def cpu_info() -> dict:
    """The CPU's model name and the SIMD flags that decide which kernels run (Linux only)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    simd = [f for f in fields.get("flags", "").split() if f.startswith(("avx", "fma", "f16c", "amx"))]
    return {"model": fields.get("model name"), "family": fields.get("cpu family"), "simd_flags": simd}


def run_hf(args, gguf: pathlib.Path, generator: torch.Generator) -> tuple[list, ModelShape]:
    from hf_baseline import hf_decode, hf_prefill, load_hf_model

    t0 = time.perf_counter()
    model = load_hf_model(gguf)
    print(f"[hf] loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    shape = ModelShape.from_config(model.config)
    results = []
    for threads in args.threads:
        for num_tokens in args.prefill_tokens:
            results.append(hf_prefill(model, num_tokens, threads, _repeats(args, num_tokens), generator))
            _progress(results[-1])
    for result in hf_decode(model, args.batch_sizes, args.prompt_len, args.decode_steps,
                            args.threads, generator):
        results.append(result)
        _progress(result)
    del model
    gc.collect()
    return results, shape


def run_splitserve(args, generator: torch.Generator, weight_format: str = "auto",
                   ) -> tuple[list, ModelShape | None, str | None]:
    """The engine's rows, its model shape, and why it was skipped (None when it ran)."""
    try:
        from splitserve_runs import build_engine, engine_decode, engine_prefill, system_name

        t0 = time.perf_counter()
        engine = build_engine(max(args.prefill_tokens + [args.prompt_len]), max(args.batch_sizes),
                              weight_format=weight_format)
    except ImportError as exc:
        return [], None, f"splitserve engine not importable yet: {exc}"
    system = system_name(weight_format)
    print(f"[{system}] loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    results = []
    for threads in args.threads:
        for num_tokens in args.prefill_tokens:
            results.append(engine_prefill(engine, num_tokens, threads, _repeats(args, num_tokens),
                                          generator, system))
            _progress(results[-1])
    for result in engine_decode(engine, args.batch_sizes, args.prompt_len, args.decode_steps,
                                args.threads, generator, system):
        results.append(result)
        _progress(result)
    shape = ModelShape.from_config(engine.model_config)
    del engine
    gc.collect()
    return results, shape, None


def run_llamacpp(args, gguf: pathlib.Path) -> tuple[list[dict], dict, str | None]:
    """llama.cpp's rows (already dicts), its build info, and why it was skipped."""
    why = llamacpp_missing(args.llamacpp_python)
    if why:
        return [], {}, why
    cmd = [str(args.llamacpp_python), str(BENCH_DIR / "llamacpp_baseline.py"), "--model", str(gguf),
           "--threads", *map(str, args.threads), "--prefill-tokens", *map(str, args.prefill_tokens),
           "--batch-sizes", *map(str, args.batch_sizes), "--prompt-len", str(args.prompt_len),
           "--decode-steps", str(args.decode_steps), "--repeats-small", str(_repeats(args, 0)),
           "--repeats-large", str(_repeats(args, 10**9))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return [], {}, f"llama.cpp run failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in report["rows"]:
        print(f"[llama.cpp] {_describe(row)}", flush=True)
    return report["rows"], report["info"], None


def run_peak_rss() -> tuple[dict, str | None]:
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "peak_rss.py"), "--kv-cache-memory", "1GiB"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_DIR)
    if proc.returncode != 0:
        return {}, f"peak RSS run failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def _repeats(args, num_tokens: int) -> int:
    if args.quick:
        return 1
    return 3 if num_tokens <= 512 else 2


def _describe(row: dict) -> str:
    size = f"{row['num_tokens']} tokens" if row["kind"] == "prefill" else f"batch {row['batch_size']}"
    return (f"{row['kind']} {size} at {row['threads']} thread(s): {row['tokens_per_s']:.1f} tok/s "
            f"(quiet {row['quiet_tokens_per_s']:.1f})")


def _progress(result) -> None:
    print(f"[{result.system}] {_describe(as_row(result))}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=224,
                        help="decode prompts; the context grows by the timed steps to ~256 on average")
    parser.add_argument("--decode-steps", type=int, default=6, help="timed steps per batch size")
    parser.add_argument("--weight-formats", nargs="+", default=["auto", "fp32"],
                        choices=["auto", "fp32", "gguf", "gguf-q8act"],
                        help="engine weight formats to run side by side (auto: the default engine, "
                             "reported as 'splitserve'; others as 'splitserve-<format>')")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hf", "splitserve", "llama.cpp", "rss"])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 128/256-token prefill, batch 1 and 4, 2 steps; writes no JSON")
    parser.add_argument("--json", type=pathlib.Path, default=DEFAULT_JSON)
    parser.add_argument("--llamacpp-python", type=pathlib.Path, default=LLAMACPP_PYTHON,
                        help="a Python with llama-cpp-python installed (bench/setup_llamacpp.sh)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefill_tokens, args.batch_sizes, args.prompt_len, args.decode_steps = [128, 256], [1, 4], 64, 2
    for name in ("threads", "prefill_tokens", "batch_sizes"):
        if min(getattr(args, name)) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} values must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    report: dict = {"command": " ".join(  # no absolute path of this machine in a committed result
                        pathlib.Path(a).name if os.path.isabs(a) else a for a in [sys.executable, *sys.argv]),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "loadavg_start": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
                    "num_cpus": os.cpu_count(), "torch": torch.__version__, "skipped": {},
                    "cpu_info": cpu_info()}
    t0 = time.perf_counter()
    print("[hardware] measuring matmul and memory bandwidth", flush=True)
    report["hardware"] = hardware.measure(args.threads, quick=args.quick)
    print(hardware.format_table(report["hardware"]), flush=True)
    gguf = bundled_gguf()
    rows: list[dict] = []
    shape = None
    if "hf" not in args.skip:
        hf_rows, shape = run_hf(args, gguf, generator)
        rows += [as_row(r) for r in hf_rows]
    for weight_format in ([] if "splitserve" in args.skip else args.weight_formats):
        try:
            ss_rows, ss_shape, why = run_splitserve(args, generator, weight_format)
        except Exception:  # a half-built engine must not cost the baselines already measured
            ss_rows, ss_shape, why = [], None, "splitserve engine failed:\n" + traceback.format_exc()
        rows += [as_row(r) for r in ss_rows]
        shape = shape or ss_shape
        if why:
            report["skipped"][f"splitserve-{weight_format}"] = why
            print(f"[splitserve-{weight_format}] SKIPPED: {why}", flush=True)
    if "llama.cpp" not in args.skip:
        cpp_rows, report["llamacpp_info"], why = run_llamacpp(args, gguf)
        rows += cpp_rows
        if why:
            report["skipped"]["llama.cpp"] = why
            print(f"[llama.cpp] SKIPPED: {why}", flush=True)
    if "rss" not in args.skip:
        report["peak_rss"], why = run_peak_rss()
        if why:
            report["skipped"]["rss"] = why
            print(f"[rss] SKIPPED: {why}", flush=True)
    report["loadavg_end"] = os.getloadavg()
    report["seconds"] = time.perf_counter() - t0
    report["rows"] = rows
    if shape is not None:
        report["model"] = {"weight_bytes_fp32": shape.weight_bytes(), "linear_params": shape.linear_params,
                           "lm_head_params": shape.lm_head_params}
        report["targets"] = engine_report.targets(report, shape)
    print(engine_report.format_report(report, shape), flush=True)
    if not args.quick:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
