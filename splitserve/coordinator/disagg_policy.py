"""Conditional disaggregation: is a prompt prefilled on a prefill instance, or on the decode instance
that will carry its answer?

    Router.pick (disaggregated): decode instance D first (fewest running tokens, free KV), then a
      prefill instance P (fewest queued prompt tokens, prefix affinity)
    --> DisaggPolicy.place(plan, request, instances) --> Placement(local | remote, reason)
        remote: P prefills and hands the KV over to D (the 1P1D path)
        local:  D gets the prompt and prefills it itself, in chunks of at most
                EngineConfig.local_prefill_chunk_tokens per step beside its running streams

Policies (`serve --disagg-policy`):
    always     remote, whatever the prompt: separation as it was.
    threshold  local when the prompt's uncached tokens on D are at most --local-prefill-max-tokens
               (NVIDIA Dynamo's rule), or when P's queue holds more than --prefill-queue-max-tokens.
    auto       the step-time model (the profile or the defaults, refitted online from the instances'
               measured steps, as the mix controller does) predicts this request's TTFT on each side
               (remote: P's queue, the prompt, the handover and D's next step), D's longest step while
               it prefills locally (the gap its running streams see) and the stall: the time the
               local prefill, with what D already prefills, adds to each of D's running streams in
               all (every chunk step's excess over a decode-only step). Local prefill is open only
               when that keeps D's streams within their targets: the longest step within the gap
               target and the stall within one gap target. Then local when it is predicted faster
               than remote or remote would miss the TTFT target; else remote. A long prompt's many
               chunks stretch D's streams for as long as they run, so a document stays remote even
               when the prefill instance is behind (measured: session 11, doc-heavy, a 1,500-token
               prompt on D in 64-token chunks made 24 steps of 0.22-0.51 s where its decode steps
               took 0.013 s; the streams there fell behind and the probe kept 6 of 80).

What each instance's prefix cache holds, the frontend does not see; PrefixIndex keeps an estimate
from what it sent where, so "uncached tokens" means tokens the estimate says D (or P) lacks. The
engines' own prefix caches (SHA-256 over blocks) decide what is really reused; a wrong estimate only
costs a worse placement, never a wrong answer.
"""
from __future__ import annotations

import argparse
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from splitserve.control.online_stepmodel import OnlineStepModels
from splitserve.control.online_stepmodel import StepSample as ModelSample
from splitserve.control.stepmodel import StepModel, StepModels, StepShape
from splitserve.coordinator.router import AFFINITY_SLACK_TOKENS, RoutableRequest, RoutePlan, Router
from splitserve.stepfeatures import prefill_attn_ktok2

POLICIES = ("always", "threshold", "auto")
REASONS = ("always", "short", "cached", "long", "prefill_queue_full", "remote_meets_slo", "local_faster",
           "local_meets_slo", "neither_meets_slo")
DEFAULT_LOCAL_MAX_TOKENS = 256  # threshold: a chat turn, not a document
DEFAULT_CHUNK_TOKENS = 64  # a decode instance's prompt tokens per step, unless the step model sizes it
INDEX_BLOCKS_PER_INSTANCE = 16_384  # prefix-index entries kept per instance (oldest forgotten first)
REFIT_INTERVAL_S = 1.0  # auto: refit the step model from measured steps at most this often
# auto: a remote prompt's handover beyond D's next step (the KV message and the coordinator's hop);
# a 1,500-token shm transfer took 17 ms in session 11's doc-heavy trial, a chat's KV is 20x smaller
HANDOVER_S = 0.01


