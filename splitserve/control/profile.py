"""`splitserve profile [--model M] [--threads 1,2] [--quick] --out profile.json`: time one instance.

Per thread count, one in-process EngineCore (public calls only: add_request, step,
abort_request) runs steps whose contents we control, each timed `repeats` times:
  prefill   one prompt of n tokens, whole (the step that yields its first token);
  chunk     the last c tokens of a prompt whose first k tokens sit in the prefix cache: the step
            a chunked prefill runs at offset k with budget c (RequestOutput.num_cached_tokens
            says what was cached, so the sample's shape is read back, not assumed);
  decode    B running requests at context L (one prompt shared through the prefix cache, so
            setting up B x L tokens costs one prefill of L), several steps each;
  mixed     B decodes plus a new prompt's whole prefill in one step (budget >= n + B).
Then, for a thread count of which the box holds more than one instance (2 x threads <= cores),
the same grid once more while cores / threads - 1 other engine processes run steps without pause
(control/profile_neighbour.py: 8 requests in flight, fresh prompts in 256-token chunks, short
answers, as a trial's busy instance): the `contended` steps, which the planner uses for
arrangements of several instances on one host (a trial's prompt steps ran 9-35% longer than the
lone profile said). The processes are not pinned, as a trial's engines are not. `--contended off`
skips it; `--contended served` makes each neighbour an instance served over HTTP to a streaming
client (its frontend's and client's work per request and per token on the host too, as in a trial). Also KV transfer per transport (control/kv_profile.py), the model load and engine start
times, the machine, and (`--host-work`, on unless --quick) the serving stack's CPU outside engine
steps per request and per streamed token (control/host_work.py), which the simulator takes from
the engines' cores. Then (`--served`, on unless --quick), per thread count T that divides the cores, cores / T
instances served by `serve` under 60 s of streaming chat traffic (control/served_pass.py): their
steps, refitted with the lone or contended model as prior, are what the planner uses for that
arrangement (a trial's prompt steps ran 1.2-1.4x the in-process ones, session 38). `--served auto`
(the default) runs them unless --quick: on the trials run right after two such profiles they
lifted the planner's check from 5 and 7 of 12 to 9 and 10 (session 40). Then the step
model (control/stepmodel.py) is fitted and its error on the samples printed. Other processes' load distorts every figure: the load average at
start and end is recorded next to them, every repeat is kept, and the fit uses each step's
fastest repeat (load only ever adds time); the steps beside busy engines their median repeat (there
the spread is the neighbour's phase, the contention itself). The lone pass also times one fresh
128-token prompt before every grid item (`drift`): how far the host's speed moved while it
measured, which the planner turns into a capacity at both ends of that range.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import time

from splitserve.control.profile_file import CONTENDED_FIT_STATISTIC, FORMAT, ProfileError, parse_profile, step_samples
from splitserve.control.stepmodel import StepShape, fit_step_model, prefill_attn_ktok2

# the step the lone pass times before every grid item (about 0.3 s on one Zen 4 core): on a VM
# whose speed moves minute to minute (session 34: this step 340-524 ms within four minutes, idle),
# the readings say how far, and the planner gives a capacity at both ends (profile_file.speed_band)
WATCH_PROMPT = 128
FULL = {"prefill": [32, 128, 512, 1024], "chunks": [(512, 256), (1024, 256), (1024, 512)],
        "decode_batch": [1, 4, 16], "decode_context": [64, 512, 1024], "mixed": [(8, 128), (8, 512)],
        "decode_steps": 4, "transfer_tokens": [256, 1024, 2048], "repeats": 3,
        "watch": WATCH_PROMPT}
QUICK = {"prefill": [16, 48], "chunks": [(32, 16)], "decode_batch": [1, 4], "decode_context": [16, 48],
         "mixed": [(2, 16)], "decode_steps": 2, "transfer_tokens": [16, 64], "repeats": 2,
         "watch": 16}
SERVED_SECONDS = 60.0  # each served pass's traffic (control/served_pass.py)
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
             "asimd", "sve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts to profile (default 1,2)")
    parser.add_argument("--quick", action="store_true", help="a tiny grid for tests and smoke runs (seconds)")
    parser.add_argument("--repeats", type=int, default=None, help="times each step is measured (default 3; quick 2)")
    parser.add_argument("--transports", default="shm,tcp", help="KV transports to time (default shm,tcp)")
    parser.add_argument("--omp-wait-policy", choices=("passive", "active"), default="passive",
                        help="OpenMP threads between parallel regions: sleep (passive, default: how `serve` runs every "
                             "engine whose threads fill the cores, so every multi-thread arrangement a plan proposes) "
                             "or spin (active). An OMP_WAIT_POLICY already in the environment wins")
    parser.add_argument("--contended", choices=("auto", "served", "off"), default="auto",
                        help="also time each thread count beside busy engines on the other cores (auto: where "
                             "2 x threads <= cores; the planner uses those steps for arrangements of several "
                             "instances); served: the same, each busy engine served over HTTP to a streaming "
                             "client, so its frontend's and client's work share the host too; off: lone steps only")
    parser.add_argument("--host-work", choices=("auto", "on", "off"), default="auto",
                        help="also measure the serving stack's CPU outside engine steps, per request and per "
                             "streamed token (control/host_work.py: one served instance, about 30 s; the planner "
                             "takes those cores from the engines). auto: on, except with --quick")
    parser.add_argument("--served", choices=("auto", "on", "off"), default="auto",
                        help="also time, per thread count T that divides the cores, the steps of cores / T instances "
                             "that `serve` runs under 60 s of streaming chat traffic (control/served_pass.py: the "
                             "frontend and a client on the same cores, as in a trial); the planner then uses them for "
                             "that arrangement of instances. auto: on, except with --quick (on a 2-vCPU VM the "
                             "check against a four-spec round run right after two profiles rose from 5 and 7 of 12 "
                             "to 9 and 10 with them: docs/benchmarks.md, Planner, session 40)")
    parser.add_argument("--out", required=True, help="where to write profile.json")


def parse_threads(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ProfileError(f"--threads: comma-separated whole numbers like 1,2; got {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise ProfileError(f"--threads: every thread count must be >= 1, got {text!r}")
    if max(counts) > (os.cpu_count() or 1):
        raise ProfileError(f"--threads: {max(counts)} threads exceed this machine's {os.cpu_count()} cores")
    return sorted(set(counts))


def set_omp_wait_policy(policy: str) -> str:
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads it: set it before that, as `serve` does for
    its engines (entrypoints/launch.py). Returns the policy the runtime reads ("default" when unset).
    A 2-thread step with sleeping threads pays a wake-up per parallel region: on the AVX2 VM a
    one-request decode step took 32 ms instead of 17 ms (docs/benchmarks.md, "Planner")."""
    if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    return os.environ.get("OMP_WAIT_POLICY", "default").lower()


