"""`serve --adaptive`: the mix controller (control/mix.py) wired to a running frontend.

    every --mix-interval-s:  Coordinator.load_view() --mix_views--> [InstanceView]
                             Coordinator.arrivals (last DEMAND_WINDOW_S) --> Demand
        --MixController.decide--> Decision --(a change)--> Coordinator.change_role(id, role)
                                           --(a knob)--> the disaggregation policy's threshold,
                                                         Coordinator.set_chunk_tokens(tokens)
    every decision, change or not, with its reason -> the bounded log behind GET /admin/mix,
    splitserve_mix_decisions_total{action} and the per-instance role gauge on /metrics.

Each engine's stats carry the steps it ran since its last stats (shape and seconds); the engine
client keeps the last few hundred per instance, and the controller refits its step model on them
(control/online_stepmodel.py). GET /admin/mix shows the model in use ("model").

The engines' stats carry no thread count, so the adapter takes it from what `serve` started them
with (--threads-per-instance): the step-time model is per thread count.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from splitserve.config import CARRIED_CHUNK_TOKENS
from splitserve.control.mix import (FALLBACK_STEP_MODEL, Decision, InstanceView, MixController, MixTargets,
                                    parse_slo_classes)
from splitserve.control.mix_loop import MixLoop
from splitserve.control.online_stepmodel import StepSample
from splitserve.control.stepmodel import StepShape
from splitserve.control.whatif import Demand

if TYPE_CHECKING:  # `serve`'s flags are read before the web stack is imported
    from splitserve.coordinator.coordinator import Coordinator
    from splitserve.coordinator.metrics import FrontendMetrics
    from splitserve.coordinator.role_change import InstanceLoadView

log = logging.getLogger(__name__)
ACTIONS = ("none", "change", "refused")
# Request and token rates: long enough that a few documents arriving together do not read as a
# saturated prefill instance (at 0.17 documents/s, 6 s held 3 or more documents in ~9% of
# intervals and the predicted TTFT of 1 prefill + 1 decode grew without bound: docs/benchmarks.md,
# demand shift, session 6), short enough that a change of demand shows within seconds. What
# kind of prompts come shows sooner, through the prompt lengths (PROMPT_WINDOW_S, below).
DEMAND_WINDOW_S = 15.0
# Prompt lengths over a longer window: at 0.3 documents/s a 6 s window often holds none (the
# measured demand-shift run moved only 11-35 s into its document phase, this the likely reason;
# docs/benchmarks.md, "Adaptive stage mix").
PROMPT_WINDOW_S = 30.0
# The newest seconds alone, rates and prompts: a move chosen on the windows above must also hold on
# them (MixController.decide). The 15 s window lags a burst's onset (demand_rotation_overload_x2,
# session 20: 0.87 req/s read 4 s into a 3.8 req/s burst, and the chunk knob moved for it) and
# mixes two regimes at a phase boundary (demand_rotation: the first step to 1 prefill + 1 decode
# taken at the writing -> summaries boundary, undone 4.6 s later).
NEWEST_WINDOW_S = 5.0


def add_adaptive_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adaptive", action="store_true",
                   help="move instances between prefill, decode and colocated as demand changes, to keep "
                        "the TTFT and inter-token targets (GET /admin/mix shows every decision and why)")
    p.add_argument("--slo-ttft-s", type=float, default=None, help="--adaptive: TTFT target, seconds (default 2)")
    p.add_argument("--slo-gap-s", type=float, default=None,
                   help="--adaptive: inter-token gap target, seconds (default 0.25)")
    p.add_argument("--slo-tpot-s", type=float, default=None,
                   help="--adaptive: mean seconds per output token target, how fast answers must stream "
                        "(an end-to-end deadline on long answers; default: none, only the gap and TTFT count)")
    p.add_argument("--slo-e2e-s", type=float, default=None,
                   help="--adaptive: end-to-end target, seconds (default: none); with a class's answer length it "
                        "sets how fast its streams must step, and so how many streams an instance may hold")
    p.add_argument("--slo-classes", default=None,
                   help="--adaptive: per-class targets, name:ttft_s:gap_s[:share[:e2e_s]] separated by commas "
                        "(e.g. chat:2:0.25:0.8,document:8:0.5:0.2:30 or writing:4:0.5::40, as a trial's SLO "
                        "classes have them); the mix must hold the strictest, and under overload it keeps the mix "
                        "predicted to meet the most deadlines by share")
    p.add_argument("--mix-horizon-s", type=float, default=None,
                   help="--adaptive: a role change is made only if its predicted gain over this many seconds "
                        "of demand like the last ones exceeds its measured cost (default 60)")
    p.add_argument("--mix-interval-s", type=float, default=None,
                   help="--adaptive: seconds between decisions (default 1)")
    p.add_argument("--profile", default=None,
                   help="--adaptive: a `splitserve profile` JSON for the step-time model (default: the "
                        "bundled model's fit on the AVX2 box); the model is refitted online from measured "
                        "steps, this one kept where they say nothing)")


def check_adaptive_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag; fills the defaults."""
    given = [f for f, v in (("--slo-ttft-s", args.slo_ttft_s), ("--slo-gap-s", args.slo_gap_s),
                            ("--slo-tpot-s", args.slo_tpot_s), ("--mix-interval-s", args.mix_interval_s),
                            ("--slo-e2e-s", getattr(args, "slo_e2e_s", None)),
                            ("--slo-classes", getattr(args, "slo_classes", None)),
                            ("--mix-horizon-s", getattr(args, "mix_horizon_s", None)),
                            ("--profile", args.profile)) if v is not None]
    if not args.adaptive:
        # the disaggregation policy `auto` weighs the same targets with the same step-time model
        if getattr(args, "disagg_policy", None) == "auto":
            given = [f for f in given if f not in ("--slo-ttft-s", "--slo-gap-s", "--profile")]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --adaptive; add --adaptive or drop them")
        if args.profile is not None:
            check_profile(args.profile)
        return
    args.slo_ttft_s = 2.0 if args.slo_ttft_s is None else args.slo_ttft_s
    args.slo_gap_s = 0.25 if args.slo_gap_s is None else args.slo_gap_s
    args.mix_interval_s = 1.0 if args.mix_interval_s is None else args.mix_interval_s
    args.mix_horizon_s = 60.0 if getattr(args, "mix_horizon_s", None) is None else args.mix_horizon_s
    if not args.mix_horizon_s > 0:
        raise ValueError(f"--mix-horizon-s must be positive seconds, got {args.mix_horizon_s}")
    if getattr(args, "slo_classes", None) is not None:
        try:
            parse_slo_classes(args.slo_classes)
        except ValueError as e:
            raise ValueError(f"--slo-classes: {e}") from None
    for flag, value in (("--slo-ttft-s", args.slo_ttft_s), ("--slo-gap-s", args.slo_gap_s),
                        ("--slo-tpot-s", args.slo_tpot_s), ("--mix-interval-s", args.mix_interval_s),
                        ("--slo-e2e-s", getattr(args, "slo_e2e_s", None))):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be positive seconds, got {value}")
    if args.profile is not None:
        check_profile(args.profile)


