"""How much slower one engine's steps run while another engine is busy on the other core.

    .venv/bin/python bench/host_contention.py [--threads 1] [--repeats 3] [--out contention.json]

The profile (`splitserve profile`) times one engine on an otherwise idle host; in a trial of two
1-thread instances both cores are often busy at once, and the instances share the memory
bandwidth and the last-level cache. This times the profile's own steps (control/profile.py's
StepTimer: lone prefills, a chunk, decodes, a mixed step) on core 0 three times: alone, while a
second engine process decodes 8 streams at context 512 on core 1 without pause, and alone again
(so a drift of the machine shows), and with `--rounds N` N busy passes, each between two lone ones.
Each step's fastest repeat is used, as the profile does; a step's `slowdown` is the median over
rounds of its busy time over the mean of the lone times either side, and `factor` their median;
`lone_spread_median` is how far the lone passes alone disagree (the noise floor of the machine).
The planner's simulator reads `factor` from a profile's `host_contention` (docs/benchmarks.md,
"Planner").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = {"prefill": [32, 128, 512], "chunks": [(1024, 256)], "decode": [(1, 512), (4, 512), (16, 512)],
        "mixed": [(8, 128)], "decode_steps": 4}


def partner(threads: int, model: str | None) -> None:
    """Decode 8 streams at context 512 until killed (the busy neighbour)."""
    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore
    from splitserve.models.loader import load_model
    from splitserve.sampling import SamplingParams

    torch.set_num_threads(threads)
    loaded = load_model(model)
    core = EngineCore(EngineConfig(model=model, num_threads=threads,
                                   cache=CacheConfig(kv_cache_memory=8000 * loaded.config.kv_bytes_per_token),
                                   scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024)), loaded)
    vocab = core.model_config.vocab_size
    prompt = [min(100, vocab // 2) + (i * 7919) % (vocab // 2) for i in range(512)]
    n = 0
    print("ready", flush=True)
    while True:
        while len(core.requests) < 8:
            core.add_request(f"p{n}", prompt, SamplingParams(max_tokens=256, ignore_eos=True))
            n += 1
        core.step()


def timed_pass(core, repeats: int, log, seed: int) -> list[dict]:
    import random

    from splitserve.control.profile import StepTimer

    timer = StepTimer(core, repeats, log)
    timer.rng = random.Random(seed)  # fresh prompts each pass: the last pass's are in the prefix cache
    timer.measure_prefill(GRID["prefill"][0])  # warm-up
    timer.samples.clear()
    for n in GRID["prefill"]:
        timer.measure_prefill(n)
    for cached, chunk in GRID["chunks"]:
        timer.measure_chunk(cached, chunk)
    for batch, context in GRID["decode"]:
        timer.measure_decode(batch, context, GRID["decode_steps"])
    for batch, n in GRID["mixed"]:
        timer.measure_decode(batch, 64, 0, new_prompt=n)
    return timer.samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2,
                        help="busy passes, each between two lone ones (alone, busy, alone, busy, alone, ...)")
    parser.add_argument("--partner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.partner:  # pinned by the parent, on the cores it left free
        partner(args.threads, args.model)
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * args.threads:
        raise SystemExit(f"needs {2 * args.threads} cores, this process may use {len(cores)}")
    os.sched_setaffinity(0, cores[:args.threads])  # before torch loads its thread pool
    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore
    from splitserve.models.loader import load_model

    torch.set_num_threads(args.threads)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    loaded = load_model(args.model)
    core = EngineCore(EngineConfig(model=args.model, num_threads=args.threads,
                                   cache=CacheConfig(kv_cache_memory=16400 * loaded.config.kv_bytes_per_token,
                                                     enable_prefix_caching=True),
                                   scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=1400)), loaded)
    started = time.time()
    load = [os.getloadavg()[0]]
    neighbour = cores[args.threads:2 * args.threads]
    seed = 1
    log("alone")
    passes = [("alone", timed_pass(core, args.repeats, log, seed))]
    for round_ in range(args.rounds):
        proc = subprocess.Popen([sys.executable, __file__, "--partner", "--threads", str(args.threads)]
                                + (["--model", args.model] if args.model else []), stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, neighbour))
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            log(f"beside a busy engine (round {round_ + 1})")
            seed += 1
            passes.append(("busy", timed_pass(core, args.repeats, log, seed)))
        finally:
            proc.kill()
            proc.wait()
        log("alone again")
        seed += 1
        passes.append(("alone", timed_pass(core, args.repeats, log, seed)))
    load.append(os.getloadavg()[0])
    rows = []
    for steps in zip(*(p for _, p in passes)):
        shape = (steps[0]["prefill_tokens"], steps[0]["decode_seqs"])
        if any((s["prefill_tokens"], s["decode_seqs"]) != shape for s in steps):
            raise SystemExit(f"passes timed different steps ({steps[0]['kind']}): a prefix-cache hit; not comparable")
        best = [min(s["seconds"]) for s in steps]
        # each busy pass against the mean of the lone passes either side of it: a drift of the
        # machine over the minutes of the run (seen: 25-50% on a shared VM) cancels to first order
        ratios = [best[i] / ((best[i - 1] + best[i + 1]) / 2) for i in range(1, len(best), 2)]
        alone = best[0::2]
        rows.append({"kind": steps[0]["kind"], "prefill_tokens": shape[0], "decode_seqs": shape[1],
                     "decode_kv_tokens": steps[0]["decode_kv_tokens"], "alone_s": alone, "busy_s": best[1::2],
                     "slowdown_per_round": ratios, "slowdown": statistics.median(ratios),
                     "alone_spread": max(alone) / min(alone)})
        log(f"  {steps[0]['kind']:8} P={shape[0]:5d} D={shape[1]:3d}  alone "
            + " / ".join(f"{a * 1e3:.1f}" for a in alone) + " ms, busy "
            + " / ".join(f"{b * 1e3:.1f}" for b in best[1::2]) + " ms  x"
            + " x".join(f"{r:.2f}" for r in ratios) + f"  (lone passes spread x{rows[-1]['alone_spread']:.2f})")
    factor = statistics.median(r["slowdown"] for r in rows)
    drift = statistics.median(r["alone_spread"] for r in rows)
    doc = {"threads": args.threads, "factor": factor, "lone_spread_median": drift, "rounds": args.rounds,
           "started_unix": started, "load_average": load,
           "neighbour": "one engine decoding 8 streams at context 512 on the other core(s)", "steps": rows}
    print(json.dumps({"threads": args.threads, "factor": round(factor, 3), "lone_spread_median": round(drift, 3)}))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