class PrefixIndex:
    """Per instance, the full prompt blocks it was last sent, as chained hashes (least recent first)."""

    def __init__(self, block_size: int, capacity: int = INDEX_BLOCKS_PER_INSTANCE) -> None:
        self.block_size, self.capacity = block_size, capacity
        self.blocks: dict[str, OrderedDict[int, None]] = {}

    def hashes(self, prompt: list[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks; the last token is always recomputed, as an
        engine's prefix cache does. Python's hash: a crafted collision only misroutes its sender."""
        out, parent, bs = [], 0, self.block_size
        for i in range((len(prompt) - 1) // bs):
            parent = hash((parent, *prompt[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out

    def cached_tokens(self, instance_id: str, hashes: list[int]) -> int:
        held = self.blocks.get(instance_id)
        if not held:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n * self.block_size

    def record(self, instance_id: str, hashes: list[int]) -> None:
        held = self.blocks.setdefault(instance_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)


@dataclass(slots=True)
class Placement:
    local: bool
    reason: str  # one of REASONS
    cached_tokens: int = 0  # the index's estimate on the instance that prefills
    ttft_local_s: float | None = None  # auto: the step model's predictions
    ttft_remote_s: float | None = None
    gap_local_s: float | None = None
    stall_local_s: float | None = None  # what a local prefill adds to each of D's streams in all

    def report(self) -> dict:
        out = {"where": "local" if self.local else "remote", "reason": self.reason}
        for key in ("ttft_local_s", "ttft_remote_s", "gap_local_s", "stall_local_s"):
            value = getattr(self, key)
            if value is not None and math.isfinite(value):
                out[key] = round(value, 4)
        return out


@dataclass(slots=True)
class LoadEstimate:
    """What the step model needs of an instance now (from its last stats + what was sent since)."""

    queued_prompt_tokens: int = 0
    num_running: int = 0
    kv_tokens: int = 0


class DisaggPolicy:
    """The one owner of the local-vs-remote decision; counts its decisions in /metrics."""

    def __init__(self, policy: str = "always", local_max_tokens: int = DEFAULT_LOCAL_MAX_TOKENS,
                 prefill_queue_max_tokens: int | None = None, block_size: int = 16,
                 steps: StepModels | StepModel | None = None, threads: int = 1, slo_ttft_s: float = 2.0,
                 slo_gap_s: float = 0.25, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 prefill_chunk_tokens: int = 256, metrics=None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"disaggregation policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.local_max_tokens = policy, local_max_tokens
        self.prefill_queue_max_tokens = prefill_queue_max_tokens
        self.index = PrefixIndex(block_size)
        self.threads, self.slo_ttft_s, self.slo_gap_s = threads, slo_ttft_s, slo_gap_s
        self.chunk_tokens, self.prefill_chunk_tokens = chunk_tokens, prefill_chunk_tokens
        self.online = OnlineStepModels(steps) if steps is not None else None
        self.model = self.online.prior_for(threads) if self.online is not None else None
        self._refit_at = 0.0
        self.counts: dict[tuple[str, str], int] = {}
        self.metrics = metrics
        # local prompts sent to an instance whose first token has not come yet: its stats lag them
        self.pending: dict[str, dict[str, int]] = {}

    # ---- the decision ------------------------------------------------------------------------

    def place(self, plan: RoutePlan, request: RoutableRequest, instances: dict | None = None,
              router: Router | None = None) -> tuple[RoutePlan, Placement | None]:
        """A disaggregated plan, kept (remote) or with its prefill instance dropped (local).
        instances: the engine link's (their last stats and step samples); router: the one that
        made the plan (its loads and open decode instances)."""
        if plan.prefill_instance_id is None:
            return plan, None  # colocated: nothing to decide
        prompt = request.prompt_token_ids or []
        hashes = self.index.hashes(prompt) if self.policy != "always" else []
        if router is not None:
            plan = self._prefer_cached_decode(plan, hashes, router)
        decode, prefill = plan.instance_id, plan.prefill_instance_id
        cached_d = self.index.cached_tokens(decode, hashes)
        cached_p = self.index.cached_tokens(prefill, hashes)
        loads = router.instances if router is not None else {}
        placement = self._decide(request, decode, prefill, cached_d, cached_p, instances or {}, loads)
        placement.cached_tokens = cached_d if placement.local else cached_p
        self.index.record(decode, hashes)  # D holds the prompt either way (prefilled, or its KV received)
        if not placement.local:
            self.index.record(prefill, hashes)
        self._count(placement)
        if placement.local:
            self.pending.setdefault(decode, {})[request.request_id] = request.num_prompt_tokens - cached_d
            return RoutePlan(decode), placement
        # `always` is separation as it was: counted, but its answers carry no placement report
        return plan, None if self.policy == "always" else placement

    def _prefer_cached_decode(self, plan: RoutePlan, hashes: list[int], router: Router) -> RoutePlan:
        """Decode-first: of the open decode instances, the one holding most of this prompt's prefix,
        unless it is AFFINITY_SLACK_TOKENS busier than the router's pick (the least loaded)."""
        if not hashes:
            return plan
        picked = router.instances.get(plan.instance_id)
        best, best_cached = plan.instance_id, self.index.cached_tokens(plan.instance_id, hashes)
        for load in router.open_instances("decode"):
            cached = self.index.cached_tokens(load.instance_id, hashes)
            if cached > best_cached and (picked is None or load.outstanding_tokens
                                         <= picked.outstanding_tokens + AFFINITY_SLACK_TOKENS):
                best, best_cached = load.instance_id, cached
        return plan if best == plan.instance_id else RoutePlan(best, plan.prefill_instance_id)

    def _decide(self, request: RoutableRequest, decode: str, prefill: str, cached_d: int, cached_p: int,
                instances: dict, loads: dict) -> Placement:
        n = request.num_prompt_tokens
        if self.policy == "always":
            return Placement(False, "always")
        if self.policy == "threshold":
            if n - cached_d <= self.local_max_tokens:
                return Placement(True, "short" if n <= self.local_max_tokens else "cached")
            queued = self._load(prefill, instances, loads).queued_prompt_tokens
            if self.prefill_queue_max_tokens is not None and queued > self.prefill_queue_max_tokens:
                return Placement(True, "prefill_queue_full")
            return Placement(False, "long")
        model = self._model(instances)
        d, p = self._load(decode, instances, loads), self._load(prefill, instances, loads)
        handover = model.decode_step_s(d.num_running + 1, d.kv_tokens + n) + HANDOVER_S
        ttft_remote = (model.prefill_s(p.queued_prompt_tokens, self.prefill_chunk_tokens)
                       + model.prefill_s(n - cached_p, self.prefill_chunk_tokens) + handover)
        ttft_local, gap_local, stall_local = self._local_cost(model, d, cached_d, n)
        estimates = dict(ttft_local_s=ttft_local, ttft_remote_s=ttft_remote, gap_local_s=gap_local,
                         stall_local_s=stall_local)
        streams_keep = gap_local <= self.slo_gap_s and stall_local <= self.slo_gap_s
        remote_meets = ttft_remote <= self.slo_ttft_s
        if streams_keep and ttft_local <= self.slo_ttft_s and (ttft_local < ttft_remote or not remote_meets):
            return Placement(True, "local_faster" if remote_meets else "local_meets_slo", **estimates)
        if remote_meets:
            return Placement(False, "remote_meets_slo", **estimates)
        # neither meets the targets: a local miss would be paid by every stream D carries, a remote
        # one by this request (and the prompts behind it), so local only while D's streams keep theirs
        return Placement(streams_keep and ttft_local < ttft_remote, "neither_meets_slo", **estimates)

    def _local_cost(self, model: StepModel, d: LoadEstimate, cached: int, n: int) -> tuple[float, float, float]:
        """(TTFT, the longest step, the stall) of prefilling n tokens (the first `cached` found) on D,
        behind what it already prefills, in chunks that share every step with its running streams.
        The stall: what those chunks add to each running stream's time in all (none without streams)."""
        decode = model.decode_step_s(d.num_running, d.kv_tokens)
        ttft, gap, stall, c = 0.0, decode, 0.0, self.chunk_tokens
        for start, end in ((0, d.queued_prompt_tokens), (cached, n)):
            while start < end:
                chunk = min(c, end - start)
                step = model.step_s(chunk, prefill_attn_ktok2(start, chunk), d.num_running, d.kv_tokens)
                ttft, gap, start = ttft + step, max(gap, step), start + chunk
                stall += step - decode if d.num_running else 0.0
        return ttft, gap, stall

    def _load(self, instance_id: str, instances: dict, loads: dict) -> LoadEstimate:
        inst = instances.get(instance_id)
        stats = inst.stats if inst is not None else None
        pending = sum(self.pending.get(instance_id, {}).values())
        load = loads.get(instance_id)
        if load is not None and load.role == "prefill":
            pending = load.outstanding_tokens  # the router's count of its prompts not yet prefilled: exact
        if stats is None:
            return LoadEstimate(pending)
        used = (stats.num_blocks_total - stats.num_free_blocks) * stats.block_size
        return LoadEstimate(max(stats.num_queued_prompt_tokens, pending), stats.num_running, used)

    def _model(self, instances: dict) -> StepModel:
        now = time.monotonic()
        if now - self._refit_at >= REFIT_INTERVAL_S and instances:
            self._refit_at = now
            sources = [(i, inst.num_step_samples,
                        [ModelSample(StepShape(s.prefill_tokens, s.prefill_attn_ktok2, s.decode_seqs,
                                               s.decode_kv_tokens), s.seconds) for s in inst.step_samples])
                       for i, inst in instances.items() if inst.alive]
            self.model = self.online.update(self.threads, sources).model
        return self.model

    # ---- bookkeeping -------------------------------------------------------------------------

    def on_prefilled(self, instance_id: str | None, request_id: str) -> None:
        """The request's first token came (or it ended): its prompt no longer waits there."""
        waiting = self.pending.get(instance_id)
        if waiting is not None:
            waiting.pop(request_id, None)

    def _count(self, placement: Placement) -> None:
        key = ("local" if placement.local else "remote", placement.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.disagg_decisions.labels(*key).inc()


def add_disagg_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disagg-policy", choices=POLICIES, default="always",
                   help="with --prefill/--decode: where each prompt is prefilled. always: on a prefill "
                        "instance; threshold: on its decode instance when its uncached tokens are at most "
                        "--local-prefill-max-tokens; auto: on the decode instance when the step-time model "
                        "says its streams keep the gap target (--slo-gap-s) and it gives the first token "
                        "sooner, or the prefill instance would miss --slo-ttft-s; else remotely")
    p.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help=f"--disagg-policy threshold: longest uncached prompt a decode instance prefills "
                        f"itself (default {DEFAULT_LOCAL_MAX_TOKENS})")
    p.add_argument("--prefill-queue-max-tokens", type=int, default=None,
                   help="--disagg-policy threshold: prefill locally whatever its length when the prefill "
                        "instance has more queued prompt tokens than this (default: no limit)")
    p.add_argument("--local-prefill-chunk-tokens", type=int, default=None,
                   help="a decode instance's prompt tokens per step when it prefills one itself (default: "
                        f"the most that keeps a step of 8 streams within --slo-gap-s by the step-time model "
                        f"under auto, else {DEFAULT_CHUNK_TOKENS})")


def check_disagg_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag."""
    for flag, value in (("--local-prefill-max-tokens", args.local_prefill_max_tokens),
                        ("--prefill-queue-max-tokens", args.prefill_queue_max_tokens),
                        ("--local-prefill-chunk-tokens", args.local_prefill_chunk_tokens)):
        if value is not None and value < (1 if flag.endswith("chunk-tokens") else 0):
            raise ValueError(f"{flag} must be {'positive' if flag.endswith('chunk-tokens') else '>= 0'}, "
                             f"got {value}")
    for flag, value in (("--slo-ttft-s", args.slo_ttft_s), ("--slo-gap-s", args.slo_gap_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be positive seconds, got {value}")
    if args.disagg_policy == "always":
        given = [f for f, v in (("--local-prefill-max-tokens", args.local_prefill_max_tokens),
                                ("--prefill-queue-max-tokens", args.prefill_queue_max_tokens),
                                ("--local-prefill-chunk-tokens", args.local_prefill_chunk_tokens)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --disagg-policy threshold or auto")


def sized_chunk_tokens(model: StepModel, gap_s: float, budget: int, num_streams: int = 8,
                       context: int = 512) -> int:
    """The largest chunk (a power of two, 16..budget) whose step with num_streams decodes of
    `context` tokens each the model predicts within gap_s."""
    best, chunk = 16, 16
    while chunk <= budget:
        if model.step_s(chunk, prefill_attn_ktok2(context, chunk), num_streams, num_streams * context) > gap_s:
            break
        best, chunk = chunk, chunk * 2
    return min(best, budget)


def disagg_policy_from_args(args: argparse.Namespace, metrics=None,
                            steps: StepModels | StepModel | None = None) -> DisaggPolicy:
    """Also fills args.local_prefill_chunk_tokens, which the decode instances' configs carry.
    steps: the step-time model `auto` weighs (the simulator passes the one its steps run on);
    default the --profile's, else mix.FALLBACK_STEP_MODEL. The other policies use none."""
    if args.disagg_policy != "auto":
        steps = None
    elif steps is None:
        from splitserve.control.mix import FALLBACK_STEP_MODEL
        steps = FALLBACK_STEP_MODEL
        if args.profile is not None:
            from splitserve.control.profile_file import load_profile
            steps = load_profile(args.profile).steps
    threads = args.threads_per_instance or 1
    ttft_s = args.slo_ttft_s if args.slo_ttft_s is not None else 2.0
    gap_s = args.slo_gap_s if args.slo_gap_s is not None else 0.25
    if args.disagg_policy != "always" and args.local_prefill_chunk_tokens is None:
        model = steps.for_threads(threads) if isinstance(steps, StepModels) else steps
        args.local_prefill_chunk_tokens = (sized_chunk_tokens(model, gap_s, args.max_num_batched_tokens)
                                           if model is not None else min(DEFAULT_CHUNK_TOKENS,
                                                                         args.max_num_batched_tokens))
    return DisaggPolicy(args.disagg_policy, DEFAULT_LOCAL_MAX_TOKENS if args.local_prefill_max_tokens is None
                        else args.local_prefill_max_tokens, args.prefill_queue_max_tokens, args.block_size,
                        steps, threads, ttft_s, gap_s, args.local_prefill_chunk_tokens or DEFAULT_CHUNK_TOKENS,
                        args.max_num_batched_tokens, metrics)
