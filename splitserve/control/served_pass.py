"""The profile's served pass: step times of instances that `serve` runs under chat traffic, with the
serving stack and a streaming client on the same cores (issue 28 item 3: contention in the model).

The lone and contended passes time EngineCore.step in the profile's own process. A trial's steps
run in engines that `serve` feeds over its sockets, beside its frontend (HTTP, SSE framing,
detokenization), the coordinator and the trial's own client. Read against those passes, the
prompt steps of every arrangement of the session-38 round ran 1.2-1.4x longer in the trials
(decode steps 0.95-1.03x), on one engine of two threads as on two of one; session 29 reproduced
most of it in 70 s with `bench/served_steps.py --traffic` and no trial. This pass makes that
reading part of the profile, for the arrangement of instances that fills the host's cores with
the thread count profiled (cores / threads instances): it serves them (`splitserve serve
--instances N --threads-per-instance T`, chunked 256-token budget, as a trial launches a colocated
arrangement), keeps 8 streaming clients per instance busy for `seconds` (closed loop, so the load
follows the box's speed: no rate is tuned to one CPU), and refits the step model on every step the
engines report (GET /admin/steps, as the trial reads its runs) with the lone (or contended) model
as the prior (control/online_stepmodel.py, the mix controller's own fit): where the served steps
speak (chats and their decodes, documents' 256-token chunks) they decide, elsewhere the prior.

The traffic is fresh random token ids (no prefix-cache hit): chats of 16-160 prompt tokens
(lognormal, median 40) with 48-96-token answers, and one request in 8 a document of 300-900 tokens
with a 16-48-token answer. The planner uses the served model for an arrangement of exactly that
many instances of that many threads, with no neighbour factor and no host work on top: both ran
beside these steps already (profile_file.Profile.instance_models).
"""
from __future__ import annotations

import asyncio
import math
import pathlib
import random
import statistics
import tempfile
import time

CLIENTS_PER_INSTANCE = 8
BUDGET = 256  # the chunked budget of the bundled specs' colocated arrangements
DOCUMENT_SHARE = 1 / 8
MIN_STEPS = 60  # fewer and the pass is reported as failed, not fitted


