"""The device check: the engine on a GPU against transformers on the same GPU, in one run.

    bash bench/gpu/check.sh                                        # a lent GPU machine (wheels, then this)
    .venv/bin/python bench/gpu/check.py --device cpu --quick --out /tmp/gpu-check   # the same, on this CPU

Sections, in order (check.json is rewritten after each, so a run cut short keeps what it measured;
a section that fails records its error and the next one still runs):
    checkpoints  random-weight HF checkpoints of real shapes (checkpoints.py), written here
    greedy       8 prompts of 5-2,000 tokens, the engine's greedy tokens against transformers' (fp32:
                 equal; bf16: leading tokens equal)                                       parity.py
    steps        decode step at batch 1, 32, 128; prefill of 2k and 8k tokens; engine vs
                 transformers, each clock read after a device synchronization         step_times.py
    stall        16 streams decoding when an 8k-token prompt arrives: each stream's longest pause,
                 colocated whole, colocated chunked, 1 prefill + 1 decode process          serving.py
    handover     the 1P1D run's KV transfers in GB/s against a device-to-host copy of the same bytes
`--quick` (with --device cpu) runs the suite's tiny model at small sizes: the test suite runs it
(tests/test_gpu_check.py) so the script cannot rot between lent machines.
"""
from __future__ import annotations

import argparse
import warnings
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import checkpoints
import parity
import serving
import step_times

FULL = dict(
    models=["qwen2.5-0.5b", "llama-3.2-1b"], serve_model="qwen2.5-0.5b",
    greedy_prompts=[5, 16, 64, 200, 500, 1000, 1500, 2000], greedy_tokens=32, greedy_chunk=512,
    greedy_dtypes=["float32", "bfloat16"], step_dtype="bfloat16", batches=[1, 32, 128], context=512,
    prefills=[2048, 8192], warmup=3, repeats=10, kv_cache="16GiB",
    streams=16, long_tokens=8192, stream_tokens=3000, warmup_tokens=12, settle_s=1.0, serve_chunk=512,
    serve_kv_mib=8192, threads=4)
QUICK = dict(
    models=[checkpoints.TINY], serve_model=checkpoints.TINY,
    greedy_prompts=[5, 12, 30, 64, 100, 150, 200, 300], greedy_tokens=16, greedy_chunk=64,
    greedy_dtypes=["float32", "bfloat16"], step_dtype="float32", batches=[1, 4, 8], context=64,
    prefills=[128, 512], warmup=2, repeats=5, kv_cache="64MiB",
    streams=4, long_tokens=512, stream_tokens=1500, warmup_tokens=8, settle_s=0.5, serve_chunk=64,
    serve_kv_mib=64, threads=1)


def device_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "python": platform.python_version(), "cpu": cpu_name()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia_smi"] = f"unavailable: {e}"
    return info


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def tokenizer_vocab(path: Path) -> int:
    """Prompts draw ids the tokenizer knows (the model's vocabulary may be larger, as Qwen's is)."""
    from transformers import PreTrainedTokenizerFast

    return len(PreTrainedTokenizerFast.from_pretrained(path))


class Check:
    def __init__(self, args, sizes: dict) -> None:
        self.args, self.sizes = args, sizes
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or tempfile.mkdtemp(prefix="splitserve-gpu-check-"))
        self.results = {"mode": "quick" if args.quick else "full", "system": device_info(args.device),
                        "sizes": sizes, "errors": {}, "seconds": {}}
        self.paths: dict[str, Path] = {}

    def section(self, name: str, fn) -> None:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception:  # noqa: BLE001 - the next section still runs; the error is in the JSON
            self.results["errors"][name] = traceback.format_exc()[-4000:]
            print(self.results["errors"][name], flush=True)
        self.results["seconds"][name] = time.perf_counter() - started
        (self.out / "check.json").write_text(json.dumps(self.results, indent=2))

    def write_checkpoints(self) -> list[dict]:
        written = []
        for shape in dict.fromkeys(self.sizes["models"] + [self.sizes["serve_model"]]):
            path = self.work / shape
            written.append(checkpoints.write_checkpoint(path, shape, device=self.args.device))
            self.paths[shape] = path
        return written

    def greedy(self) -> dict:
        s = self.sizes
        out = {}
        for shape in s["models"]:
            prompts = parity.random_prompts(s["greedy_prompts"], tokenizer_vocab(self.paths[shape]))
            out[shape] = {dtype: parity.compare(str(self.paths[shape]), self.args.device, dtype, prompts,
                                                s["greedy_tokens"], s["greedy_chunk"], s["kv_cache"])
                          for dtype in s["greedy_dtypes"]}
        return out

    def steps(self) -> dict:
        s = self.sizes
        return {shape: step_times.compare(str(self.paths[shape]), self.args.device, s["step_dtype"], s["batches"],
                                          s["context"], s["prefills"], s["warmup"], s["repeats"], s["kv_cache"],
                                          tokenizer_vocab(self.paths[shape]))
                for shape in s["models"]}

    def stall(self) -> dict:
        s = self.sizes
        path = self.paths[s["serve_model"]]
        flags = serving.arrangements(s["serve_chunk"], s["long_tokens"], s["serve_kv_mib"], s["threads"])
        results = serving.run_arrangements(
            str(path), self.args.device, s["step_dtype"], flags, self.work, vocab=tokenizer_vocab(path),
            streams=s["streams"], long_tokens=s["long_tokens"], stream_tokens=s["stream_tokens"],
            warmup_tokens=s["warmup_tokens"], settle_s=s["settle_s"])
        failed = {name: r for name, r in results.items() if "error" in r}
        if failed:
            self.results["stall"] = results  # kept with the logs' tails, then counted as an error
            raise RuntimeError(f"arrangements failed: {json.dumps(failed, indent=1)[-3000:]}")
        return results

    def handover(self) -> dict:
        return serving.handover(self.results.get("stall", {}), self.args.device)


