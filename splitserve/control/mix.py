"""The adaptive stage mix: which instance, if any, should change role now, and why.

Every interval the controller reads one `InstanceView` per instance and the demand of the last
few seconds (control/whatif.py: requests, prompt and answer tokens per second, prompt lengths),
and asks what if: for the mix as it is and for every mix one or two role changes away that
leaves both stages covered, it predicts TTFT and the inter-token gap with the step-time model
(Dynamo's load-based planner regresses step time the same way), new work spread as the router
spreads it and what each instance holds now left where it is. Pressure is a prediction over its target; a mix's pressure is its worse stage's,
max(TTFT / target, gap / target).

A mix whose pressure is `margin` (20%) below the current one's, best for `patience` intervals
running, is adopted, unless every target is met with room (pressure under `calm`). Roles then
change one instance per interval: a mix two changes away (two colocated instances becoming one
prefill and one decode) goes through the better of its two halfway mixes, and its second
change follows at the next interval, if it still beats the mix of the moment by the margin.
After a change nothing else moves for `cooldown` intervals. The halfway mixes matter: beside a
colocated instance, a prefill or decode instance gets no new work (coordinator/router.py), so
a single change from two colocated instances only ever helps as the first of two.

A move must also pay for itself (issue 31): its gain is the SLO pressure it removes (capped at
`pressure_cap`, past which mixes are overloaded alike; the part past 1, where deadlines are lost,
counted `miss_weight` times more, so a phase that saturates a stage outweighs a minute of margins
in the phase before it; and nothing where both mixes are under `calm`: no move is made for room
alone, so none is weighed by it), averaged over the demand of the last `horizon_s` seconds and counted
over that horizon, in pressure-seconds; its cost is the measured
seconds a change takes (MixLoop times each one; `change_cost_s` until one is measured) per role
change, times the pressure then. Demand that alternates faster than the horizon averages out,
so a move that helps one phase and hurts the next gains nothing and is not made. Undoing a
move made within the horizon costs `undo_bar` times more, and every move must gain `cost_margin`
more than its cost (a gain is a difference of predictions, each with the model's error). Targets
may be per class (SloClass): where requests name their class (`slo_class`), each class present in
the demand is judged by its own predicted TTFT against its own targets (whatif.py), so a burst
of summaries allowed 15 s is not read as chats missing 4 s; where they name none, the one TTFT must
hold the strictest class's target. When no mix within reach meets them (overload), mixes are
ranked by the share of deadlines the step model predicts each meets (per class, the share meeting
its TTFT times the share keeping its gaps, a gap counted held only with `knob_headroom` to spare),
and the mix as it is held
unless another meets `margin` more: the decision says "held (overload)". Two cheaper knobs move
before any role change, whenever a setting of them alone is predicted to hold the targets: the
decode instances' local-prefill threshold (`serve --disagg-policy threshold`) and the chunk budget,
the prompt tokens a step carries beside running streams on every instance (a colocated instance's
chunks, a decode instance's local prefills, a prefill instance's inherited streams; engine
message SetChunkTokens): smaller chunks shorten the gaps and lengthen the TTFT. They move
while a target is missed, to the setting with the shortest predicted gap among those that hold
every target with `knob_headroom` to spare, and while the targets are met without room (pressure
between `calm` and 1), if a setting is `margin` below the pressure now, to the shortest-gap one
of those predicted calm (else the least pressure), before any role change is weighed (shortest gap: a stream's longest pause is its longest step); and every mix a role change could lead to is judged at the knob setting it would then move to. When
no setting holds the targets they move to the one predicted to meet the most deadlines, if it
misses `margin` fewer than now and has won `patience` intervals running. A change that
turns an instance with running streams into a prefill one keeps them there, stepping beside
chunks of `carry_chunk_tokens` (engine/connectors.py) until they end; one predicted to step them
past the gap target (and past the worst gap now) is not made, nor is such a second step. Each
decision carries its predicted gain and cost, and `held` says in a word why nothing moved.

Two more bars (session 21). The demand may carry its newest seconds alone (Demand.newest;
`serve --adaptive` reads the last 5 s): a role move, and a knob move past every setting, chosen
on the window's demand must win on the newest seconds' too, since the window lags a burst's onset
and mixes two regimes at a boundary ("held (newest)"). And the knobs go back to the setting they
left within `cooldown` intervals only for a missed target, once it has won `patience` intervals
running ("held (knob undo)", "held (patience)").

The streams' longest pause (session 22): the knobs' choice among the settings predicted here
(ties, room under the gap target, the resting chunk budget) is control/mix_knobs.py's.

The step-time model is learnt online from the engines' measured steps (control/online_stepmodel.py:
a refit per interval with new samples, anchored to the profile's or the fallback's model where
the steps say nothing), so a loaded box or a profile from another machine does not steer the mix.
Until MIN_SAMPLES steps are measured, the prior model is scaled by the median ratio of measured
to modelled mean step times over the busy instances (clamped). A stage left with no live
instance is rescued at once (no patience, no cooldown). No decision ever leaves a stage without
an instance able to serve it.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass, field, replace

from splitserve.config import CARRIED_CHUNK_TOKENS
from splitserve.control.online_stepmodel import MIN_SAMPLES, PRIOR_WEIGHT, OnlineStepModels, StepSample, describe_model
from splitserve.control.stepmodel import StepModel, StepModels, prefill_attn_ktok2
from splitserve.control.mix_knobs import KnobChoice, _fmt
from splitserve.control.stream_cap import allowance_s, stream_cap
from splitserve.control.whatif import Demand, Held, Prediction, WhatIf
from splitserve.roles import DECODE_CAPABLE, PREFILL_CAPABLE, ROLES, Role, take_over_survivor

# the order candidate moves are tried in (ties go to the first): config order would change decisions
MOVE_ORDER = (Role.PREFILL.value, Role.DECODE.value, Role.COLOCATED.value)
# Without a profile (`serve --adaptive` given none): the bundled model's fits by `splitserve profile`
# on the AVX2 box (AMD EPYC family 25 model 1, 2 vCPUs),
# bench/results/profile_bundled_amd-epyc-avx2-2core_2026-12-01.json ('threads' -> '1' / '2' ->
# 'step_model'), rounded to 3 digits. That profile predates the 8-wide AVX2 decode attention
# (..._attn.json: 2.3 us per KV token instead of 21), so its KV term overstates today's engine on
# AVX2; the online model (control/online_stepmodel.py) corrects it from the
# first 30 measured steps. Kept as it is because the session 6 demand-shift runs used it.
FALLBACK_STEP_MODEL = StepModels({
    1: StepModel(overhead_s=0.0222, per_prefill_token_s=0.00367, per_prefill_attn_s=0.000548,
                 per_decode_seq_s=0.00559, per_decode_kv_token_s=2.13e-5),
    2: StepModel(overhead_s=0.0110, per_prefill_token_s=0.00205, per_prefill_attn_s=0.000610,
                 per_decode_seq_s=0.00534, per_decode_kv_token_s=1.18e-5)})


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
    step_samples: tuple[StepSample, ...] = ()  # its last measured steps
    num_step_samples: int = 0  # step samples it has sent so far: a change says new ones came

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance {self.instance_id}: role must be one of {ROLES}, got {self.role!r}")


@dataclass(slots=True, frozen=True)
class SloClass:
    """One class of requests and its targets, as the trial's SLO classes have them."""
    name: str
    ttft_s: float
    gap_s: float
    share: float = 1.0  # its weight among the classes (e.g. its share of requests)
    e2e_s: float | None = None  # its end-to-end target (None: the global one, if any)

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.gap_s > 0 and self.share > 0):
            raise ValueError(f"SLO class {self.name!r}: ttft_s, gap_s and share must be positive")
        if self.e2e_s is not None and not self.e2e_s > 0:
            raise ValueError(f"SLO class {self.name!r}: e2e_s must be positive")


