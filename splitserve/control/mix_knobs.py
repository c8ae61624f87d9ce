"""The mix controller's cheaper knobs: which (local-prefill threshold, chunk budget) setting to move to.

MixController (control/mix.py) weighs the knobs before any role change, every interval; this is
the part that chooses among the settings it predicted. Every method reads the controller's own
fields (calm, margin, knob_headroom, knob_tie, knob_tie_points, cooldown, targets, the knob state),
so the class is a mixin with no state of its own.

The streams' longest pause (session 22). A stream's longest pause is its longest step, and the
chunk knob sets it, while the step model tells settings a few per cent apart in TTFT only within its
own error. So settings within `knob_tie` (10%) of the least pressure (or, past every setting, of the
fewest missed deadlines, with a floor of `knob_tie_points`, session 26) count as equal and the
shortest gap of them is taken (the knobs as they are, just past a target but within that tie of the
setting a move would go to, at no longer a gap, stay); a setting holds the targets for a move only
with its gap `knob_headroom` inside the gap target (session 26), and, while some setting holds
them, a budget larger than now only if a whole chunk of the window's longest prompt steps within
the gap target (_pick_knobs, session 26). With every target held and the gap
past `calm` of its target, the knobs move to a setting whose gap is `margin` shorter if it holds the
targets at no more than `knob_tie` more pressure (128 -> 64 tokens: steps of 0.22 s instead of
0.41 s for a TTFT a few per cent longer). And with every target met with room, the chunk budget
rests at the largest whose whole-chunk step is within `calm` of the gap target, if that is smaller
than now and predicted calm too: the predicted gap covers 90% of streams, and while few prompts come
the rest, which meet one, pause for a whole chunk's step (serve's own budget, before the first
decision, or one a burst left behind).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.control.stepmodel import StepModel
from splitserve.control.whatif import Prediction, WhatIf

if TYPE_CHECKING:
    from splitserve.control.mix import InstanceView


def _fmt(x: float) -> str:
    if x == float("inf"):
        return "inf"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


class KnobChoice:
    """The knob choice of MixController (a mixin: no fields; MixController's dataclass has them)."""

    __slots__ = ()

    def _choose_knobs(self, options: list[tuple[float, Prediction, tuple[int, int]]]) -> int | None:
        """options: (pressure, prediction, (threshold, chunk)) per knob setting, the knobs as they
        are first. The index of the setting to move to, or None: the knobs stay while every target
        is met with room (pressure under `calm`) or no setting does better. Between calm and 1
        (targets met, room short) they move, if some setting is `margin` below the pressure now, to
        the shortest-gap one of those predicted calm, else to the least pressure of them: the
        cheaper move where a role change would otherwise be weighed (changing_demand, session
        18: at 256-token chunks the chats read 0.61-0.69x, so the mix went to 1 prefill + 1 decode
        at 2 s and was caught by the documents there, while the repeat whose knob went to 32 tokens
        stayed colocated and met every deadline). While a target is missed: of the settings predicted to hold every target
        with knob_headroom to spare, the one with the shortest predicted gap (a stream's longest
        pause is its longest step; ties: the fewest knobs moved, the nearest values); if none has
        that room, the least pressure that still holds them with the gap knob_headroom inside its
        target (a gap at its edge is a coin toss, and a long pause for every stream on the instance). When none holds them (overload) they
        move to the setting predicted to meet the most deadlines if it misses `margin` fewer than
        now or meets `margin` more (deep in overload the share met is the small number; session 28),
        once it has won `patience` intervals running (decide; changing_demand, session 19: at 32-token chunks the documents' TTFT read 1.09x; once
        a gap is read at the tail of the steps' spread, 128 tokens miss the gap target, so no
        setting holds the targets, and the knobs would stay at the documents' slowest). Session 17 let
        them move there with no margin and flapped the local-prefill threshold 0 <-> 512 past
        every capacity (demand_rotation_overload_x2, docs/benchmarks.md); the local-prompt pricing
        behind that flap was fixed in session 19, and the margin on missed deadlines leaves no
        two settings each better than the other."""
        self._knob_note = ""
        if options[0][0] < self.calm:
            return None
        (t0, c0) = options[0][2]
        keyed = [(x[0], x[1].gap_s, (x[2][0] != t0) + (x[2][1] != c0), abs(x[2][0] - t0), abs(x[2][1] - c0), i)
                 for i, x in enumerate(options)]
        if options[0][0] <= 1:
            # a setting predicted calm, and by the margin below the pressure now: the band between
            # calm and 1 is where predictions sit near their targets, and a smaller step chases noise
            # (demand_rotation, session 19: 32 -> 64 tokens for 0.65x -> 0.57x, 64 -> 32 for 0.60x
            # -> 0.58x, undone 3 s later by a missed target; longer chunks, longer pauses)
            # Below that bar, the shortest-gap setting predicted calm, else the least pressure: the
            # bar a role change must pass too, so the cheaper move is never the harder one to make
            # (changing_demand, session 20: with one document among the first chats, every smaller
            # chunk reads 0.6x or more for its TTFT (reproduced in tests/test_mix_no_flapping.py),
            # not calm, so the knob stayed at 256 (0.97x) and the mix went to 1 prefill + 1 decode
            # for 0.52x at 11.6 s, as session 18 saw)
            below = [k for k in keyed if k[0] < options[0][0] * (1 - self.margin)]
            calm = [k for k in below if k[0] < self.calm]
            chosen = min(calm, key=lambda k: k[1:]) if calm else self._tied(below) if below else None
            if chosen is None:
                chosen = self._shorter_pause(keyed)
            return None if chosen is None or chosen[5] == 0 else chosen[5]
        roomy = [k for k in keyed if k[0] <= self.knob_headroom]
        # a setting holds the targets for a move only with its gap knob_headroom inside the gap
        # target, as deadlines_met counts a gap (demand_unseen_overload, session 25 on 6e40f4f: for
        # the agents' missed TTFT the knobs went 32 -> 128 tokens at 0.98x, the gap predicted 461-481
        # ms against 500, and every stream on that instance paused 0.43 s at one 128-token step;
        # the agents' deadlines held, the pause p99 was 0.43 s against 1P1D's 0.34)
        held = [k for k in keyed if k[0] <= 1 and k[1] <= self.knob_headroom * self._gap_target()]
        target = self._tied(held) if held else None
        holding = min(held, key=lambda k: k[0]) if held else None  # the least pressure that holds
        if (not roomy and target is not None and target[5] != 0
                and keyed[0][0] <= holding[0] * (1 + self.knob_tie) and keyed[0][1] <= target[1]):
            # the knobs as they are miss by less than the model tells apart (knob_tie) from the setting
            # a move would go to, at no longer a gap: they stay (demand_unseen_overload, session 22, on
            # 68dadc0: 64 -> 128 tokens for 1.01x -> 0.97x in two of three repeats, the agents' pauses
            # 0.4 s; the repeat that stayed at 64 met the most agents' deadlines, 47% against 42-43%).
            # Compared with the move's own target, not with every tied setting: session 24 (bf8b48d)
            # had 32 tokens tied on pressure at a shorter gap but missing the target, so the knobs left
            # 64 for 128 at 1.5 s (1.01x vs 0.99x, gap 467 vs 246 ms) and the first agents paused 0.42 s
            self._knob_note = (f"the knobs stay at {self._setting_text(options[0][2])} ({keyed[0][0]:.2f}x, "
                               f"inter-token {_fmt(keyed[0][1])}): within {self.knob_tie:.0%} of "
                               f"{self._setting_text(options[holding[5]][2])} ({holding[0]:.2f}x, inter-token "
                               f"{_fmt(holding[1])}), which the model does not tell apart")
            return None
        chosen = min(roomy, key=lambda k: k[1:]) if roomy else self._tied(held) if held else None
        if chosen is not None:
            return None if chosen[5] == 0 else chosen[5]
        # past every setting: the one predicted to meet the most deadlines, if it misses `margin`
        # fewer than the knobs as they are (two settings cannot each miss fewer than the other);
        # decide() makes the move once the same setting has won `patience` intervals running. Those
        # missing within knob_tie of the fewest count as equal: the shortest gap of them
        # Deep in overload the shares met are the small numbers, and the model's error is relative to
        # them (a share met goes as target / TTFT): a tie on missed deadlines alone, 10% of 80% missed
        # + 3 points, counted 14% and 20% met as equal (demand_unseen_overload, session 27: the agents'
        # bursts at 64-token chunks against 128 and 256, the pair at 256 meeting 85% of agents against
        # the adaptive server's 58%). So a setting ties with the best only within knob_tie of both its
        # missed and its met share, and a move is made for margin fewer missed or margin more met.
        missed = [1 - self.deadlines_met(x[1]) for x in options]
        met = [1 - x for x in missed]
        fewest, most = min(missed), max(met)
        tie = fewest * (1 + self.knob_tie) + self.knob_tie_points + 1e-9
        tied = [j for j in range(len(options))
                if missed[j] <= tie and met[j] * (1 + self.knob_tie) + self.knob_tie_points + 1e-9 >= most]
        i = min(tied, key=lambda j: (options[j][1].gap_s, missed[j], j))
        if i != 0 and (missed[i] <= missed[0] * (1 - self.margin) or met[i] >= met[0] * (1 + self.margin) + 1e-9):
            return i
        top = min(range(len(options)), key=lambda j: (missed[j], j))
        why = (f"{self._setting_text(options[i][2])} would miss {missed[i]:.0%}, not {self.margin:.0%} fewer "
               f"(nor meet {self.margin:.0%} more)"
               if i != 0 else "the fewest of any setting" if top == 0 else
               f"within {self.knob_tie:.0%} + {self.knob_tie_points:.0%} of the fewest ({self._setting_text(options[top][2])}, "
               f"{missed[top]:.0%}), at the shortest gap")
        self._knob_note = (f"the knobs stay at {self._setting_text(options[0][2])}, predicted to miss "
                           f"{missed[0]:.0%} of deadlines: {why}")
        return None

    def _pick_knobs(self, options: list[tuple[float, Prediction, tuple[int, int]]], live: list[InstanceView],
                    model: StepModel, tail: float, longest: int) -> int | None:
        """_choose_knobs among the settings a stream can bear: while some setting holds the targets, a
        chunk budget larger than now is left out if a whole chunk of the window's longest prompt
        steps past the gap target beside the busiest instance's streams (_full_step). The predicted
        gap covers the streams at the attainment share, and while few streams answer they meet no
        prompt in it, so a budget of 256 read a short gap (demand_rotation, session 26 on 25058cc: 32
        -> 256 tokens at 49.6 s for 0.61x against 0.77x, the gap read 264 ms; 2 s later the chats
        that came met 256-token steps deep in a 1,396-token summary, one paused 0.70 s, the gap read
        1.10 s, and the knobs went back to 32 at 52.7 s). Past every setting (overload) all stay in:
        the lesser evil is read on deadlines met."""
        chunk_now, bar = options[0][2][1], self._gap_target()
        keep = [i for i, x in enumerate(options)
                if i == 0 or x[2][1] <= chunk_now or self._full_step(x[2][1], live, model, tail, longest) <= bar]
        if len(keep) == len(options) or not any(options[i][0] <= 1 for i in keep):
            return self._choose_knobs(options)
        chosen = self._choose_knobs([options[i] for i in keep])
        out = sorted({options[i][2][1] for i in range(len(options)) if i not in keep})
        self._knob_note = "; ".join(x for x in (self._knob_note, (
            f"left out: chunk budgets {', '.join(map(str, out))} tokens (a whole chunk of the window's longest "
            f"prompt, {longest} tokens, steps past the gap target beside the busiest instance's streams)")) if x)
        return None if chosen is None else keep[chosen]

    def _full_step(self, chunk: int, live: list[InstanceView], model: StepModel, tail: float,
                   prompt: int = 0) -> float:
        """The longest step a stream may meet at this chunk budget: a whole chunk beside the busiest
        instance's streams (at least one), the last chunk of a `prompt`-token prompt (the window's
        longest), at the tail of prompt steps' spread."""
        busiest = max(live, key=lambda v: (v.num_running, v.decode_kv_tokens))
        return WhatIf(model, gap_tail=tail).gap_s(chunk, max(busiest.num_running, 1), busiest.decode_kv_tokens, prompt)

    def _resting_chunk(self, options: list[tuple[float, Prediction, tuple[int, int]]], live: list[InstanceView],
                       model: StepModel, tail: float, prompt: int = 0) -> int | None:
        """Every target met with room: the index of the chunk budget the knobs rest at, or None if they
        rest where they are. The predicted gap covers the streams at the attainment share (90%), and
        while few prompts come it reads as a decode step at any budget, so the knobs stayed wherever
        the last burst left them, and the few streams that met a prompt paused for a whole chunk's step
        (demand_unseen_overload, session 22: the first 1.7 s at `serve`'s 256 tokens, before the first
        decision, paused four agents 0.58-0.72 s, the pause p99 0.69 s against 1P1D's 0.35). At rest
        the budget is the largest whose whole-chunk step stays within `calm` of the gap target (else
        the smallest), if it is smaller than now and also predicted calm."""
        threshold, chunk_now = options[0][2]
        bound = self.calm * self._gap_target()
        if self._full_step(chunk_now, live, model, tail, prompt) <= bound:
            return None
        smaller = [(x[2][1], i) for i, x in enumerate(options)
                   if x[2][0] == threshold and x[2][1] < chunk_now and x[0] < self.calm]
        fits = [c for c in smaller if self._full_step(c[0], live, model, tail, prompt) <= bound]
        chosen = max(fits) if fits else min(smaller, default=None)
        return None if chosen is None else chosen[1]

    def _tied(self, keyed: list[tuple]) -> tuple:
        """Of knob settings keyed (pressure, gap, ...), those within knob_tie of the least pressure
        count as equal, and the shortest gap of them is taken (demand_shift and demand_unseen_overload,
        session 21: the least pressure, 0.97x at 128-token chunks, was taken over 64, the documents'
        and the agents' TTFT a few per cent longer there and the streams' steps twice as long: the
        pause p99 0.43 and 0.68 s vs 1P1D's 0.39 and 0.33 s)."""
        least = min(k[0] for k in keyed)
        return min((k for k in keyed if k[0] <= least * (1 + self.knob_tie)), key=lambda k: k[1:])

    def _shorter_pause(self, keyed: list[tuple]) -> tuple | None:
        """The targets held without room and no setting `margin` less pressure: a setting whose
        streams' gap is `margin` shorter, still holding the targets at no more than knob_tie more
        pressure, when the gap now is past `calm` of its target (a 128-token chunk's step, 0.41 s of
        0.5, where 64 tokens step in 0.22 s; below calm the pauses are short already, and a smaller
        chunk only chases a TTFT reading near its edge: demand_rotation, session 19). None if none."""
        p0, gap0 = keyed[0][0], keyed[0][1]
        if not gap0 > self.calm * self._gap_target():
            return None
        shorter = [k for k in keyed if k[1] <= gap0 * (1 - self.margin) and k[0] <= min(1.0, p0 * (1 + self.knob_tie))]
        return min(shorter, key=lambda k: k[1:]) if shorter else None

    def _newest_keeps_gaps(self, fresh: list[tuple[float, Prediction, tuple]], setting: tuple) -> bool:
        """Whether a knob setting chosen on the window's demand, past every setting, may go ahead
        though the newest seconds' demand does not choose it: where no setting holds the targets on
        the newest seconds either, every TTFT there is lost many times over and their ranking
        (target / TTFT, a few per cent each, ties broken by the gap) says little; what the newest
        seconds still tell is whether the streams admitted keep their gaps. So the move goes ahead
        unless, on the newest seconds, its gap passes the gap target and the setting now keeps a
        shorter one (demand_unseen_overload, session 29 on an AMX Xeon: at 3.2-4.0 req/s of agents
        every setting read 4-10% met, 64 tokens won there on the tie-break, and the move to 128
        that the window chose, whose gap read under the target, waited 4-5 intervals while the
        agents' TTFTs were lost; demand_rotation_overload_x2, session 20: the move to 128 tokens the
        newest seconds blocked would have lost the writing streams' gaps, which it still blocks)."""
        if any(p <= 1 for p, _, _ in fresh):
            return False
        now = fresh[0][1]  # options() lists the knobs as they are first
        there = next(p for _, p, s in fresh if s == setting)  # the same settings, read on the newest seconds
        target = self._gap_target()
        return there.gap_s <= target or there.gap_s <= now.gap_s

    def _knob_undo(self, setting: tuple[int, int]) -> bool:
        """Moving to `setting` would return the knobs to where the last knob move left, within the cooldown."""
        return setting == self._knob_left and self._since_knob <= self.cooldown

    def _setting_text(self, setting: tuple[int, int]) -> str:
        chunk = f"chunk budget {setting[1]} tokens"
        return chunk if self.local_prefill_max_tokens is None else f"local-prefill threshold {setting[0]}, {chunk}"

    def _knob_settings(self, roles: set[str]) -> list[tuple[int, int]]:
        """(threshold, chunk) settings the knobs may take in a mix with these roles; the first is
        where they are now."""
        knob, chunk_now = self.local_prefill_max_tokens or 0, self.chunk_tokens or self.chunk_budget
        thresholds = tuple(sorted(set(self.thresholds) | {knob})) \
            if self.local_prefill_max_tokens is not None and "decode" in roles else (knob,)
        chunks: tuple[int, ...] = (chunk_now,)
        if self.chunk_knob and roles & {"colocated", "decode"}:
            chunks = tuple(sorted({c for c in self.chunk_choices if c <= self.chunk_budget} | {chunk_now}))
        settings = [(t, c) for t in thresholds for c in chunks]
        return sorted(settings, key=lambda x: x != (knob, chunk_now))
