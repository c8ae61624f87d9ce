"""`splitserve generate`: one chat answer from the engine, streamed to the terminal."""
from __future__ import annotations

import argparse
import sys
import time

from splitserve.config import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="of weights, activations and the KV cache")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="size of the paged KV cache, e.g. 1GiB")


def run(args: argparse.Namespace) -> int:
    from splitserve.api.render import Renderer
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        t0 = time.perf_counter()
        llm = LLM(args.model, device=args.device, dtype=args.dtype, num_threads=args.threads,
                  kv_cache_memory=args.kv_cache_memory)
        load_s = time.perf_counter() - t0
        if args.raw:
            prompt = llm.encode(args.prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt = llm.chat_prompt(messages + [{"role": "user", "content": args.prompt}])
    except (ValueError, FileNotFoundError) as exc:
        print(f"splitserve generate: {exc}", file=sys.stderr)
        return 2
    detok = Renderer(llm.tokenizer, llm.chat_template).new_output_text(stop=[])
    n, t0, first = 0, time.perf_counter(), None
    for token in llm.stream(prompt, params):
        first = first or time.perf_counter()
        n += 1
        sys.stdout.write(detok.add_tokens([token], finished=False))
        sys.stdout.flush()
    sys.stdout.write(detok.add_tokens([], finished=True) + "\n")
    total = time.perf_counter() - t0
    ttft = (first - t0) if first else total
    rate = (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0
    print(f"[{len(prompt)} prompt tokens, {n} generated; load {load_s:.1f}s, "
          f"first token {ttft * 1000:.0f} ms, {rate:.1f} tokens/s after]", file=sys.stderr)
    return 0