def parse_slo_classes(text: str) -> tuple[SloClass, ...]:
    """'chat:2:0.25:0.7,document:6:0.5:0.3:30' (name:ttft_s:gap_s[:share[:e2e_s]], share may be
    left empty: 'writing:4:0.5::40') -> classes; ValueError if bad."""
    classes = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (3, 4, 5) or not parts[0]:
            raise ValueError(f"SLO class {item!r}: expected name:ttft_s:gap_s[:share[:e2e_s]]")
        try:
            nums = [float(x) for x in parts[1:3]]
            share = float(parts[3]) if len(parts) > 3 and parts[3] else 1.0
            e2e = float(parts[4]) if len(parts) > 4 else None
        except ValueError:
            raise ValueError(f"SLO class {item!r}: ttft_s, gap_s, share and e2e_s must be numbers") from None
        classes.append(SloClass(parts[0], *nums, share, e2e))
    if not classes:
        raise ValueError("no SLO class given")
    return tuple(classes)


@dataclass(slots=True, frozen=True)
class MixTargets:
    ttft_s: float
    gap_s: float
    tpot_s: float | None = None  # mean seconds per output token; None: answers' speed is not a target
    classes: tuple[SloClass, ...] = ()  # per-class targets; () : one class with ttft_s and gap_s
    e2e_s: float | None = None  # end-to-end target of requests whose class names none (None: none)

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.gap_s > 0):
            raise ValueError(f"mix targets must be positive seconds, got ttft_s={self.ttft_s}, gap_s={self.gap_s}")
        if self.tpot_s is not None and not self.tpot_s > 0:
            raise ValueError(f"mix TPOT target must be positive seconds, got {self.tpot_s}")
        if self.e2e_s is not None and not self.e2e_s > 0:
            raise ValueError(f"mix end-to-end target must be positive seconds, got {self.e2e_s}")

    def e2e_of(self, name: str) -> float | None:
        """A class's end-to-end target: its own, else the global one (None: none)."""
        own = next((c.e2e_s for c in self.classes if c.name == name), None)
        return own if own is not None else self.e2e_s

    def of(self, name: str) -> tuple[float, float]:
        """A class's (TTFT, gap) targets; a class not given (or "") has the global ones."""
        return next(((c.ttft_s, c.gap_s) for c in self.classes if c.name == name), (self.ttft_s, self.gap_s))

    def _rows(self, p: "Prediction") -> list[tuple[str, float, float, float, float]]:
        """(class, its TTFT, its TTFT target, its gap target, weight) for a prediction: per class of
        the demand, each by its own TTFT and its own targets, where requests name their class
        (Prediction.ttft_by_class); else the one TTFT by every class's targets (the strictest binds)
        or by the global ones (weight 0 beside given classes: it binds, but counts no deadlines)."""
        if p.ttft_by_class:
            return [(name, ttft_s, *self.of(name), share) for name, ttft_s, share in p.ttft_by_class]
        classes = self.classes or (SloClass("", self.ttft_s, self.gap_s),)
        return [(c.name, p.ttft_s, c.ttft_s, c.gap_s, c.share) for c in classes] + \
            ([("", p.ttft_s, self.ttft_s, self.gap_s, 0.0)] if self.classes else [])

    def by_class(self, p: "Prediction") -> list[tuple[str, float, float]]:
        """(class, pressure, weight) for a prediction, each class by its own TTFT and targets (_rows)."""
        return [(name, replace(p, ttft_s=ttft_s).pressure(ttft_target, gap_target, self.tpot_s), share)
                for name, ttft_s, ttft_target, gap_target, share in self._rows(p)]

    def pressure(self, p: "Prediction") -> float:
        """The worst prediction over its target, over every class (a mix must hold the strictest)."""
        return max(x for _, x, _ in self.by_class(p))

    def deadlines_met(self, p: "Prediction", gap_room: float = 1.0) -> float:
        """The predicted share of deadlines met, weighted by class: a class's requests meet their
        TTFT in the share target/TTFT (an arrangement at twice its capacity serves about half in
        time), and the streams among those keep their gaps in the share gap_room x target/gap, and
        their pace (TPOT, when a target) likewise: a request is good only if it meets every deadline,
        so the shares multiply. gap_room < 1 counts a gap as held only with that much to spare: a
        predicted gap within a few per cent of its target is a coin toss, not a deadline met
        (demand_rotation_overload_x2, session 23 on 654a69c: 128-token chunks read 82% met against
        64's 75%, the TTFT alone deciding while their gap sat at 0.96-1.03 of the target, and the
        retrieval streams lost their gaps: 0-1 of 36 against 12 at 64). 1.0 when every class's
        targets hold (with that room)."""
        def share(ttft: float, ttft_target: float, gap_target: float) -> float:
            met = min(1.0, ttft_target / max(ttft, 1e-9)) * min(1.0, gap_room * gap_target / max(p.gap_s, 1e-9))
            return met * min(1.0, self.tpot_s / max(p.tpot_s, 1e-9)) if self.tpot_s else met

        weighted = [(w, share(ttft, ttft_target, gap_target)) for _, ttft, ttft_target, gap_target, w in self._rows(p)
                    if w > 0]
        return sum(w * m for w, m in weighted) / sum(w for w, _ in weighted)