def check_profile(path: str) -> None:
    from splitserve.control.profile_file import ProfileError, load_profile
    try:
        load_profile(path)
    except ProfileError as e:
        raise ValueError(f"--profile: {e}") from None


def mix_views(loads: list[InstanceLoadView], threads: dict[str, int], default_threads: int = 1) -> list[InstanceView]:
    """The engine client's load picture as the mix controller reads it."""
    return [InstanceView(instance_id=v.instance_id, role=v.role, alive=v.alive,
                         queued_prompt_tokens=v.num_queued_prompt_tokens, num_running=v.num_running_requests,
                         decode_kv_tokens=v.num_kv_tokens_used, threads=threads.get(v.instance_id, default_threads),
                         recent_step_s=v.step_seconds or None,
                         step_samples=tuple(StepSample(StepShape(s.prefill_tokens, s.prefill_attn_ktok2, s.decode_seqs,
                                                                 s.decode_kv_tokens), s.seconds)
                                            for s in v.step_samples),
                         num_step_samples=v.num_step_samples)
            for v in loads]


class AdaptiveMix:
    """The loop, its log and its metrics for one frontend."""

    def __init__(self, client: Coordinator, metrics: FrontendMetrics, controller: MixController,
                 interval_s: float, threads: dict[str, int] | None = None, default_threads: int = 1) -> None:
        self.client, self.metrics = client, metrics
        self.threads, self.default_threads = threads or {}, default_threads
        self.started_wall = time.time()
        policy = getattr(getattr(client, "dispatcher", None), "disagg_policy", None)
        set_threshold = None
        if policy is not None and policy.policy == "threshold":
            # the cheaper knob: the controller starts from the threshold `serve` was given
            controller.local_prefill_max_tokens = policy.local_max_tokens
            set_threshold = self._set_threshold
        # the other cheap knob: every instance's prompt tokens per step beside its streams
        controller.chunk_knob = True
        # and the stream cap: how many streams each instance may hold (control/stream_cap.py); with
        # it, each request's first-token deadline goes to its engine, which queues late prompts last
        client.ttft_target_of = lambda name: controller.targets.of(name)[0]
        controller.stream_capped = True  # its what-ifs read the streams the caps allow
        self.loop = MixLoop(controller, self.views, self._change_role, interval_s, demand=self.demand,
                            set_threshold=set_threshold, set_chunk_tokens=self._set_chunk_tokens,
                            set_stream_caps=self._set_stream_caps)
        for action in ACTIONS:
            metrics.mix_decisions.labels(action)  # present at 0 from the start
        self._task: asyncio.Task | None = None

    def views(self) -> list[InstanceView]:
        return mix_views(self.client.load_view(), self.threads, self.default_threads)

    def demand(self) -> Demand:
        return Demand.from_arrivals(list(self.client.arrivals), time.monotonic(), DEMAND_WINDOW_S, PROMPT_WINDOW_S,
                                    NEWEST_WINDOW_S)

    def _set_threshold(self, tokens: int) -> None:
        self.client.dispatcher.disagg_policy.local_max_tokens = tokens

    def _set_chunk_tokens(self, tokens: int) -> None:
        self.client.set_chunk_tokens(tokens)

    def _set_stream_caps(self, caps: dict[str, int | None]) -> None:
        self.client.set_stream_caps(caps)

    async def _change_role(self, instance_id: str, role: str) -> None:
        await self.client.change_role(instance_id, role)  # RoleChangeRefused: logged by the loop

    async def run_once(self):
        loads = self.client.load_view()
        changing = [v.instance_id for v in loads if v.alive and v.changing_role]
        if changing:
            # an operator's change or a takeover after a death is under way: deciding on a picture
            # that is about to change would fight it (e.g. "rescue" a stage it is taking over)
            decision = Decision(self.loop.clock(), f"a role change is under way on {', '.join(changing)}; "
                                                   "deciding again once it is done")
            self.loop.decisions.append(decision.to_dict())
        else:
            decision = await self.loop.run_once()
        entry = self.loop.decisions[-1]  # run_once logs every decision
        entry["wall_time"] = time.time()  # the trial lines the timeline up with its own clock
        # inf (a stage with no instance) is not JSON
        for key in ("ttft_estimate_s", "gap_estimate_s", "predicted_ttft_s", "predicted_gap_s", "predicted_gain",
                    "predicted_cost"):
            if entry.get(key) is not None and not math.isfinite(entry[key]):
                entry[key] = None
        action = "none" if decision.instance_id is None else ("change" if entry.get("applied") else "refused")
        self.metrics.mix_decisions.labels(action).inc()
        return decision

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:  # a bad view must not end adapting for the server's life
                log.exception("mix: decision failed; trying again next interval")
            await asyncio.sleep(self.loop.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="adaptive-mix")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def snapshot(self) -> dict:
        targets = self.loop.controller.targets
        return {"enabled": True, "interval_s": self.loop.interval_s,
                "targets": {"ttft_s": targets.ttft_s, "gap_s": targets.gap_s, "tpot_s": targets.tpot_s,
                            "e2e_s": targets.e2e_s,
                            "classes": [{"name": c.name, "ttft_s": c.ttft_s, "gap_s": c.gap_s, "share": c.share,
                                         "e2e_s": c.e2e_s} for c in targets.classes]},
                "horizon_s": self.loop.controller.horizon_s,
                "change_cost_s": self.loop.controller.move_cost_s(),
                "local_prefill_max_tokens": self.loop.controller.local_prefill_max_tokens,
                "num_threshold_moves": self.loop.num_threshold_moves,
                "chunk_tokens": self.loop.controller.chunk_tokens, "num_chunk_moves": self.loop.num_chunk_moves,
                "stream_caps": dict(self.loop.stream_caps), "num_cap_moves": self.loop.num_cap_moves,
                "started_wall_time": self.started_wall,
                "roles": {v.instance_id: v.role for v in self.client.load_view()},
                "model": self.loop.controller.last.get("model"),
                "num_role_changes": self.loop.num_role_changes, "num_failed_changes": self.loop.num_failed_changes,
                "decisions": list(self.loop.decisions), "changes": self.loop.changes()}