def machine_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    import torch

    return {"cpu_model": model, "flags": [f for f in CPU_FLAGS if f in flags], "num_cores": os.cpu_count(),
            "platform": platform.platform(), "torch": torch.__version__,
            "load_average_start": os.getloadavg()[0], "niceness": os.nice(0),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default").lower(),
            "speed_units_per_s": machine_speed()}


def machine_speed(readings: int = 5) -> float:
    """The trial's host-speed benchmark (trial/hostwatch.speed_benchmark: a fixed single-thread loop,
    wall time, so steal and clock changes show), median of a few readings. A trial records the same
    figure before each probe, so a prediction can be read at the speed the trial's box ran at
    (control/compare.py): two boxes of one kind ran it 1,660-1,740 and 2,110-2,170 units/s."""
    from splitserve.trial.hostwatch import speed_benchmark

    return round(statistics.median(speed_benchmark() for _ in range(readings)), 1)


class StepTimer:
    """Drives one EngineCore and records (shape, seconds) per controlled step."""

    def __init__(self, core, repeats: int, log, seed: int = 0):
        self.core, self.repeats, self.log = core, repeats, log
        self.vocab = core.model_config.vocab_size
        self.rng = random.Random(seed)  # another seed, other prompts: no prefix-cache hit on an earlier pass's
        self.samples: list[dict] = []
        self.drift: list[list[float]] = []  # [seconds since the pass began, one watched step's seconds]
        self._began, self.began_unix = time.perf_counter(), time.time()
        self._next = 0

    def prompt(self, n: int) -> list[int]:
        low = min(100, self.vocab // 2)  # past the special tokens of a real vocabulary
        return [self.rng.randrange(low, self.vocab) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        from splitserve.sampling import SamplingParams

        request_id = f"profile-{self._next}"
        self._next += 1
        self.core.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return request_id

    def _step(self):
        start = time.perf_counter()
        outputs = self.core.step()
        return time.perf_counter() - start, outputs

    def _record(self, kind: str, shape: StepShape, seconds: list[float]) -> None:
        self.samples.append({"kind": kind, "prefill_tokens": shape.prefill_tokens,
                             "prefill_attn_ktok2": round(shape.prefill_attn_ktok2, 3),
                             "decode_seqs": shape.decode_seqs, "decode_kv_tokens": shape.decode_kv_tokens,
                             "seconds": [round(s, 6) for s in seconds]})
        self.log(f"  {kind:8} P={shape.prefill_tokens:5d} D={shape.decode_seqs:3d} KV={shape.decode_kv_tokens:6d}"
                 f"  {min(seconds) * 1e3:8.1f} .. {max(seconds) * 1e3:8.1f} ms")

    def prefill(self, prefix: list[int], n: int) -> tuple[float, StepShape]:
        """One prompt (prefix + n fresh tokens) alone; returns the timed step and its shape."""
        prompt = prefix + self.prompt(n)
        self._add(prompt, 1)
        seconds, outputs = self._step()
        if len(outputs) != 1 or not outputs[0].finished:
            raise RuntimeError("profile: a lone prompt did not prefill in one step at a budget above its length; "
                               "the engine's scheduler no longer behaves as profile.py assumes")
        cached = outputs[0].num_cached_tokens
        return seconds, StepShape(len(prompt) - cached, prefill_attn_ktok2(cached, len(prompt) - cached))

    def watch(self, n: int) -> None:
        """One fresh lone prompt of n tokens, timed and kept apart from the samples: the same step
        again and again through the pass, so the pass records how the host's speed moved while it
        measured (the planner's speed band, profile_file.speed_band)."""
        seconds, _ = self.prefill([], n)
        self.drift.append([round(time.perf_counter() - self._began, 3), round(seconds, 6)])

    def measure_prefill(self, n: int) -> None:
        runs = [self.prefill([], n) for _ in range(self.repeats)]
        self._record("prefill", runs[0][1], [s for s, _ in runs])

    def measure_chunk(self, cached: int, chunk: int) -> None:
        prefix = self.prompt(cached)
        self._add(prefix, 1)  # puts the prefix in the prefix cache
        while self.core.has_unfinished_requests():
            self.core.step()
        runs = [self.prefill(prefix, chunk) for _ in range(self.repeats)]
        shapes = {shape for _, shape in runs}
        if len(shapes) != 1:
            raise RuntimeError(f"chunk samples at offset {cached} saw different cache hits: {shapes}")
        self._record("chunk", runs[0][1], [s for s, _ in runs])

    def measure_decode(self, batch: int, context: int, steps: int, new_prompt: int = 0) -> None:
        """`batch` requests decoding at `context`; with new_prompt, one step also prefills a fresh prompt."""
        shared = self.prompt(context)
        max_tokens = steps + self.repeats + 8  # outlives the measured steps; a few go by during set-up
        ids = [self._add(shared, max_tokens)]
        lengths = {}
        while len(lengths) < 1:
            for out in self._step()[1]:
                lengths[out.request_id] = context + len(out.new_token_ids)
        ids += [self._add(shared, max_tokens) for _ in range(batch - 1)]
        while len(lengths) < batch:  # the others prefill their uncached tail while the first decodes
            for out in self._step()[1]:
                lengths[out.request_id] = lengths.get(out.request_id, context) + len(out.new_token_ids)
        seconds, kv = [], []
        for _ in range(steps if not new_prompt else self.repeats):
            fresh = None
            if new_prompt:
                fresh = self._add(self.prompt(new_prompt), 1)
            kv.append(sum(lengths[r] for r in ids))  # a decode at length L attends to L tokens
            step_s, outputs = self._step()
            seconds.append(step_s)
            got = {out.request_id for out in outputs}
            if not set(ids) <= got or (fresh is not None and fresh not in got):
                raise RuntimeError("profile: a step did not advance every running request (and the new prompt); "
                                   "the engine's scheduler no longer behaves as profile.py assumes")
            for r in ids:
                lengths[r] += 1
        for r in ids:
            self.core.abort_request(r)
        shape = StepShape(new_prompt, prefill_attn_ktok2(0, new_prompt), batch, round(sum(kv) / len(kv)))
        self._record("mixed" if new_prompt else "decode", shape, seconds)


def run_grid(timer: StepTimer, grid: dict, watch: int = 0) -> list[dict]:
    """Every step of the grid, timed; with `watch`, a lone prompt of that many tokens is timed before
    each item and once at the end (timer.drift)."""
    def watched():
        if watch:
            timer.watch(watch)

    timer.measure_prefill(grid["prefill"][0])  # warm-up: first steps pay for lazy initialization
    timer.samples.clear()
    for n in grid["prefill"]:
        watched()
        timer.measure_prefill(n)
    for cached, chunk in grid["chunks"]:
        watched()
        timer.measure_chunk(cached, chunk)
    for context in grid["decode_context"]:
        for batch in grid["decode_batch"]:
            watched()
            timer.measure_decode(batch, context, grid["decode_steps"])
    for batch, n in grid["mixed"]:
        watched()
        timer.measure_decode(batch, min(grid["decode_context"]), 0, new_prompt=n)
    watched()
    return timer.samples


def num_neighbours(threads: int, cores: int, mode: str) -> int:
    """Engines of `threads` threads that fill the rest of the cores beside the timed one."""
    return max(cores // threads - 1, 0) if mode in ("auto", "served") else 0


@contextlib.contextmanager
def busy_neighbours(count: int, threads: int, model: str | None, prompts: list[int], served: bool = False):
    """`count` engine processes running steps without pause (control/profile_neighbour.py; served:
    each behind its own HTTP server and streaming client) for the length of the block; each is
    stopped at its end with everything it started (its own process group)."""
    from splitserve.trial.arrangements import stop_process_group

    cmd = [sys.executable, "-m", "splitserve.control.profile_neighbour", "--threads", str(threads),
           "--prompts", ",".join(map(str, prompts))] + (["--model", model] if model else []) \
        + (["--served"] if served else [])
    procs = []
    try:
        for i in range(count):
            procs.append(subprocess.Popen(cmd + ["--seed", str(i)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                stop_process_group(proc, grace_s=2.0, whole_group=True)
                raise RuntimeError(f"profile: a busy neighbour engine did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(3.0 if served else 1.0)  # past its first steps' lazy initialization
        yield
    finally:
        for proc in procs:
            stop_process_group(proc, grace_s=10.0, whole_group=True)



def contended_entry(lone: list[dict], busy: list[dict], count: int, threads: int, log, served: bool = False) -> dict:
    report = fit_step_model(*step_samples(busy, "contended.samples", CONTENDED_FIT_STATISTIC))  # as read back
    by_kind = {}  # the same step (kind and shape) alone and beside the neighbours, fastest repeats
    for a, b in zip(lone, busy):
        if (a["kind"], a["prefill_tokens"], a["decode_seqs"]) == (b["kind"], b["prefill_tokens"], b["decode_seqs"]):
            by_kind.setdefault(a["kind"], []).append(min(b["seconds"]) / min(a["seconds"]))
    slowdown = {kind: round(statistics.median(rs), 3) for kind, rs in by_kind.items()}
    log(f"  beside busy engines: fit median |error| {report.median_abs_rel_error:.1%}; slowdown (fastest repeats, "
        f"median by kind) " + ", ".join(f"{k} x{v:.2f}" for k, v in slowdown.items()))
    if any(v < 0.95 for v in slowdown.values()):  # a neighbour never speeds a step up: the lone pass was hit
        log("  WARNING: steps ran faster beside busy engines than alone: other processes disturbed the lone pass; "
            "profile again on a quieter box")
    return {"samples": busy, "step_model": report.model.to_dict(),
            "fit": {"statistic": "median repeat", "median_abs_rel_error": report.median_abs_rel_error,
                    "max_abs_rel_error": report.max_abs_rel_error},
            "slowdown_median_by_kind": slowdown,
            "lone_pass_disturbed": any(v < 0.95 for v in slowdown.values()),
            "neighbours": {"count": count, "threads_each": threads, "pinned": False, "served": served,
                           "work": "8 requests in flight: fresh prompts in 256-token chunks, 16-48-token answers"
                                   + (", each served over HTTP to a streaming client" if served else "")}}


def profile_threads(loaded, model: str | None, threads: int, grid: dict, repeats: int, log,
                    neighbours: int = 0, served: bool = False) -> dict:
    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore

    torch.set_num_threads(threads)
    longest = max(grid["prefill"] + [c + n for c, n in grid["chunks"]] + grid["decode_context"])
    budget = max(longest, max(b + n for b, n in grid["mixed"])) + 64
    max_batch = max(grid["decode_batch"] + [b for b, _ in grid["mixed"]])
    kv_tokens = (max_batch + 2) * (max(grid["decode_context"]) + 64) + 4 * longest
    memory = kv_tokens * loaded.config.kv_bytes_per_token
    start = time.perf_counter()
    core = EngineCore(EngineConfig(model=model, num_threads=threads,
                                   cache=CacheConfig(kv_cache_memory=memory, enable_prefix_caching=True),
                                   scheduler=SchedulerConfig(max_num_seqs=max_batch + 2, max_num_batched_tokens=budget)),
                      loaded)
    engine_s = time.perf_counter() - start
    contended = None
    try:
        timer = StepTimer(core, repeats, log)
        samples = run_grid(timer, grid, watch=grid["watch"])
        drift = {"prompt_tokens": grid["watch"], "began_unix": round(timer.began_unix, 3), "readings": timer.drift}
        log(f"  watched {grid['watch']}-token prompt over {timer.drift[-1][0]:.0f} s: "
            f"{min(r[1] for r in timer.drift) * 1e3:.1f} .. {max(r[1] for r in timer.drift) * 1e3:.1f} ms "
            f"({len(timer.drift)} readings)")
        report = fit_step_model(*step_samples(samples))
        log(f"  fit: median |error| {report.median_abs_rel_error:.1%}, max {report.max_abs_rel_error:.1%}")
        if neighbours:
            log(f"threads={threads} beside {neighbours} busy engine(s) of {threads} thread(s)"
                + (", each served over HTTP to a streaming client" if served else ""))
            with busy_neighbours(neighbours, threads, model, grid["prefill"], served):
                busy = run_grid(StepTimer(core, repeats, log, seed=1), grid)
            contended = contended_entry(samples, busy, neighbours, threads, log, served)
    finally:
        core.close()
    entry = {"samples": samples, "step_model": report.model.to_dict(), "engine_start_s": engine_s, "drift": drift,
             "fit": {"statistic": "fastest repeat", "median_abs_rel_error": report.median_abs_rel_error,
                     "max_abs_rel_error": report.max_abs_rel_error}}
    if contended is not None:
        entry["contended"] = contended
    return entry


def measure(model: str | None, threads: list[int], quick: bool, repeats: int | None,
            transports: list[str], log=print, contended: str = "auto", host_work: str = "auto",
            served: str = "auto") -> dict:
    import torch

    from splitserve.control.kv_profile import measure_kv_transfer
    from splitserve.models.gguf_blocks import GGUFBlocks
    from splitserve.models.loader import load_model

    grid = QUICK if quick else FULL
    repeats = repeats or grid["repeats"]
    machine = machine_info()
    start = time.perf_counter()
    loaded = load_model(model)
    load_s = time.perf_counter() - start
    config = loaded.config
    # the step times depend on it: the GGUF kernels' decode steps are 2-3x faster than fp32's
    weight_format = "gguf" if any(isinstance(w, GGUFBlocks) for w in loaded.weights.values()) else "fp32"
    doc = {"format": FORMAT, "created_unix": time.time(), "quick": quick, "repeats": repeats,
           "model": {"name": loaded.name, "weight_format": weight_format,
                     "kv_bytes_per_token": config.kv_bytes_per_token, "block_size": 16,
                     "max_model_len": config.max_position_embeddings, "num_layers": config.num_layers},
           "machine": machine, "threads": {}, "startup_s": {"load_model": load_s, "engine": {}}}
    for t in threads:
        log(f"threads={t}")
        doc["threads"][str(t)] = profile_threads(loaded, model, t, grid, repeats, log,
                                                 num_neighbours(t, os.cpu_count() or 1, contended),
                                                 contended == "served")
        doc["startup_s"]["engine"][str(t)] = doc["threads"][str(t)].pop("engine_start_s")
    torch.set_num_threads(1)
    log("KV transfer")
    doc["kv_transfer"] = measure_kv_transfer(config, 16, grid["transfer_tokens"], repeats, tuple(transports))
    for name, t in doc["kv_transfer"].items():
        log(f"  {name}: latency {t['latency_s'] * 1e3:.2f} ms, {t['gb_per_s']:.2f} GB/s")
    if runs_pass(host_work, quick):
        from splitserve.control.host_work import measure_host_work

        log("host work (the serving stack's CPU outside engine steps)")
        doc["host_work"] = measure_host_work(model, min(threads), log)
    if runs_pass(served, quick):
        served_passes(doc, model, threads, config.vocab_size, log, max_model_len=config.max_position_embeddings)
    machine["load_average_end"] = os.getloadavg()[0]
    machine["speed_units_per_s_end"] = machine_speed()
    parse_profile(doc)  # what we write must read back
    return doc


def runs_pass(mode: str, quick: bool) -> bool:
    """Whether a pass under `--host-work MODE` or `--served MODE` runs: auto runs it unless --quick
    (its half-minute to minute of served traffic per pass is more than a quick profile's whole grid)."""
    return mode == "on" or (mode == "auto" and not quick)


def served_passes(doc: dict, model: str | None, threads: list[int], vocab: int, log,
                  seconds: float = SERVED_SECONDS, max_model_len: int | None = None) -> None:
    """threads.T.served for each profiled thread count T that divides the cores: cores / T
    instances served under chat traffic (control/served_pass.py), their steps refitted with the
    lone model (one instance) or the contended one (several) as the prior."""
    from splitserve.control.served_pass import measure_served

    cores = os.cpu_count() or 1
    profiled = parse_profile(doc)  # the models the planner would give each arrangement without these steps
    for t in threads:
        if t > cores or cores % t:
            continue
        count = cores // t
        prior = profiled.instance_models([t] * count)[0][0]
        log(f"threads={t}: {count} instance(s) served under chat traffic for {seconds:.0f} s")
        doc["threads"][str(t)]["served"] = measure_served(model, t, count, prior, vocab, seconds, log,
                                                          max_model_len=max_model_len)


def run(args: argparse.Namespace) -> int:
    try:
        threads = parse_threads(args.threads)
        if args.repeats is not None and args.repeats < 1:
            raise ProfileError(f"--repeats: must be >= 1, got {args.repeats}")
        transports = [t for t in args.transports.split(",") if t]
        bad = [t for t in transports if t not in ("shm", "tcp")]
        if bad:
            raise ProfileError(f"--transports: {bad[0]!r} is not shm or tcp")
        out = pathlib.Path(args.out)
        if not out.parent.is_dir():
            raise ProfileError(f"--out: folder {str(out.parent)!r} does not exist")
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        set_omp_wait_policy(args.omp_wait_policy)
        doc = measure(args.model, threads, args.quick, args.repeats, transports, log, args.contended, args.host_work,
                      args.served)
    except (ProfileError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"splitserve profile: {str(exc).removeprefix('profile: ')}", file=sys.stderr)
        return 2
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0