def summary(results: dict) -> str:
    lines = [f"splitserve device check ({results['mode']}): {json.dumps(results['system'])}"]
    for shape, by_dtype in results.get("greedy", {}).items():
        for dtype, r in by_dtype.items():
            lines.append(f"greedy {shape} {dtype}: all equal {r['all_equal']}, leading tokens equal per prompt "
                         f"{[p['leading_equal'] for p in r['prompts']]} of {r['num_tokens']} "
                         f"(prompt tokens {[p['prompt_tokens'] for p in r['prompts']]}); differences not at a "
                         f"near-tie: {r['differences_not_near_ties']}")
    for shape, r in results.get("steps", {}).items():
        for kind in ("decode_step_s", "prefill_step_s"):
            cells = ", ".join(f"{k}: {r['engine'][kind][k] * 1e3:.2f} ms vs {r['transformers'][kind][k] * 1e3:.2f} ms"
                              for k in r["engine"][kind])
            what = f"decode (batch: engine vs transformers, context {r['context_tokens']})" \
                if kind.startswith("decode") else "prefill (tokens: engine vs transformers)"
            lines.append(f"steps {shape} {r['dtype']} {what}: {cells}")
    for name, r in results.get("stall", {}).items():
        if "error" in r:
            lines.append(f"stall {name}: ERROR {r['error']}")
            continue
        lines.append(f"stall {name}: no-load step {r['no_load_step_s'] * 1e3:.1f} ms, longest pause per stream "
                     f"{[round(p, 3) for p in r['longest_pause_per_stream_s']]} s (worst {r['pause_over_step']:.1f}x "
                     f"step), long prompt TTFT {r['long_ttft_s']:.3f} s (alone {r['lone_long_ttft_s']:.3f} s)")
    h = results.get("handover")
    if h:
        lines.append(f"handover over {h['transport']} ({h['staging']}): {h['lone_kv_transfer']['bytes'] / 1e6:.1f} MB "
                     f"at {h['lone_kv_transfer']['gbps']:.2f} GB/s alone, {h['kv_transfer']['gbps']:.2f} GB/s under "
                     f"load; a copy of the same bytes: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in h["copy_same_bytes"].items()))
    for name, error in results["errors"].items():
        lines.append(f"ERROR in {name}: {error.strip().splitlines()[-1]}")
    lines.append("seconds per section: " + ", ".join(f"{k} {v:.0f}" for k, v in results["seconds"].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    p.add_argument("--quick", action="store_true", help="the suite's tiny model at small sizes (the CPU run)")
    p.add_argument("--out", default="gpu-check", help="where check.json and summary.txt go")
    p.add_argument("--work", default=None, help="where checkpoints and server logs go (default: a temp dir)")
    p.add_argument("--sections", default="greedy,steps,stall,handover")
    args = p.parse_args(argv)
    from splitserve.devices import DeviceUnavailable, check_device

    try:
        check_device(args.device)
    except DeviceUnavailable as e:
        print(f"check.py: {e}", file=sys.stderr)
        return 2
    # transformers 5.2x renames past_key_values to cache; 5.17 (the GPU image's) knows only the old name
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: transformers' and ours alike
    torch.backends.cudnn.allow_tf32 = False
    check = Check(args, QUICK if args.quick else FULL)
    check.section("checkpoints", check.write_checkpoints)
    for name in args.sections.split(","):
        check.section(name, getattr(check, name))
    text = summary(check.results)
    (check.out / "summary.txt").write_text(text)
    print(text, flush=True)
    return 1 if check.results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