def adaptive_from_args(args: argparse.Namespace, client: Coordinator, metrics: FrontendMetrics,
                       num_instances: int) -> AdaptiveMix | None:
    if not args.adaptive:
        return None
    steps = FALLBACK_STEP_MODEL
    if args.profile is not None:
        from splitserve.control.profile_file import load_profile
        steps = load_profile(args.profile).steps
    if num_instances < 2:
        print(f"splitserve: --adaptive with {num_instances} instance: there is no second instance to move "
              "between stages, so it serves colocated; instances added with POST /admin/instances join "
              "the mix", flush=True)
    classes = parse_slo_classes(args.slo_classes) if getattr(args, "slo_classes", None) else ()
    controller = MixController(steps, MixTargets(args.slo_ttft_s, args.slo_gap_s, args.slo_tpot_s, classes,
                                                 getattr(args, "slo_e2e_s", None)),
                               chunk_budget=args.max_num_batched_tokens,
                               horizon_s=getattr(args, "mix_horizon_s", None) or 60.0,
                               carry_chunk_tokens=getattr(args, "local_prefill_chunk_tokens", None)
                               or CARRIED_CHUNK_TOKENS)
    return AdaptiveMix(client, metrics, controller, args.mix_interval_s, default_threads=args.threads_per_instance or 1)
