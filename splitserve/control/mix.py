"""The adaptive stage mix: which instance, if any, should change role now, and why.

Every interval the controller reads one `InstanceView` per instance and estimates, with the
step-time model (control/stepmodel.py; Dynamo's load-based planner does the same with its
regression of step time on prefill tokens and decode KV tokens):
  TTFT      per prefill-capable instance (prefill or colocated): the time to work through its
            queued prompt tokens, in budget-sized steps that also carry its running decodes;
            the stage's figure is the mean (the router keeps them level);
  inter-token time  per decode-capable instance (decode or colocated): one step with its
            running decodes (and, colocated, a prefill chunk when prompts wait); the stage's
            figure is the worst instance (its streams are the slowest).
A measured recent step time, when given, corrects that instance's estimates by the ratio of
measured to modelled (clamped), so a mis-fitted profile does not steer the mix.

Pressure is estimate / target. One stage over `high` while the other is under `low`, for
`patience` intervals running, moves one instance toward the pressed stage: a specialist of
the relaxed stage flips over, or becomes colocated when it is the last one able to serve its
stage (a colocated instance serves both). After a change nothing moves for `cooldown`
intervals. No decision ever leaves a stage without an instance able to serve it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from splitserve.control.stepmodel import StepModel, StepModels

ROLES = ("prefill", "decode", "colocated")
# Without a profile (`serve --adaptive` given none): the bundled model's 2-thread fit on the
# shared 2-core box (docs/benchmarks.md, "Planner"); measured step times correct it per instance.
FALLBACK_STEP_MODEL = StepModel(overhead_s=0.056, per_prefill_token_s=0.0013, per_prefill_attn_s=0.00074,
                                per_decode_seq_s=0.0034, per_decode_kv_token_s=7.2e-6)
PREFILL_CAPABLE = ("prefill", "colocated")
DECODE_CAPABLE = ("decode", "colocated")


@dataclass(slots=True, frozen=True)
class InstanceView:
    instance_id: str
    role: str
    alive: bool = True
    queued_prompt_tokens: int = 0     # prompt tokens waiting or partly prefilled
    num_running: int = 0              # requests in its decode batch
    decode_kv_tokens: int = 0         # their context lengths, summed
    threads: int = 1
    recent_step_s: float | None = None  # measured mean step time over the last interval

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance {self.instance_id}: role must be one of {ROLES}, got {self.role!r}")


@dataclass(slots=True, frozen=True)
class MixTargets:
    ttft_s: float
    gap_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.gap_s > 0):
            raise ValueError(f"mix targets must be positive seconds, got ttft_s={self.ttft_s}, gap_s={self.gap_s}")


@dataclass(slots=True, frozen=True)
class Decision:
    at_s: float
    reason: str
    instance_id: str | None = None    # None: no change this interval
    from_role: str | None = None
    to_role: str | None = None
    ttft_estimate_s: float | None = None
    gap_estimate_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


@dataclass(slots=True)
class MixController:
    steps: StepModels | StepModel
    targets: MixTargets
    chunk_budget: int = 256           # colocated instances' max_num_batched_tokens
    high: float = 1.0                 # pressure above which a stage asks for an instance
    low: float = 0.5                  # pressure below which a stage can give one up
    patience: int = 2                 # intervals a condition must hold before acting
    cooldown: int = 3                 # intervals after a change during which nothing moves
    _streak: dict = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    _since_change: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"mix thresholds: need 0 < low < high, got low={self.low}, high={self.high}")
        if self.patience < 1 or self.cooldown < 0:
            raise ValueError("mix: patience must be >= 1 and cooldown >= 0 intervals")

    def _model(self, view: InstanceView) -> StepModel:
        return self.steps.for_threads(view.threads) if isinstance(self.steps, StepModels) else self.steps

    def _correction(self, view: InstanceView, model: StepModel) -> float:
        if not view.recent_step_s or not (view.num_running or view.queued_prompt_tokens):
            return 1.0
        chunk = min(view.queued_prompt_tokens, self.chunk_budget) if view.role != "decode" else 0
        modelled = model.step_s(chunk, chunk * chunk / 2000.0, view.num_running, view.decode_kv_tokens)
        return min(max(view.recent_step_s / modelled, 0.5), 3.0)

    def ttft_estimate(self, view: InstanceView) -> float:
        model = self._model(view)
        q = view.queued_prompt_tokens
        if view.role == "prefill":
            est = model.step_s(q, q * q / 2000.0)  # the queue's prompts, whole (attention term per prompt ~ q^2/2)
        else:
            steps = max(math.ceil(q / self.chunk_budget), 1)
            chunk = min(q, self.chunk_budget)
            est = steps * model.step_s(chunk, chunk * chunk / 2000.0, view.num_running, view.decode_kv_tokens)
        return est * self._correction(view, model)

    def gap_estimate(self, view: InstanceView) -> float:
        model = self._model(view)
        chunk = min(view.queued_prompt_tokens, self.chunk_budget) if view.role == "colocated" else 0
        est = model.step_s(chunk, chunk * chunk / 2000.0, max(view.num_running, 1), view.decode_kv_tokens)
        return est * self._correction(view, model)

    def estimates(self, views: list[InstanceView]) -> tuple[float, float]:
        live = [v for v in views if v.alive]
        pre = [self.ttft_estimate(v) for v in live if v.role in PREFILL_CAPABLE]
        dec = [self.gap_estimate(v) for v in live if v.role in DECODE_CAPABLE]
        return (sum(pre) / len(pre) if pre else math.inf), (max(dec) if dec else math.inf)

    @staticmethod
    def covered(views: list[InstanceView], change: tuple[str, str] | None = None) -> bool:
        """True if, after `change` (instance id, new role), some live instance can prefill and one can decode."""
        roles = [(change[1] if change and v.instance_id == change[0] else v.role) for v in views if v.alive]
        return any(r in PREFILL_CAPABLE for r in roles) and any(r in DECODE_CAPABLE for r in roles)

    def _move(self, views: list[InstanceView], toward: str) -> tuple[InstanceView, str] | None:
        """One instance to move toward stage `toward` (prefill | decode), keeping both stages covered."""
        away = "decode" if toward == "prefill" else "prefill"
        live = [v for v in views if v.alive]
        # the least busy specialist of the relaxed stage first, then colocated instances
        load = (lambda v: v.num_running) if away == "decode" else (lambda v: v.queued_prompt_tokens)
        for view in sorted((v for v in live if v.role == away), key=load):
            for role in (toward, "colocated"):
                if self.covered(views, (view.instance_id, role)):
                    return view, role
        for view in sorted((v for v in live if v.role == "colocated"), key=load):
            if self.covered(views, (view.instance_id, toward)):
                return view, toward
        return None

    def decide(self, views: list[InstanceView], now_s: float = 0.0) -> Decision:
        self._since_change += 1
        ttft, gap = self.estimates(views)
        p_ttft, p_gap = ttft / self.targets.ttft_s, gap / self.targets.gap_s
        state = (f"TTFT estimate {_fmt(ttft)} ({p_ttft:.2f}x its {_fmt(self.targets.ttft_s)} target), "
                 f"inter-token estimate {_fmt(gap)} ({p_gap:.2f}x its {_fmt(self.targets.gap_s)} target)")
        if not self.covered(views):
            return self._rescue(views, now_s, state, ttft, gap)
        wants = None
        if p_ttft > self.high and p_gap < self.low:
            wants = "prefill"
        elif p_gap > self.high and p_ttft < self.low:
            wants = "decode"
        for stage in self._streak:
            self._streak[stage] = self._streak[stage] + 1 if stage == wants else 0
        if wants is None:
            why = ("both stages over target: no instance can be spared; add instances"
                   if p_ttft > self.high and p_gap > self.high else "within the hysteresis band")
            return self._none(now_s, f"{state}; {why}", ttft, gap)
        if self._since_change <= self.cooldown:
            return self._none(now_s, f"{state}; {wants} needs help but the last change was "
                                     f"{self._since_change} interval(s) ago (cooldown {self.cooldown})", ttft, gap)
        if self._streak[wants] < self.patience:
            return self._none(now_s, f"{state}; {wants} pressure for {self._streak[wants]} of "
                                     f"{self.patience} intervals", ttft, gap)
        move = self._move(views, wants)
        if move is None:
            return self._none(now_s, f"{state}; {wants} needs help but every move would leave a stage "
                                     "with no instance able to serve it", ttft, gap)
        view, role = move
        self._since_change = 0
        self._streak[wants] = 0
        other = "inter-token" if wants == "prefill" else "TTFT"
        return Decision(now_s, f"{state}: {wants} is short while {other} has slack, for {self.patience} intervals; "
                               f"{view.instance_id} ({view.role}, {view.num_running} running, "
                               f"{view.queued_prompt_tokens} prompt tokens queued) becomes {role}",
                        view.instance_id, view.role, role, ttft, gap)

    def _rescue(self, views: list[InstanceView], now_s: float, state: str, ttft: float, gap: float) -> Decision:
        """A stage lost its last instance: a survivor turns colocated at once (no patience, no cooldown)."""
        live = [v for v in views if v.alive]
        missing = "prefill" if not any(v.role in PREFILL_CAPABLE for v in live) else "decode"
        if not live:
            return self._none(now_s, "no live instance: nothing to change", ttft, gap)
        # the least loaded survivor of the stage that still has the most instances
        count = {role: sum(v.role == role for v in live) for role in ROLES}
        view = min(live, key=lambda v: (-count[v.role], v.num_running + v.queued_prompt_tokens))
        self._since_change = 0
        return Decision(now_s, f"no live instance can {missing}: {view.instance_id} ({view.role}) becomes "
                               "colocated so both stages are served", view.instance_id, view.role, "colocated",
                        ttft, gap)

    @staticmethod
    def _none(now_s: float, reason: str, ttft: float, gap: float) -> Decision:
        return Decision(now_s, reason, ttft_estimate_s=ttft, gap_estimate_s=gap)
