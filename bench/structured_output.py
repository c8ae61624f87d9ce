"""Structured output on the bundled model: generated schemas, validity, and the mask's cost.

    .venv/bin/python bench/structured_output.py [--schemas 50] [--max-tokens 256]

In one process: (1) every schema of bench/schemas.py as a chat request on a colocated engine,
then on a prefill + a decode engine (KV over shm, as `serve --prefill 1 --decode 1`); each answer
must parse and validate under its schema (jsonschema). (2) The mask's cost per decode step:
fill every request's bitmask, apply it, sample and advance the matchers, at batch 1 and 32,
on the bundled model's vocabulary, beside the engine's measured decode step at the same batch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import torch

from splitserve.config import CacheConfig, EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.sampler import sample
from splitserve.engine.structured import advance_grammars, apply_grammar_masks
from splitserve.kv_transfer import KVTransferConfig
from splitserve.models.loader import load_model
from splitserve.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from schemas import schemas  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from engine_support import run_disaggregated, run_to_end  # noqa: E402


def engine(loaded, role: str, instance_id: str) -> EngineCore:
    kv = KVTransferConfig(transport="shm") if role != "colocated" else None
    return EngineCore(EngineConfig(cache=CacheConfig(kv_cache_memory="512MiB"), role=role, kv_transfer=kv,
                                   instance_id=instance_id, num_threads=1), loaded)


def prompt(loaded, schema: dict) -> list[int]:
    messages = [{"role": "system", "content": "Answer with JSON only."},
                {"role": "user", "content": "Describe a shop item as JSON with fields " + ", ".join(schema["properties"])}]
    return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def validity(loaded, all_schemas, max_tokens: int) -> dict:
    requests = [(str(i), prompt(loaded, s), SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i,
                                                           json_schema=json.dumps(s)))
                for i, s in enumerate(all_schemas)]
    colocated = engine(loaded, "colocated", "c")
    for rid, p, params in requests:
        colocated.add_request(rid, p, params)
    started = time.perf_counter()
    results = {"colocated": run_to_end(colocated)}
    times = {"colocated": time.perf_counter() - started}
    prefill, decode = engine(loaded, "prefill", "p"), engine(loaded, "decode", "d")
    started = time.perf_counter()
    try:
        split = run_disaggregated(prefill, decode, requests)
    finally:
        prefill.close()
        decode.close()
    times["split"] = time.perf_counter() - started
    results["split"] = {rid: r[0] for rid, r in split.items()}
    out = {}
    for mode, tokens in results.items():
        valid, truncated, bad = 0, [], []
        for i, s in enumerate(all_schemas):
            text = loaded.tokenizer.decode(tokens[str(i)], skip_special_tokens=True)
            if len(tokens[str(i)]) >= max_tokens:  # cut by max_tokens: not JSON yet, and no claim
                truncated.append((i, text[-80:]))
                continue
            try:
                jsonschema.validate(json.loads(text), s)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                bad.append((i, text[:120], str(e)[:120]))
        out[mode] = {"valid": valid, "truncated": truncated, "invalid": bad, "seconds": round(times[mode], 1)}
    return out


def mask_cost(loaded, batch: int, steps: int = 30) -> dict:
    core = engine(loaded, "colocated", "m")
    schema = schemas(1, seed=3)[0]
    reqs = []
    for i in range(batch):
        core.add_request(str(i), prompt(loaded, schema), SamplingParams(max_tokens=steps + 2, temperature=0,
                                                                        ignore_eos=True, json_schema=json.dumps(schema)))
        reqs.append(core.requests[str(i)])
    # the engine's own decode step at this batch (the same grammars, so the same answers)
    while any(r.num_output_tokens == 0 for r in reqs):
        core.step()
    step_times = []
    for _ in range(10):
        t = time.perf_counter()
        core.step()
        step_times.append(time.perf_counter() - t)
    # the mask alone, on fresh matchers, over random logits
    for r in reqs:
        r.grammar = None
        core.grammars.attach(r, [])
    gen = torch.Generator().manual_seed(0)
    mask_times = []
    for _ in range(steps):
        for r in reqs:  # time only live grammars: an ended one costs nothing
            if not r.grammar.active:
                r.grammar = None
                core.grammars.attach(r, [])
        logits = torch.randn(batch, loaded.config.vocab_size, generator=gen)
        t = time.perf_counter()
        apply_grammar_masks(logits, reqs)
        masked = time.perf_counter() - t
        tokens = sample(logits, reqs, gen)  # not timed: sampling is there with or without a grammar
        t = time.perf_counter()
        advance_grammars(reqs, tokens)
        mask_times.append(masked + time.perf_counter() - t)
    mask_ms, step_ms = 1000 * sorted(mask_times)[len(mask_times) // 2], 1000 * sorted(step_times)[5]
    return {"batch": batch, "mask_ms_median": round(mask_ms, 3), "decode_step_ms_median": round(step_ms, 1),
            "share_of_step": round(mask_ms / step_ms, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemas", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--skip-validity", action="store_true")
    p.add_argument("--skip-mask-cost", action="store_true", help="validity only (no timing: needs no quiet box)")
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None)
    report = {}
    if not args.skip_validity:
        report["validity"] = validity(loaded, schemas(args.schemas), args.max_tokens)
    if not args.skip_mask_cost:
        report["mask_cost"] = [mask_cost(loaded, b) for b in (1, 32)]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
