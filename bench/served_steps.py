"""Issue 28: a fresh prompt's step in an engine that `serve` runs, against the same step in the
profile's own in-process EngineCore, on one box in one run.

A trial's prompt steps under 128 tokens run 1.21-1.40x the profile's step model (sessions 15, 16
and 29, two CPUs), and the engine thread's own CPU time on them is 1.12-1.20x the model: the work
is longer, not only waiting for a core. The profile times prompts in its own process (public
EngineCore calls); a trial's engine is a separate process fed over its socket, with a frontend and
a client beside it. This times both with nothing else going on: one prompt at a time, fresh random
token ids (no prefix-cache hit), answers of one token, so each request is exactly one step. The
in-process step is timed as `splitserve profile` times it (wall around EngineCore.step, and the
thread's CPU time); the served step is the engine's own record of that step (GET /admin/steps:
seconds and cpu_seconds, as a trial reads them). The two alternate request by request, so drift
of the host reads on both alike.

    python bench/served_steps.py [--sizes 32,64,96,128,256] [--repeats 7] [--churn N] [--json out.json]
    python bench/served_steps.py --disagg | --queue [--sizes ...] [--repeats N] [--json out.json]
    python bench/served_steps.py --traffic SECONDS --profile PROFILE.json [--instances N] [--threads T]
                                 [--idle-servers K] [--text] [--json out.json]

--text (session 34) sends windows of the bundled text as prompts, as a trial's are, in place of
random ids: whether what a prompt says changes its step (bench/content_steps.py times that alone).

--idle-servers K (session 33) keeps K more servers of 2 idle instances each running beside the one
under traffic, as a trial keeps its other arrangements' servers up while it probes one: whether
their short wakes (stats, health) stretch the served engine's prompt steps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as serve sets it for its engines

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 49152  # the bundled model's; prompts are random ids from 100 up, past its special tokens
sys.path.insert(0, str(ROOT))

from splitserve.trial.arrangements import launched  # noqa: E402
from splitserve.trial.engine_steps import step_counts, steps_since  # noqa: E402
from splitserve.trial.spec import Arrangement  # noqa: E402


@contextlib.contextmanager
def serving(*serve_args: str, threads: int = 1):
    """`splitserve serve` of the bundled model with instances of `threads` threads (1 unless told) and these
    arguments, ready, as a trial launches an arrangement (its log in a temporary folder and quoted if it
    fails to start; its process group stopped on exit). Yields the trial's Endpoint: base_url and the
    model id."""
    arr = Arrangement("served-steps", serve_args=["--threads-per-instance", str(threads), "--log-level", "warning",
                                                  *serve_args])
    with tempfile.TemporaryDirectory() as logs, launched(arr, None, Path(logs), 600.0) as endpoint:
        yield endpoint


def request(model: str, rng: random.Random, prompt_tokens: int, max_tokens: int, stream: bool = False,
            source=None) -> dict:
    """A completion of fresh random token ids (no prefix-cache hit), greedy, as long as asked; with a
    trial's PromptSource, a window of its text at a random place instead."""
    if source is None:
        prompt = [rng.randrange(100, VOCAB) for _ in range(prompt_tokens)]
    else:
        import numpy as np

        prompt = source.prompt(prompt_tokens, np.random.default_rng(rng.randrange(2**32)))
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}