@dataclass(slots=True, frozen=True)
class Decision:
    at_s: float
    reason: str
    instance_id: str | None = None    # None: no change this interval
    from_role: str | None = None
    to_role: str | None = None
    ttft_estimate_s: float | None = None  # predicted for the mix as it is
    gap_estimate_s: float | None = None
    predicted_ttft_s: float | None = None  # for the mix the change leads to
    predicted_gap_s: float | None = None
    # a role change's predicted gain over the horizon and its cost, in pressure-seconds (the SLO
    # pressure a change removes, times the seconds it is expected to keep removing it; the cost: the
    # seconds a change disrupts, measured from past changes, times the pressure then)
    predicted_gain: float | None = None
    predicted_cost: float | None = None
    held: str | None = None                  # why nothing moved, in a word: calm, cost, overload, ...
    overload: bool = False                   # no mix within reach is predicted to meet the targets
    deadlines_met: float | None = None       # the predicted share of deadlines met by the mix as it is
    local_prefill_max_tokens: int | None = None  # the threshold knob set by this decision (None: unchanged)
    chunk_tokens: int | None = None  # the chunk-budget knob set by this decision (None: unchanged)

    def to_dict(self) -> dict:
        return asdict(self)


Change = tuple[str, str]  # (instance id, new role)