def _request(rng: random.Random, vocab: int, max_model_len: int | None = None) -> tuple[list[int], int]:
    """(prompt token ids, answer tokens) of one request of the pass's traffic (a prompt cut to fit
    the model's context with its answer)."""
    if rng.random() < DOCUMENT_SHARE:
        n, answer = rng.randint(300, 900), rng.randint(16, 48)
    else:
        n, answer = max(16, min(160, int(rng.lognormvariate(math.log(40), 0.5)))), rng.randint(48, 96)
    if max_model_len is not None:
        n = max(1, min(n, max_model_len - answer - 1))
    low = min(100, vocab // 2)  # past the special tokens of a real vocabulary
    return [rng.randrange(low, vocab) for _ in range(n)], answer


async def _drive(base_url: str, model_id: str | None, clients: int, seconds: float, vocab: int, seed: int,
                 max_model_len: int | None = None) -> dict:
    """`clients` streaming clients, each sending its next request when its last one ended, until
    `seconds` have passed; returns the requests sent and the ones that failed."""
    import httpx

    stop = time.monotonic() + seconds
    counts = {"requests": 0, "failed": 0, "chunks": 0}

    async def client(index: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < stop:
            prompt, answer = _request(rng, vocab, max_model_len)
            body = {"prompt": prompt, "max_tokens": answer, "temperature": 0.0, "ignore_eos": True, "stream": True}
            if model_id:
                body["model"] = model_id
            counts["requests"] += 1
            try:
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        counts["failed"] += 1
                        continue
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            counts["chunks"] += 1
            except httpx.HTTPError:
                counts["failed"] += 1

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    return counts


def _ratios(samples, prior) -> dict:
    """Time-weighted measured / prior-model seconds (and the median ratio), for steps with prompt
    tokens and for decode-only ones; None for a kind with no steps."""
    out = {}
    for kind, prompt in (("prompt", True), ("decode", False)):
        pairs = [(s.seconds, prior.predict(s.shape)) for s in samples if (s.shape.prefill_tokens > 0) == prompt]
        pairs = [(m, p) for m, p in pairs if m > 0 and p > 0]
        out[kind] = None if not pairs else {
            "num_steps": len(pairs), "time_weighted": round(sum(m for m, _ in pairs) / sum(p for _, p in pairs), 4),
            "median": round(statistics.median(m / p for m, p in pairs), 4)}
    return out


def measure_served(model: str | None, threads: int, instances: int, prior, vocab: int, seconds: float = 60.0,
                   log=print, seed: int = 0, max_model_len: int | None = None) -> dict:
    """Serve `instances` colocated instances of `threads` threads, drive them for `seconds` and
    refit `prior` (a StepModel) on their steps. Returns the profile's `threads.T.served` entry.
    RuntimeError when the server does not start or too few steps came back."""
    from splitserve.control.online_stepmodel import OnlineStepModel
    from splitserve.control.trial_steps import instance_steps, trial_samples
    from splitserve.trial.arrangements import LaunchError, launched
    from splitserve.trial.engine_steps import step_counts, steps_since
    from splitserve.trial.spec import Arrangement

    arr = Arrangement("profile-served", serve_args=[
        "--instances", str(instances), "--threads-per-instance", str(threads), "--prefill-policy", "chunked",
        "--max-num-batched-tokens", str(BUDGET), "--log-level", "warning"])
    clients = CLIENTS_PER_INSTANCE * instances
    with tempfile.TemporaryDirectory(prefix="splitserve-served-pass-") as logs:
        try:
            with launched(arr, model, pathlib.Path(logs)) as endpoint:
                # a short warm-up: the engines' first steps pay for lazy initialization
                asyncio.run(_drive(endpoint.base_url, endpoint.model, clients, 5.0, vocab, seed + 1, max_model_len))
                before = step_counts(endpoint.base_url)
                began = time.perf_counter()
                counts = asyncio.run(_drive(endpoint.base_url, endpoint.model, clients, seconds, vocab, seed,
                                            max_model_len))
                wall = time.perf_counter() - began
                steps = steps_since(endpoint.base_url, before)
        except LaunchError as exc:
            raise RuntimeError(f"profile: the served pass's server did not start: {exc}") from exc
    if counts["failed"]:
        raise RuntimeError(f"profile: {counts['failed']} of {counts['requests']} requests of the served pass failed")
    if steps is None:
        raise RuntimeError("profile: the served pass's server reported no steps (GET /admin/steps)")
    # read as a trial run's steps are (trial_steps): the engine loop's turn where it was measured
    run = [{"summary": {"engine_steps": steps}}]
    samples = trial_samples({"colocated": threads}, run).get(threads, [])
    rows = [[s.prefill_tokens, round(s.prefill_attn_ktok2, 3), s.decode_seqs, s.decode_kv_tokens, round(secs, 6),
             round(loop, 6)] for _, _, s, secs, loop, _ in instance_steps({"colocated": threads}, run)]
    if len(samples) < MIN_STEPS:
        raise RuntimeError(f"profile: the served pass saw {len(samples)} steps in {seconds:.0f} s (needs {MIN_STEPS})")
    online = OnlineStepModel(prior)
    online.refit(samples)
    ratios = _ratios(samples, prior)
    read = {kind: f"x{r['time_weighted']:.2f}" if r else "none" for kind, r in ratios.items()}
    log(f"  served: {counts['requests']} requests, {counts['chunks']} streamed chunks, {len(samples)} steps in "
        f"{wall:.0f} s; against the prior, prompt steps {read['prompt']}, decode steps {read['decode']} "
        f"(time-weighted); refit median |error| {online.median_error:.1%}")
    return {"instances": instances, "threads_each": threads, "seconds": round(wall, 1),
            "clients": clients, "requests": counts["requests"], "streamed_chunks": counts["chunks"],
            "work": (f"{CLIENTS_PER_INSTANCE} streaming clients per instance, closed loop: chats of 16-160 prompt "
                     f"tokens with 48-96-token answers, 1 in {round(1 / DOCUMENT_SHARE)} a 300-900-token document "
                     f"with a 16-48-token answer; fresh random token ids; chunked {BUDGET}-token budget"),
            "fields": ["prefill_tokens", "prefill_attn_ktok2", "decode_seqs", "decode_kv_tokens", "seconds",
                       "loop_seconds"],
            "samples": rows, "step_model": online.model.to_dict(),
            "fit": {"statistic": "refit on the served steps, the lone/contended model as prior",
                    "median_abs_rel_error": online.median_error, "num_steps": len(samples),
                    "num_prompt_steps": sum(1 for s in samples if s.shape.prefill_tokens)},
            "against_prior": ratios}