def steps_of(base_url: str, before: dict[str, int] | None, role: str | None = None) -> list[dict]:
    """The steps the instances (those of `role`, if given) reported since `before` (the trial's
    step_counts), one dict per step, waiting as the trial does for the last ones to arrive."""
    doc = steps_since(base_url, before)
    if doc is None:
        raise RuntimeError(f"{base_url} sent no steps (GET /admin/steps)")
    return [dict(zip(doc["fields"], row)) for inst in doc["instances"].values()
            if role in (None, inst["role"]) for row in inst["samples"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,64,96,128,256")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--churn", type=int, default=0,
                    help="first send this many requests, 8 at a time, of random lengths (16-700 prompt tokens, 1-48 "
                         "answer tokens), as a trial's engine has served many before a step is timed")
    ap.add_argument("--disagg", action="store_true",
                    help="serve 1 prefill + 1 decode instead, answers of 8 tokens, and time the prefill instance's "
                         "prompt steps two ways: one request at a time (sequential), and each request sent when the "
                         "one before has its first token (chained), so the step runs while the previous prompt's KV "
                         "is handed over and decoded")
    ap.add_argument("--queue", action="store_true",
                    help="serve one instance that runs one request at a time (--max-num-seqs 1) and time its prompt "
                         "steps two ways: one request at a time, and 8 sent at once, so the steps run back to back "
                         "from a queue")
    ap.add_argument("--traffic", type=float, default=0.0, metavar="SECONDS",
                    help="serve one instance (chunked, 256-token budget) to 8 streaming clients of chats (16-160-token "
                         "prompts, 48-96-token answers) for this long, and read every step it ran against --profile's "
                         "step model for one lone instance, as bench/step_split.py reads a trial's")
    ap.add_argument("--profile", default=None, help="the profile.json --traffic reads its steps against")
    ap.add_argument("--instances", type=int, default=1,
                    help="--traffic: serve this many 1-thread instances (8 clients each); with more than one, the "
                         "steps are read against the profile's steps beside busy engines, as the planner reads them")
    ap.add_argument("--threads", type=int, default=1,
                    help="--traffic: threads per served instance (read against the profile's model for that many)")
    ap.add_argument("--text", action="store_true",
                    help="--traffic: prompts are windows of the bundled text (as a trial sends), not random ids")
    ap.add_argument("--idle-servers", type=int, default=0,
                    help="--traffic: keep this many more servers (2 instances each) running idle beside it")
    args = ap.parse_args()
    if args.traffic:
        return traffic(args)
    if args.disagg:
        return disagg(args)
    if args.queue:
        return queued(args)
    sizes = [int(x) for x in args.sizes.split(",")]
    budget = max(sizes) + 64

    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.control.profile import StepTimer
    from splitserve.engine.core import EngineCore
    from splitserve.models.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model(None)
    core = EngineCore(EngineConfig(model=None, num_threads=1,
                                   cache=CacheConfig(kv_cache_memory=64 * 2**20, enable_prefix_caching=True),
                                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget)), loaded)
    timer = StepTimer(core, 1, lambda *_: None, seed=7)
    rng = random.Random(11)
    inproc: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    try:
        with serving("--instances", "1", "--max-num-batched-tokens", str(budget)) as ep, \
                httpx.Client(base_url=ep.base_url, timeout=300) as client:

            def served(n: int, max_tokens: int = 1) -> None:
                client.post("/v1/completions", json=request(ep.model, rng, n, max_tokens)).raise_for_status()

            def in_process(n: int) -> tuple[float, float]:
                cpu0 = time.thread_time()
                seconds, _ = timer.prefill([], n)
                return seconds, time.thread_time() - cpu0

            for n in sizes:  # warm both paths for every shape
                served(n)
                in_process(n)
            if args.churn:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(lambda _: served(rng.randint(16, 700), rng.randint(1, 48)), range(args.churn)))
            before = step_counts(ep.base_url)
            order = []
            for _ in range(args.repeats):
                for n in sizes:
                    served(n)
                    order.append(n)
                    inproc[n].append(in_process(n))
                    time.sleep(0.05)
            samples = steps_of(ep.base_url, before)
    finally:
        core.close()
    prompt_steps = [s for s in samples if s["prefill_tokens"] > 0]
    if [s["prefill_tokens"] for s in prompt_steps] != order:
        raise RuntimeError(f"the served engine's prompt steps {[s['prefill_tokens'] for s in prompt_steps]} "
                           f"are not the requests sent {order}: it batched or split them")
    out = {"sizes": sizes, "repeats": args.repeats, "churn": args.churn, "rows": []}
    print(f"{'tokens':>6} | in-process ms: best / median (cpu median) | served ms: best / median (cpu median) "
          f"| served / in-process, median wall, median cpu")
    for n in sizes:
        ip = inproc[n]
        sv = [(s["seconds"], s["cpu_seconds"]) for s in prompt_steps if s["prefill_tokens"] == n]
        row = {"tokens": n,
               "in_process_s": [round(w, 6) for w, _ in ip], "in_process_cpu_s": [round(c, 6) for _, c in ip],
               "served_s": [w for w, _ in sv], "served_cpu_s": [c for _, c in sv]}
        med = statistics.median
        wi, ci = med(w for w, _ in ip), med(c for _, c in ip)
        ws, cs = med(w for w, _ in sv), med(c for _, c in sv)
        row["ratio_wall"], row["ratio_cpu"] = ws / wi, (cs / ci if ci > 0 else None)
        out["rows"].append(row)
        print(f"{n:>6} | {min(w for w, _ in ip) * 1e3:7.1f} / {wi * 1e3:7.1f} ({ci * 1e3:6.1f}) "
              f"| {min(w for w, _ in sv) * 1e3:7.1f} / {ws * 1e3:7.1f} ({cs * 1e3:6.1f}) "
              f"| {row['ratio_wall']:.2f}x wall, {row['ratio_cpu'] or float('nan'):.2f}x cpu")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def traffic(args) -> int:
    import threading

    from splitserve.control.profile_file import load_profile
    from splitserve.control.stepmodel import StepShape

    sys.path.insert(0, str(ROOT / "bench"))
    from step_split import labels, ratio_row

    if not args.profile:
        raise SystemExit("--traffic needs --profile PROFILE.json")
    model = load_profile(args.profile).instance_models([args.threads] * args.instances)[0][0]
    source = None
    if args.text:
        from splitserve.models.loader import load_tokenizer
        from splitserve.trial.workload import PromptSource

        tokenizer, _ = load_tokenizer(None)
        source = PromptSource(lambda text: tokenizer.encode(text, add_special_tokens=False))
    with contextlib.ExitStack() as idle, serving("--instances", str(args.instances), "--max-num-batched-tokens",
                                                  "256", "--prefill-policy", "chunked", threads=args.threads) as ep:
        for _ in range(args.idle_servers):
            idle.enter_context(serving("--instances", "2"))
        before = step_counts(ep.base_url)
        stop = time.monotonic() + args.traffic

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                body = request(ep.model, rng, max(16, min(160, int(rng.lognormvariate(3.69, 0.5)))),
                               rng.randint(48, 96), stream=True)
                with httpx.stream("POST", f"{ep.base_url}/v1/completions", json=body, timeout=300) as resp:
                    for _ in resp.iter_lines():
                        pass

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8 * args.instances)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        samples = steps_of(ep.base_url, before)
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for x in samples:
        shape = StepShape(int(x["prefill_tokens"]), float(x["prefill_attn_ktok2"]), int(x["decode_seqs"]),
                          int(x["decode_kv_tokens"]))
        tags = labels(shape.prefill_tokens, shape.prefill_attn_ktok2, shape.decode_seqs, x["loop_seconds"])
        kind = tags["kind"] if not shape.prefill_tokens else f"{tags['kind']} {tags['beside']} {tags['turn']}"
        groups.setdefault(kind, []).append((x["seconds"], model.predict(shape), x["cpu_seconds"]))
    out = {"mode": "traffic", "seconds": args.traffic, "instances": args.instances, "profile": args.profile,
           "threads": args.threads, "idle_servers": args.idle_servers, "text": args.text, "rows": []}
    for kind, values in sorted(groups.items()):
        row = {"kind": kind, **ratio_row(values)}
        out["rows"].append(row)
        print(f"  {kind:21} n={row['num_steps']:5d}  median {row['median']:.2f}  tw {row['time_weighted']:.2f}  "
              f"cpu/model tw {row['cpu_time_weighted']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def queued(args) -> int:
    from concurrent.futures import ThreadPoolExecutor

    sizes = [int(x) for x in args.sizes.split(",")]
    rng = random.Random(17)
    order: list[tuple[str, int]] = []
    with serving("--instances", "1", "--max-num-batched-tokens", str(max(sizes) + 64), "--max-num-seqs", "1") as ep, \
            httpx.Client(base_url=ep.base_url, timeout=300) as client, ThreadPoolExecutor(8) as pool:

        def one(n: int) -> None:
            client.post("/v1/completions", json=request(ep.model, rng, n, 1)).raise_for_status()

        for n in sizes:
            one(n)
        before = step_counts(ep.base_url)
        for _ in range(args.repeats):
            for n in sizes:
                for _ in range(3):
                    one(n)
                    order.append(("sequential", n))
                list(pool.map(one, [n] * 8))
                order += [("queued", n)] * 8
                time.sleep(0.2)
        samples = steps_of(ep.base_url, before)
    steps = [x for x in samples if x["prefill_tokens"] > 0]
    if [x["prefill_tokens"] for x in steps] != [n for _, n in order]:
        raise RuntimeError("the instance's prompt steps are not the requests sent one per step")
    out = {"sizes": sizes, "repeats": args.repeats, "mode": "queue", "rows": []}
    print(f"{'tokens':>6} | one at a time ms: median (cpu) | 8 queued ms: median (cpu), loop wait median | queued / one")
    med = statistics.median
    for n in sizes:
        seq = [x for (m, k), x in zip(order, steps) if k == n and m == "sequential"]
        # the first of each 8 may have waited for work; the rest ran straight on (loop_seconds > 0)
        q = [x for (m, k), x in zip(order, steps) if k == n and m == "queued" and x["loop_seconds"] > 0]
        ws, cs = med(x["seconds"] for x in seq), med(x["cpu_seconds"] for x in seq)
        wq, cq = med(x["seconds"] for x in q), med(x["cpu_seconds"] for x in q)
        out["rows"].append({"tokens": n, "sequential": [[x["seconds"], x["cpu_seconds"]] for x in seq],
                            "queued": [[x["seconds"], x["cpu_seconds"], x["loop_seconds"]] for x in q]})
        print(f"{n:>6} | {ws * 1e3:7.1f} ({cs * 1e3:6.1f}) | {wq * 1e3:7.1f} ({cq * 1e3:6.1f}) "
              f"| {wq / ws:.2f}x wall, {cq / cs:.2f}x cpu (n={len(seq)}, {len(q)})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def disagg(args) -> int:
    import threading

    sizes = [int(x) for x in args.sizes.split(",")]
    rng = random.Random(13)
    order: list[tuple[str, int]] = []
    with serving("--prefill", "1", "--decode", "1", "--kv-transport", "shm",
                 "--max-num-batched-tokens", str(max(sizes) + 64)) as ep, \
            httpx.Client(base_url=ep.base_url, timeout=300) as client:

        def sequential(n: int) -> None:
            client.post("/v1/completions", json=request(ep.model, rng, n, 8)).raise_for_status()

        def drain(resp: httpx.Response, lines) -> None:
            try:
                for _ in lines:
                    pass
            finally:
                resp.close()

        def chained(ns: list[int]) -> None:
            threads = []
            for n in ns:
                resp = client.send(client.build_request("POST", "/v1/completions",
                                                        json=request(ep.model, rng, n, 8, stream=True)), stream=True)
                lines = resp.iter_lines()
                for line in lines:  # the first token: the prompt's step is done, its KV goes over now
                    if line.startswith("data:"):
                        break
                t = threading.Thread(target=drain, args=(resp, lines))
                t.start()
                threads.append(t)
            for t in threads:
                t.join()

        for n in sizes:
            sequential(n)
        before = step_counts(ep.base_url)
        for _ in range(args.repeats):
            for n in sizes:
                sequential(n)
                order.append(("sequential", n))
            chained(sizes + sizes)  # two rounds, so every size has a predecessor in flight
            order += [("chained", n) for n in sizes + sizes]
            time.sleep(0.5)
        samples = steps_of(ep.base_url, before, role="prefill")
    steps = [x for x in samples if x["prefill_tokens"] > 0]
    if [x["prefill_tokens"] for x in steps] != [n for _, n in order]:
        raise RuntimeError("the prefill instance's prompt steps are not the requests sent one per step")
    out = {"sizes": sizes, "repeats": args.repeats, "mode": "disagg", "rows": []}
    print(f"{'tokens':>6} | sequential ms: median (cpu) | chained ms: median (cpu) | chained / sequential")
    for n in sizes:
        seq = [x for (m, k), x in zip(order, steps) if k == n and m == "sequential"]
        # the first of each chain has nothing in flight before it: leave it out
        chain = [x for j, ((m, k), x) in enumerate(zip(order, steps))
                 if k == n and m == "chained" and order[j - 1][0] == "chained"]
        med = statistics.median
        ws, cs = med(x["seconds"] for x in seq), med(x["cpu_seconds"] for x in seq)
        wc, cc = med(x["seconds"] for x in chain), med(x["cpu_seconds"] for x in chain)
        out["rows"].append({"tokens": n, "sequential_s": [x["seconds"] for x in seq],
                            "sequential_cpu_s": [x["cpu_seconds"] for x in seq],
                            "chained_s": [x["seconds"] for x in chain], "chained_cpu_s": [x["cpu_seconds"] for x in chain]})
        print(f"{n:>6} | {ws * 1e3:7.1f} ({cs * 1e3:6.1f}) | {wc * 1e3:7.1f} ({cc * 1e3:6.1f}) "
              f"| {wc / ws:.2f}x wall, {cc / cs:.2f}x cpu (n={len(seq)}, {len(chain)})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
