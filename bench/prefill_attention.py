"""Prefill attention alone: the C++ paged prefill kernel against the torch path it replaces.

    python bench/prefill_attention.py --threads 1 2 --cases 512:512 2048:2048 256:2048 --json out.json

One run is one layer's attention for one chunk: t queries at positions ctx - t .. ctx - 1 over
the ctx keys of a paged cache whose blocks are scattered over the pool, as the engine calls it.
"torch" is `LlamaModel._prefill_attention` as the engine runs it without the kernels: SDPA's flash
kernel with is_causal when nothing is cached, else a gather of the cached blocks, a [t, ctx]
boolean mask and SDPA. Shapes default to the bundled SmolLM2-135M's (9 query heads, 3 KV heads,
head_dim 64, block 16). GFLOP/s counts the causal work only: 4 x head_dim per visible
(query, key) pair, times the query heads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch

from splitserve import kernels
from splitserve.models.llama import LlamaModel, PrefillChunk

from decode_attention import time_runs, torch_path  # noqa: E402  (run as a script: bench/ is on the path)


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (model name, family/model), and its widest vector set."""
    try:
        info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                    if ":" in line)
    except OSError:
        return platform.processor() or platform.machine()
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = info.get("flags", "").split()
    widest = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, {widest})"


def causal_flops(t: int, ctx: int, num_heads: int, head_dim: int) -> int:
    visible_pairs = sum(ctx - t + i + 1 for i in range(t))
    return 4 * head_dim * visible_pairs * num_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", default=["512:512", "2048:2048", "256:2048"],
                        help="T:CTX pairs: a chunk of T tokens ending the CTX-token context")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("NQ", "NKV", "HD"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write every run here")
    args = parser.parse_args()
    module = kernels.load()
    if module is None:
        raise SystemExit("kernels not built: run `python -m splitserve.kernels.build` first")
    nq, nkv, hd = args.heads
    bs = args.block_size
    reference = torch_path(nq, nkv, hd, bs)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"CPU: {cpu_name()}; kernel instruction set: {module.isa()}")
    for case in args.cases:
        t, ctx = (int(x) for x in case.split(":"))
        num_needed = -(-ctx // bs)
        kv_layer = torch.randn(2, nkv, 2 * num_needed, bs, hd, generator=g)  # [2, nkv, blocks, bs, hd]
        block_ids = torch.randperm(2 * num_needed, generator=g)[:num_needed]
        chunk = PrefillChunk(start=0, num_tokens=t, num_context_tokens=ctx, block_ids=block_ids)
        qkv = torch.randn(t, (nq + 2 * nkv) * hd, generator=g)  # q, k, v as views of fused rows
        q = qkv[:, :nq * hd].view(t, nq, hd)
        # the chunk's own k and v, as the engine has them beside the cache
        own = LlamaModel._gather(kv_layer, block_ids)[:, :, ctx - t:ctx]  # [2, nkv, t, hd]
        k, v = own[0].transpose(0, 1).contiguous(), own[1].transpose(0, 1).contiguous()
        flops = causal_flops(t, ctx, nq, hd)
        steps = {
            "torch sdpa": lambda: reference._prefill_attention(q, k, v, kv_layer, chunk),
            f"kernel {module.isa()}": lambda: module.paged_prefill_attention(q, kv_layer, block_ids, ctx,
                                                                            reference.scale),
        }
        want = steps["torch sdpa"]()
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, step in steps.items():
                torch.testing.assert_close(step(), want, rtol=1e-4, atol=1e-4)
                runs = time_runs(step, args.repeats)
                gflops = [flops / r / 1e9 for r in runs]
                rows.append({"path": name, "threads": threads, "t": t, "ctx": ctx, "seconds": runs,
                             "gflop": flops / 1e9, "gflop_per_s_at_median": flops / statistics.median(runs) / 1e9})
                print(f"{threads} thread(s) t {t:5d} ctx {ctx:5d} {name:<14} ms median "
                      f"{statistics.median(runs) * 1e3:7.2f} range {min(runs) * 1e3:7.2f}-{max(runs) * 1e3:7.2f}"
                      f" | GFLOP/s {min(gflops):5.1f}-{max(gflops):5.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads_available": os.cpu_count(), "torch": torch.__version__,
                       "shape": {"num_heads": nq, "num_kv_heads": nkv, "head_dim": hd, "block_size": bs},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