@dataclass(slots=True)
class MixController(KnobChoice):
    steps: StepModels | StepModel
    targets: MixTargets
    chunk_budget: int = 256           # colocated instances' max_num_batched_tokens
    margin: float = 0.2               # a mix must lower the worst pressure by this share to be adopted
    calm: float = 0.6                 # nothing moves while every prediction is under this share of its target
    patience: int = 2                 # intervals the same better mix must win before the first change
    cooldown: int = 5                 # intervals after a move during which nothing else moves (no flapping)
    _wanted: str = ""                 # the better mix of the last intervals, by what serves in it
    _streak: int = 0
    _knob_wanted: tuple[int, int] | None = None  # the knob setting winning past every setting, and for how long
    _knob_streak: int = 0
    _knob_left: tuple[int, int] | None = None  # the knob setting the last knob move left
    _knob_note: str = ""  # why the last _choose_knobs left the knobs where they are, when a tie or a bar did
    _since_knob: int = 1 << 30                 # intervals since that move
    _follow: Change | None = None     # the second change of a two-change move, due next interval
    min_samples: int = MIN_SAMPLES    # measured steps before the online model replaces the scaled prior
    prior_weight: float = PRIOR_WEIGHT  # the prior's pseudo-samples, in measured steps' worth
    _since_change: int = 1 << 30
    last: dict = field(default_factory=dict)  # the last interval's predictions, for tests and logs
    horizon_s: float = 60.0           # a move's gain is counted over this many seconds of demand like the last ones
    change_cost_s: float = 5.0        # seconds a role change disrupts until one is measured (conservative)
    undo_bar: float = 3.0             # undoing a move made within the horizon must gain this many times its cost
    # a move must gain this share more than its cost: its gain is the difference of two predictions
    # over the horizon, each with the step model's error (online fit: 3-8% median on a step), so a
    # gain within a tenth of the cost does not tell the move from staying (demand_shift, session 25
    # on 6e40f4f: 2 colocated -> 1 prefill + 1 decode at 116.8 s for a gain of 10.6 against 10.0, and
    # the chats' first gaps became the KV hand-over, 0.25-0.47 s)
    cost_margin: float = 0.1
    pressure_cap: float = 10.0        # past this, pressures are "overloaded" alike (a saturated stage's is noise)
    knob_headroom: float = 0.9        # a knob setting with pressure under this holds the targets with room
    # settings within this share of the best one's pressure (or missed deadlines) count as equal, and
    # the shortest predicted gap of them is taken: a stream's longest pause is its longest step
    knob_tie: float = 0.1
    # ... and, past every setting, those missing at most this many more of the deadlines (a share)
    # than the fewest: near the targets 10% of a few per cent missed is a fraction of a point, finer
    # than the step model reads a TTFT (its online fit's median error is 3-8%)
    knob_tie_points: float = 0.03
    miss_weight: float = 4.0          # a move's gain counts pressure past 1 (deadlines lost) this many times more
    # serve --disagg-policy threshold: the decode instances' local-prefill threshold, the controller's
    # cheaper knob (None: no such knob), and the values it may set
    local_prefill_max_tokens: int | None = None
    thresholds: tuple[int, ...] = (0, 64, 128, 256, 512)
    # the chunk-budget knob (serve --adaptive): the prompt tokens a step carries beside running
    # streams, on every instance; chunk_tokens is what it last set (None: each role's own, a colocated
    # instance's chunk_budget), chunk_choices the values it may take
    chunk_knob: bool = False
    chunk_tokens: int | None = None
    chunk_choices: tuple[int, ...] = (32, 64, 128, 256)
    carry_chunk_tokens: int = CARRIED_CHUNK_TOKENS  # a prefill instance's, beside streams it inherited
    # the server caps each instance's streams as stream_caps() says (serve --adaptive): the what-ifs
    # then read a colocated instance's streams at most at the cap the demand they judge would set
    stream_capped: bool = False
    _history: list = field(default_factory=list)  # (time, demand) over the horizon
    _model_now: StepModel | None = None  # the step model of the last decision (stream caps read it)
    _measured_costs: list = field(default_factory=list)
    _last_move: tuple | None = None   # (time, serving before, serving after)
    _follow_numbers: dict = field(default_factory=dict)  # the gain and cost of the move a second step ends
    online: OnlineStepModels = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"mix margin must be in [0, 1), got {self.margin}")
        if not self.calm > 0:
            raise ValueError(f"mix calm must be positive, got {self.calm}")
        if self.patience < 1 or self.cooldown < 0:
            raise ValueError("mix: patience must be >= 1 and cooldown >= 0 intervals")
        if not (self.horizon_s > 0 and self.change_cost_s >= 0 and self.undo_bar >= 1 and self.cost_margin >= 0
                and self.pressure_cap > 1 and self.miss_weight >= 0):
            raise ValueError("mix: horizon_s > 0, change_cost_s >= 0, undo_bar >= 1, cost_margin >= 0, "
                             "pressure_cap > 1 and miss_weight >= 0")
        if self.min_samples < 1 or not self.prior_weight > 0:
            raise ValueError("mix: min_samples must be >= 1 and prior_weight positive")
        self.online = OnlineStepModels(self.steps, self.prior_weight, self.min_samples)

    # ---- the model ---------------------------------------------------------------------

    def _model(self, views: list[InstanceView]) -> tuple[StepModel, dict, str]:
        """The step model to predict with, its description for GET /admin/mix, and for the reasons:
        the online fit once enough steps are measured, else the prior scaled by _correction."""
        threads = next((v.threads for v in views if v.alive), 1)
        online = self.online.update(threads, [(v.instance_id, v.num_step_samples, v.step_samples)
                                              for v in views if v.threads == threads])
        info = {"threads": threads, **online.describe()}
        if online.ready:
            return online.model, info, (f"model: online fit of {online.num_samples} steps, median error "
                                        f"{online.median_error:.0%} ({describe_model(online.model)}); steps with "
                                        f"prompt tokens x{online.prompt_step_tail:.2f} at their 90th percentile "
                                        f"({online.num_prompt_steps} measured)")
        scale = self._correction(views, online.prior)
        info["scale"] = scale
        return online.prior.scaled(scale), info, (f"model: prior x{scale:.2f} ({online.num_samples} of "
                                                  f"{online.min_samples} steps measured for an online fit)")

    def _correction(self, views: list[InstanceView], model: StepModel) -> float:
        ratios = []
        for v in views:
            if not (v.alive and v.recent_step_s and (v.num_running or v.queued_prompt_tokens)):
                continue
            chunk = min(v.queued_prompt_tokens, self.chunk_budget) if v.role in PREFILL_CAPABLE else 0
            ratios.append(v.recent_step_s / model.step_s(chunk, prefill_attn_ktok2(0, chunk), v.num_running,
                                                         v.decode_kv_tokens))
        return min(max(statistics.median(ratios), 0.5), 3.0) if ratios else 1.0

    @staticmethod
    def covered(views: list[InstanceView], change: Change | tuple[Change, ...] | None = None) -> bool:
        """True if, after `change` (one (instance id, new role) or several), some live instance can
        prefill and one can decode."""
        changes = dict([change] if change and isinstance(change[0], str) else (change or ()))
        roles = [changes.get(v.instance_id, v.role) for v in views if v.alive]
        return any(r in PREFILL_CAPABLE for r in roles) and any(r in DECODE_CAPABLE for r in roles)

    def _candidates(self, views: list[InstanceView]) -> list[tuple[Change, ...]]:
        """Every mix one or two role changes away that keeps both stages covered."""
        live = [v for v in views if v.alive]
        singles = [(v.instance_id, r) for v in live for r in MOVE_ORDER if r != v.role]
        # a pair is made one change at a time: one of its halfway mixes must keep both stages covered too
        pairs = [(x, y) for x, y in itertools.combinations(singles, 2)
                 if x[0] != y[0] and (self.covered(views, x) or self.covered(views, y))]
        return [c for c in [(s,) for s in singles] + pairs if self.covered(views, c)]

    @staticmethod
    def _held(live: list[InstanceView], moved: dict[str, str]) -> list[Held]:
        """What each instance would hold in the mix: an instance turning decode hands its waiting
        prompts back (engine/core.py release_unstarted), and the router places them again on the
        instances that take new work (the colocated ones if any serve, else the prefill ones), spread
        evenly; what it started stays. The engine's report does not split started from waiting, so
        the whole queue is taken to move."""
        roles = {v.instance_id: moved.get(v.instance_id, v.role) for v in live}
        handed = sum(v.queued_prompt_tokens for v in live if roles[v.instance_id] == "decode" != v.role)
        takers = [i for i, r in roles.items() if r == "colocated"] or [i for i, r in roles.items() if r == "prefill"]
        share = handed // len(takers) if takers and handed else 0
        return [Held(roles[v.instance_id],
                     0 if roles[v.instance_id] == "decode" != v.role
                     else v.queued_prompt_tokens + (share if v.instance_id in takers else 0),
                     v.num_running) for v in live]

    @staticmethod
    def _disruption(views: list[InstanceView], changes: tuple[Change, ...]) -> int:
        """Work left in the wrong place by the changes (prompts queued on a new decode instance, streams
        running on a new prefill one): among mixes predicted equal, the one that moves less."""
        by_id = {v.instance_id: v for v in views}
        return sum(by_id[i].queued_prompt_tokens if r == "decode" else
                   by_id[i].num_running if by_id[i].role == "decode" or r == "prefill" else 0 for i, r in changes)

    # ---- deciding ----------------------------------------------------------------------

    def decide(self, views: list[InstanceView], now_s: float = 0.0, demand: Demand | None = None) -> Decision:
        self._since_change += 1
        self._since_knob += 1
        # the last interval's winning knob setting past every setting; it must win again to count
        (knob_wanted, knob_streak), self._knob_wanted, self._knob_streak = (self._knob_wanted, self._knob_streak), None, 0
        demand = demand or Demand()
        self._history = [(t, d) for t, d in self._history if now_s - t < self.horizon_s] + [(now_s, demand)]
        if not self.covered(views):
            self._wanted, self._streak, self._follow = "", 0, None
            return self._rescue(views, now_s)
        live = [v for v in views if v.alive]
        model, info, model_text = self._model(views)
        self._model_now = model
        knob, chunk_now = self.local_prefill_max_tokens or 0, self.chunk_tokens or self.chunk_budget

        tail = info["prompt_step_tail"]  # 1.0 until the online fit has enough prompt steps
        longest = demand.prompt_quantile(1.0)  # the window's longest prompt (0: none)

        def predict(changes: tuple[Change, ...], d: Demand = demand, threshold: int = knob,
                    chunk: int = chunk_now) -> Prediction:
            # the stream cap the server would set for this demand (a few multiplications: not cached)
            cap = (stream_cap(model, "colocated", d, allowance_s(d, self.targets), self.knob_headroom)
                   if self.stream_capped else None)
            return WhatIf(model, chunk, gap_tail=tail, colocated_cap=cap).predict(
                self._held(live, dict(changes)), d, threshold)

        def pressure(p: Prediction) -> float:
            return self.targets.pressure(p)

        roles_now = {v.instance_id: v.role for v in live}

        def options(changes: tuple[Change, ...], d: Demand = demand) -> list[tuple[float, Prediction, tuple]]:
            """(pressure, prediction, (threshold, chunk)) of a mix at every knob setting it may take,
            the knobs as they are first."""
            roles = set({**roles_now, **dict(changes)}.values())
            return [(pressure(p), p, setting) for setting in self._knob_settings(roles)
                    for p in [predict(changes, d, *setting)]]

        def best(changes: tuple[Change, ...], d: Demand = demand) -> tuple[float, Prediction]:
            """A mix judged at the knob setting it would run at: the knobs as they are, unless they
            miss a target and a setting that holds them exists (the knobs move at the intervals after
            a change, by _choose_knobs)."""
            opts = options(changes, d)
            chosen = self._pick_knobs(opts, live, model, tail, longest)
            return opts[chosen if chosen is not None else 0][:2]

        now = predict(())
        p_now = pressure(now)
        met_now = self.deadlines_met(now)
        # streams an instance turning prefill keeps must not step slower than the target (or than now)
        gap_bar = max(self._gap_target(), now.gap_s)
        candidates, stalling = [], []
        for c in self._candidates(views):
            (stalling if self._carried_gap(views, c, model, tail) > gap_bar else candidates).append(c)
        scored = sorted(((p_c, len(c), self._disruption(views, c), c, p)
                         for c in candidates for p_c, p in [best(c)]), key=lambda x: x[:4])
        self.last = {"now": now, "scale": info.get("scale", 1.0), "model": info,
                     "candidates": [(x[3], x[4]) for x in scored]}
        left_out = (f"; {len(stalling)} mix(es) left out: they would step the streams an instance turning "
                    f"prefill carries past {_fmt(gap_bar)} (the gap target, or the worst gap now)") if stalling else ""
        state = f"now {self._describe(now, p_now)}; {demand.describe()}; {model_text}{left_out}"

        def none(held: str, reason: str, **kw) -> Decision:
            if kw.get("overload") and held != "overload":
                # past every mix's capacity whatever stops the move: say so first
                reason = (f"no mix within reach meets the targets; holding {now.serving}, predicted to meet "
                          f"{met_now:.0%} of deadlines, since {held}: {reason}")
                held = "overload"
            return Decision(now_s, f"held ({held}): {reason}", ttft_estimate_s=now.ttft_s, gap_estimate_s=now.gap_s,
                            held=held, deadlines_met=met_now, **kw)

        if self._follow is not None:
            follow, self._follow = self._follow, None
            after = predict((follow,))
            if (self.covered(views, follow) and pressure(after) < p_now * (1 - self.margin)
                    and self._carried_gap(views, (follow,), model, tail) <= gap_bar):
                decision = self._change(views, follow, now, after, now_s, "second of two steps", model_text)
                return Decision(**{**decision.to_dict(), **self._follow_numbers})
            self._since_change = 1 << 30  # a halfway mix left as it is must not wait out a cooldown
        if not scored and not stalling:
            return none("no other mix", f"{state}: no other mix keeps both stages covered")
        # the cheaper knobs first (the local-prefill threshold, the chunk budget), no role changes
        knob_options = options(())
        resting = False
        if p_now < self.calm:
            self._wanted, self._streak = "", 0
            chosen = self._resting_chunk(knob_options, live, model, tail, longest)
            if chosen is None or self._knob_undo(knob_options[chosen][2]):
                return none("calm", f"{state}: every target met with room (under {self.calm:.2f}x)")
            resting = True
        else:
            chosen = self._pick_knobs(knob_options, live, model, tail, longest)
            if self._knob_note:
                state += f"; {self._knob_note}"
        if chosen is not None and not resting:
            p_k, _, setting = knob_options[chosen]
            # back to the setting the knobs left within the cooldown: a higher bar, as for a role
            # (demand_rotation, session 20: 64 -> 128 tokens for a missed TTFT, back to 64 a second
            # later for 0.79x vs 0.99x, on again 4 s later: 64 -> 128 -> 64 -> 128 -> 64 in 7 s)
            undo = self._knob_undo(setting)
            if p_k > 1 and any(x[0] <= 1 for x in scored):
                chosen = None  # no setting holds the targets, but a role change would: weigh that instead
            elif undo and p_now <= 1:
                return none("knob undo", f"{state}: the knobs left {self._setting_text(setting)} "
                                         f"{self._since_knob} interval(s) ago and every target holds now "
                                         f"(there: {p_k:.2f}x); they go back only for a missed target")
            elif p_k > 1 or undo:
                # past every setting, a few deadlines either way just past 1 are noise, and a move
                # back is a flap unless it keeps winning: the same setting must win `patience`
                # intervals running, as a role change must (changing_demand, session 20, on 5ecb415:
                # 64 -> 128 -> 64 -> 128 tokens in 4 s, each for "86% vs 83%", "96% vs 95%", "100% vs
                # 99%" of deadlines)
                self._knob_wanted = setting
                self._knob_streak = knob_streak + 1 if setting == knob_wanted else 1
                if self._knob_streak < self.patience:
                    if p_k <= 1:
                        return none("patience", f"{state}: {self._setting_text(setting)} ({p_k:.2f}x) is where "
                                                f"the knobs were {self._since_knob} interval(s) ago; better for "
                                                f"{self._knob_streak} of {self.patience} intervals")
                    chosen = None
                elif p_k > 1 and demand.newest is not None:
                    # the lesser evil chosen on the window's demand must be chosen on the newest
                    # seconds' too (demand_rotation_overload_x2, session 20: 4 s into a 3.8 req/s
                    # burst the window read 0.87 req/s, 128-token chunks were predicted to meet 85%
                    # of deadlines vs 72%, and the streams that met their TTFT lost their gaps)
                    fresh = options((), demand.newest)
                    agree = self._choose_knobs(fresh)
                    if agree is None or fresh[agree][2] != setting:
                        if self._newest_keeps_gaps(fresh, setting):
                            state += (f"; {self._setting_text(setting)} not chosen on the newest seconds' demand "
                                      f"({demand.newest.describe()}), where no setting holds the targets, but "
                                      f"it keeps the streams' gaps there: the move goes ahead")
                        else:
                            chosen = None
                            state += (f"; the knobs stay: {self._setting_text(setting)} would meet the most deadlines "
                                      f"on the window's demand, not on the newest seconds' ({demand.newest.describe()})")
        if chosen is not None:
            p_k, _, (threshold, chunk) = knob_options[chosen]
            moved = []
            if threshold != knob:
                self.local_prefill_max_tokens = threshold
                moved.append(f"local-prefill threshold {knob} -> {threshold} tokens")
            if chunk != chunk_now:
                self.chunk_tokens = chunk
                moved.append(f"chunk budget {chunk_now} -> {chunk} tokens")
            self._knob_left, self._since_knob = (knob, chunk_now), 0
            held = (f"every target met with room, at rest: a step carrying a whole chunk predicted "
                    f"{_fmt(self._full_step(chunk, live, model, tail, longest))}, within {self.calm:.2f} of the gap target"
                    if resting else
                    "every target met with room" if p_k < self.calm <= p_now <= 1 else "targets held" if p_k <= 1
                    else f"no setting holds the targets; predicted to meet "
                         f"{self.deadlines_met(knob_options[chosen][1]):.0%} of deadlines vs {met_now:.0%}")
            return Decision(now_s, f"{' and '.join(moved)}: predicted pressure {p_k:.2f}x vs {p_now:.2f}x, inter-token "
                                   f"{_fmt(knob_options[chosen][1].gap_s)} vs {_fmt(now.gap_s)}, {held} "
                                   f"without a role change; {state}",
                            ttft_estimate_s=now.ttft_s, gap_estimate_s=now.gap_s,
                            predicted_gain=(p_now - p_k) * self.horizon_s, predicted_cost=0.0, deadlines_met=met_now,
                            local_prefill_max_tokens=threshold if threshold != knob else None,
                            chunk_tokens=chunk if chunk != chunk_now else None)
        if not scored:
            return none("stall", f"{state}: no other mix keeps both stages covered without stalling streams")
        best_p, _, _, move, best_pred = scored[0]
        overload = min(best_p, p_now) > 1
        if overload:
            # the lesser evil: rank by the deadlines the step model predicts each mix meets
            by_met = max(scored, key=lambda x: (self.deadlines_met(x[4]), -x[0]))
            best_p, _, _, move, best_pred = by_met
            met_best = self.deadlines_met(best_pred)
            if not self._beats(best_p, best_pred, p_now, now):
                self._wanted, self._streak = "", 0
                return none("overload", f"{state}: no mix within reach meets the targets; holding {now.serving}, "
                                        f"predicted to meet {met_now:.0%} of deadlines (best other: "
                                        f"{best_pred.serving}, {met_best:.0%}, not {self.margin:.0%} more)", overload=True)
        elif not self._beats(best_p, best_pred, p_now, now):
            self._wanted, self._streak = "", 0
            return none("no better mix", f"{state}: no mix predicts {self.margin:.0%} less pressure (best: "
                                         f"{best_pred.serving}, {best_p:.2f}x)")
        # the same mix (by what serves), whichever instances play which role in it
        self._streak = self._streak + 1 if best_pred.serving == self._wanted else 1
        self._wanted = best_pred.serving
        target = f"{best_pred.serving} ({self._describe(best_pred, best_p)})"
        gain, cost, undo = self._gain_and_cost(move, best, now, p_now, now_s)
        numbers = dict(predicted_gain=gain, predicted_cost=cost, overload=overload)
        if self._since_change <= self.cooldown:
            return none("cooldown", f"{state}: {target} would be better, but the last change was "
                                    f"{self._since_change} interval(s) ago (cooldown {self.cooldown})", **numbers)
        if self._streak < self.patience:
            return none("patience", f"{state}: {target} better for {self._streak} of {self.patience} intervals",
                        **numbers)
        if gain <= cost * (1 + self.cost_margin):
            return none("cost", f"{state}: {target} predicted to gain {gain:.1f} pressure-s over the last "
                                f"{self.horizon_s:.0f} s of demand, not {self.cost_margin:.0%} more than its "
                                f"cost {cost:.1f}"
                                f"{' (undoing a recent move: x' + format(self.undo_bar, 'g') + ')' if undo else ''}",
                        **numbers)
        if demand.newest is not None:
            # chosen on the window's demand, the move must win on the newest seconds' too: the window
            # lags a burst's onset and mixes two regimes at a boundary (demand_rotation, session 20:
            # the first step to 1 prefill + 1 decode at the writing -> summaries boundary, its halfway
            # mix read 4.44x vs 1.68x now, undone 4.6 s later once the summaries filled the window)
            fresh_now = predict((), demand.newest)
            p_fresh, fresh = best(move, demand.newest)
            p_fresh_now = pressure(fresh_now)
            if not self._beats(p_fresh, fresh, p_fresh_now, fresh_now):
                return none("newest", f"{state}: {target} chosen on the window's demand, but not better on "
                                      f"the newest seconds ({demand.newest.describe()}: {p_fresh:.2f}x vs "
                                      f"{p_fresh_now:.2f}x now)", **numbers)
        first = min((c for c in move if self.covered(views, c)),
                    key=lambda c: (pressure(predict((c,))), self._disruption(views, (c,)), c))
        rest = [c for c in move if c != first]
        self._follow = rest[0] if rest else None
        step = (f"first of two steps to {best_pred.serving}; {predict((first,)).serving} serves in between"
                if rest else "")
        self._last_move = (now_s, now.serving, best_pred.serving)
        self._follow_numbers = numbers
        decision = self._change(views, first, now, best_pred, now_s, step, model_text)
        return Decision(**{**decision.to_dict(), **numbers,
                           "reason": f"{decision.reason}; gain {gain:.1f} > cost {cost:.1f} pressure-s{left_out}"})

    def stream_caps(self, views: list[InstanceView], demand: Demand | None) -> dict[str, int | None]:
        """Each live instance's stream cap for this demand (control/stream_cap.py; None: no cap),
        by the step model of the last decision; {} before the first."""
        if self._model_now is None or demand is None:
            return {}
        allowance = allowance_s(demand, self.targets)
        return {v.instance_id: stream_cap(self._model_now, v.role, demand, allowance, self.knob_headroom)
                for v in views if v.alive}

    def deadlines_met(self, p: Prediction) -> float:
        """The share of deadlines a prediction meets as this controller reads it: a gap counts as
        held only with knob_headroom to spare (MixTargets.deadlines_met)."""
        return self.targets.deadlines_met(p, self.knob_headroom)

    def _gap_target(self) -> float:
        return min([self.targets.gap_s] + [c.gap_s for c in self.targets.classes])

    def _carried_gap(self, views: list[InstanceView], changes: tuple[Change, ...], model: StepModel,
                     tail: float = 1.0) -> float:
        """The longest step a change predicts for the streams an instance turning prefill keeps: they
        step there beside chunks of carry_chunk_tokens (the chunk knob's, if set) until they end, at
        the tail of such steps' spread (whatif.WhatIf.gap_tail)."""
        by_id = {v.instance_id: v for v in views}
        carry = self.chunk_tokens or self.carry_chunk_tokens
        gap = WhatIf(model, gap_tail=tail).gap_s
        return max([gap(carry, v.num_running, v.decode_kv_tokens)
                    for i, r in changes for v in [by_id[i]]
                    if r == "prefill" and v.role != "prefill" and v.num_running], default=0.0)

    def _beats(self, p: float, pred: Prediction, p_base: float, base: Prediction) -> bool:
        """A mix predicted at pressure p beats the base by the margin: 20% less pressure, or, where
        neither holds the targets (overload), 20% more of the deadlines met."""
        if min(p, p_base) > 1:
            return self.deadlines_met(pred) > self.deadlines_met(base) * (1 + self.margin)
        return p < p_base * (1 - self.margin)

    def _value(self, p: float) -> float:
        """What a pressure costs, for a move's gain: the pressure itself (capped) while the targets
        hold, and miss_weight times more for the part past them, where deadlines are lost."""
        p = min(p, self.pressure_cap)
        return p + self.miss_weight * max(p - 1.0, 0.0)

    def _difference(self, here: float, there: float) -> float:
        """What moving from a mix at pressure `here` to one at `there` gains for one interval of
        demand: nothing where both are under `calm` (every target met with room in either, and
        nothing moves for room alone), else the difference of their values. So a minute in which
        both mixes were calm does not stand against a move out of a stage that saturates now
        (demand_unseen_overload, session 32: after a minute of documents among chats on 1 prefill +
        1 decode, the move back to 2 colocated for the closing chats, which saturated the one decode
        instance, waited 7 s on a gain of -13.8 .. +11.7 pressure-s against a cost of 10, while 8
        chats went past their TTFT)."""
        if max(here, there) < self.calm:
            return 0.0
        return self._value(here) - self._value(there)

    def _gain_and_cost(self, changes: tuple[Change, ...], best, now: Prediction, p_now: float,
                       now_s: float) -> tuple[float, float, bool]:
        """The move's predicted gain: the capped pressure it removes, averaged over the demand of the
        last horizon (the future is taken to look like it: demand that alternates faster than the
        horizon averages out, so a move good for one phase and bad for the next gains nothing),
        times the horizon. Its cost: the measured seconds of a change per role change, times the
        pressure then (at least 1), and undo_bar times that for undoing a move within the horizon."""
        cap = self.pressure_cap
        diffs = []
        for _, d in self._history:
            diffs.append(self._difference(*(best(c, d)[0] for c in ((), changes))))
        gain = statistics.fmean(diffs) * self.horizon_s
        cost = self.move_cost_s() * len(changes) * max(min(p_now, cap), 1.0)
        target = best(changes)[1].serving
        undo = (self._last_move is not None and now_s - self._last_move[0] < self.horizon_s
                and target == self._last_move[1] and now.serving == self._last_move[2])
        return gain, cost * (self.undo_bar if undo else 1.0), undo


    def record_change_cost(self, seconds: float) -> None:
        """A role change took this long to commit (its drain): later moves are costed from the
        measured ones (their mean, never below half the default: a stall outlasts the drain)."""
        if seconds >= 0:
            self._measured_costs = (self._measured_costs + [seconds])[-16:]

    def move_cost_s(self) -> float:
        if not self._measured_costs:
            return self.change_cost_s
        return max(statistics.fmean(self._measured_costs), self.change_cost_s / 2)

    def change_failed(self) -> None:
        """The last change was refused or failed: a second step planned after it is no longer due."""
        self._follow = None

    def _change(self, views: list[InstanceView], change: Change, now: Prediction, target: Prediction,
                now_s: float, step: str, model_text: str) -> Decision:
        """`target`: the prediction for the mix this change leads to (after its second step, if any)."""
        view = next(v for v in views if v.instance_id == change[0])
        self._since_change = 0
        self._wanted, self._streak = "", 0
        t = self.targets
        full = f" ({' and '.join(now.saturated)} saturated now)" if now.saturated else ""
        reason = (f"{view.instance_id} {view.role} -> {change[1]}{f' ({step})' if step else ''}: predicted "
                  f"inter-token {_fmt(target.gap_s)} vs {_fmt(now.gap_s)} now, TTFT {_fmt(target.ttft_s)} vs "
                  f"{_fmt(now.ttft_s)}{self._tpot_text(target, now)}; pressure {t.pressure(target):.2f}x vs "
                  f"{t.pressure(now):.2f}x{full}; serving {target.serving} instead of {now.serving}; "
                  f"{model_text}")
        return Decision(now_s, reason, view.instance_id, view.role, change[1], now.ttft_s, now.gap_s,
                        target.ttft_s, target.gap_s)

    def _tpot_text(self, target: Prediction, now: Prediction) -> str:
        return f", TPOT {_fmt(target.tpot_s)} vs {_fmt(now.tpot_s)}" if self.targets.tpot_s else ""

    def _describe(self, p: Prediction, pressure: float) -> str:
        full = f", {' and '.join(p.saturated)} saturated" if p.saturated else ""
        tpot = f", TPOT {_fmt(p.tpot_s)} / {_fmt(self.targets.tpot_s)}" if self.targets.tpot_s else ""
        ttft = (", ".join(f"{name or 'unnamed'} {_fmt(t)} / {_fmt(self.targets.of(name)[0])}"
                          for name, t, _ in p.ttft_by_class) if p.ttft_by_class
                else f"{_fmt(p.ttft_s)} / {_fmt(self.targets.ttft_s)}")
        return (f"{p.serving}: TTFT {ttft}, inter-token {_fmt(p.gap_s)} / "
                f"{_fmt(self.targets.gap_s)}{tpot}, pressure {pressure:.2f}x{full}")

    def _rescue(self, views: list[InstanceView], now_s: float) -> Decision:
        """A stage lost its last instance: a survivor turns colocated at once (no patience, no cooldown)."""
        live = [v for v in views if v.alive]
        if not live:
            return Decision(now_s, "no live instance: nothing to change")
        missing = "prefill" if not any(v.role in PREFILL_CAPABLE for v in live) else "decode"
        by_id = {v.instance_id: v for v in live}
        view = by_id[take_over_survivor({v.instance_id: (v.role, v.num_running + v.queued_prompt_tokens)
                                         for v in live})]
        self._since_change = 0
        return Decision(now_s, f"no live instance can {missing}: {view.instance_id} ({view.role}) becomes "
                               "colocated so both stages are served", view.instance_id, view.role, "colocated")

    @staticmethod
    def _none(now_s: float, reason: str, now: Prediction) -> Decision:
        return Decision(now_s, reason, ttft_estimate_s=now.ttft_s, gap_estimate_s=now.gap_s)
