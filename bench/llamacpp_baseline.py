"""llama.cpp on the same GGUF, through llama-cpp-python's low-level API (its own venv).

Runs under .venv-llamacpp/bin/python (no torch, no splitserve); bench/engine.py starts
it as a subprocess and reads the JSON object it prints last.

llama.cpp keeps the weights in their GGUF type (Q4_1 here: ~5 bits a weight, against
splitserve's and HF's dequantized fp32) and its KV cache in f16 by default.

Prefill: one sequence of N random tokens in one llama_decode call (split into
micro-batches of n_ubatch internally), logits for the last position only.
Decode: one context with a KV stream per sequence (n_seq_max = largest batch); all
prompts are prefilled, then each step is one llama_decode of one token per live
sequence with greedy argmax on the host. The batch is cut down (64 -> 32 -> 8 -> 1)
by removing sequences from the KV memory, as the other systems do by aborting.
"""
from __future__ import annotations

import argparse
import json
import random

import llama_cpp
import numpy as np

from records import DecodeResult, PrefillResult, StepTimer, as_row

SYSTEM = "llama.cpp"


class Context:
    """A llama.cpp context with its batch buffer; sequences are addressed by seq id."""

    def __init__(self, model, n_ctx: int, n_seq_max: int, n_batch: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_seq_max = n_seq_max
        params.n_batch = n_batch
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def set_threads(self, threads: int) -> None:
        llama_cpp.llama_set_n_threads(self.ctx, threads, threads)

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """tokens: (token, position, seq id, wants logits); returns greedy ids of the outputs."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(tokens)
        status = llama_cpp.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {len(tokens)} tokens")
        num_outputs = sum(t[3] for t in tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx),
                                       shape=(num_outputs, self.n_vocab))  # [outputs, vocab]
        return logits.argmax(axis=1)

    def prefill(self, prompts: dict[int, list[int]]) -> dict[int, int]:
        """Prefill each seq's prompt (batches of up to n_batch tokens); returns its first token."""
        pending = [(tok, pos, seq, pos == len(prompt) - 1)
                   for seq, prompt in prompts.items() for pos, tok in enumerate(prompt)]
        first: dict[int, int] = {}
        for start in range(0, len(pending), self.n_batch):
            chunk = pending[start:start + self.n_batch]
            ids = self.decode(chunk)
            for (_, _, seq, _), token in zip([t for t in chunk if t[3]], ids):
                first[seq] = int(token)
        return first

    def forget(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def random_prompt(rng: random.Random, n_vocab: int, num_tokens: int) -> list[int]:
    return [rng.randrange(100, n_vocab) for _ in range(num_tokens)]


def measure_prefill(model, args, rng: random.Random) -> list[PrefillResult]:
    if not args.prefill_tokens:
        return []
    longest = max(args.prefill_tokens)
    ctx = Context(model, n_ctx=longest + 256, n_seq_max=1, n_batch=longest)
    results = []
    for threads in args.threads:
        ctx.set_threads(threads)
        ctx.prefill({0: random_prompt(rng, ctx.n_vocab, 64)})  # warm-up at this thread count
        ctx.forget(0)
        for num_tokens in args.prefill_tokens:
            repeats = args.repeats_small if num_tokens <= 512 else args.repeats_large
            timer = StepTimer()
            for _ in range(repeats):
                prompt = random_prompt(rng, ctx.n_vocab, num_tokens)
                with timer:
                    ctx.prefill({0: prompt})
                ctx.forget(0)
            results.append(PrefillResult(SYSTEM, threads, num_tokens, timer.best, timer.best_cpu,
                                         repeats))
    ctx.close()
    return results


def measure_decode(model, args, rng: random.Random) -> list[DecodeResult]:
    batch_sizes = sorted(args.batch_sizes, reverse=True)
    steps_needed = len(batch_sizes) * len(args.threads) * (args.decode_steps + 1) + 2
    per_seq_ctx = args.prompt_len + steps_needed + 16
    ctx = Context(model, n_ctx=batch_sizes[0] * per_seq_ctx, n_seq_max=batch_sizes[0], n_batch=2048)
    ctx.set_threads(max(args.threads))
    prompts = {seq: random_prompt(rng, ctx.n_vocab, args.prompt_len) for seq in range(batch_sizes[0])}
    next_tokens = ctx.prefill(prompts)
    position = args.prompt_len  # every sequence has the same length, so one position serves all
    results = []
    for batch_size in batch_sizes:
        for seq in list(next_tokens)[batch_size:]:
            ctx.forget(seq)
            del next_tokens[seq]
        for threads in args.threads:
            ctx.set_threads(threads)
            timer = StepTimer()
            for step in range(args.decode_steps + 1):  # step 0 is the warm-up
                tokens = [(tok, position, seq, True) for seq, tok in next_tokens.items()]
                if step == 0:
                    ids = ctx.decode(tokens)
                else:
                    with timer:
                        ids = ctx.decode(tokens)
                next_tokens = {seq: int(tok) for seq, tok in zip(next_tokens, ids)}
                position += 1
            results.append(DecodeResult(SYSTEM, threads, batch_size,
                                        position - args.decode_steps + args.decode_steps // 2,
                                        args.decode_steps, timer.best, timer.median, timer.best_cpu))
    ctx.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="path to the .gguf file")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=224)
    parser.add_argument("--decode-steps", type=int, default=6)
    parser.add_argument("--repeats-small", type=int, default=3)
    parser.add_argument("--repeats-large", type=int, default=2)
    args = parser.parse_args()

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.model}")
    rng = random.Random(0)
    rows = [as_row(r) for r in measure_prefill(model, args, rng)]
    rows += [as_row(r) for r in measure_decode(model, args, rng)]
    info = {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "weight_bytes": llama_cpp.llama_model_size(model)}
    llama_cpp.llama_model_free(model)
    print(json.dumps({"rows": rows, "info": info}))


if __name__ == "__main__":
    main()
