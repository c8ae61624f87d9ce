"""Decode attention alone: the C++ paged kernel on each instruction set against the torch path.

    python bench/decode_attention.py --threads 1 --contexts 64 512 1024 --batch-size 16

One "step" is the decode attention of every layer for `batch` sequences at one context length:
`num_layers` calls on `num_layers` separate caches (as the engine makes them, so a long context
reads its K/V from memory, not from a cache level a single layer would fit in). The shapes default
to the bundled SmolLM2-135M's (30 layers, 9 query heads, 3 KV heads, head_dim 64, block 16).
Printed per run: the step's time and its cost per KV token (step time / (batch x context)), which
is what the step model's "us per decode KV token" term measures inside whole engine steps.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from splitserve import kernels
from splitserve.config import ModelConfig
from splitserve.models.llama import LlamaModel


def torch_path(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> LlamaModel:
    """A LlamaModel shell with only what the engine's torch attention fallbacks (`_decode_attention`,
    `_prefill_attention`) read; bench/prefill_attention.py uses it too."""
    model = LlamaModel.__new__(LlamaModel)
    model.config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=num_heads * head_dim,
                               intermediate_size=8, num_layers=1, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim)
    model.scale, model.block_size = head_dim ** -0.5, block_size
    return model


def time_runs(step, repeats: int) -> list[float]:
    step()  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        runs.append(time.perf_counter() - t0)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--isas", nargs="+", default=["best", "scalar"],
                        help="kernel instruction sets to time ('best': what this CPU runs by default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("NQ", "NKV", "HD"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write every run here")
    args = parser.parse_args()
    module = kernels.load()
    if module is None:
        raise SystemExit("kernels not built: run `python -m splitserve.kernels.build` first")
    best = module.isa()
    nq, nkv, hd = args.heads
    b, bs = args.batch_size, args.block_size
    reference = torch_path(nq, nkv, hd, bs)
    rows = []
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        blocks_per_seq = -(-ctx // bs)
        num_blocks = b * blocks_per_seq
        # per layer: [2, nkv, num_blocks, bs, hd], each sequence's blocks scattered over the pool
        caches = [torch.randn(2, nkv, num_blocks, bs, hd, generator=g) for _ in range(args.num_layers)]
        tables = torch.randperm(num_blocks, generator=g).view(b, blocks_per_seq)
        lens = torch.full((b,), ctx, dtype=torch.long)
        q = torch.randn(b, nq, hd, generator=g)
        visible = torch.arange(blocks_per_seq * bs).unsqueeze(0) < lens.unsqueeze(1)
        want = reference._decode_attention(q, caches[0], tables, visible)
        for threads in args.threads:
            torch.set_num_threads(threads)
            steps = {}
            for isa in args.isas:
                used = module.set_isa(best if isa == "best" else isa)
                steps[f"kernel {used}"] = (used, lambda: [module.paged_decode_attention(
                    q, c, tables, lens, reference.scale) for c in caches])
            steps["torch (gather + bmm + softmax)"] = (None, lambda: [
                reference._decode_attention(q, c, tables, visible) for c in caches])
            for name, (isa, step) in steps.items():
                if isa is not None:
                    module.set_isa(isa)
                    torch.testing.assert_close(step()[0], want, rtol=1e-4, atol=1e-4)
                runs = time_runs(step, args.repeats)
                us_per_token = [r * 1e6 / (b * ctx) for r in runs]
                rows.append({"path": name, "threads": threads, "batch": b, "context": ctx, "seconds": runs,
                             "us_per_kv_token": us_per_token})
                print(f"{threads} thread(s) ctx {ctx:5d} {name:<32} step ms "
                      f"{' '.join(f'{r * 1e3:7.1f}' for r in runs)} | us per KV token "
                      f"{min(us_per_token):6.2f}-{max(us_per_token):6.2f}", flush=True)
            module.set_isa(best)
        del caches
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": {"num_layers": args.num_layers, "num_heads": nq, "num_kv_heads": nkv,
                                 "head_dim": hd, "block_size": bs}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
