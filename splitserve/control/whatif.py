"""What if the instances played other roles? An arrangement's TTFT and inter-token gap, predicted
for the demand of the last few seconds with the step-time model (control/stepmodel.py).

A snapshot of queues cannot rank arrangements on its own: the number of running decodes is
itself a result of the arrangement (one decode instance holding every stream steps slower, so
streams pile up on it). So each prediction starts from the demand (requests, prompt and answer
tokens per second over a window, and how long the prompts are) and finds each instance's
steady state under the new work the router would send it, then adds what each instance holds
now, which stays where it is (a role change moves no running stream; the caller says what each
instance holds after it, e.g. an instance turning decode hands its waiting prompts back,
control/mix.py _held):

  router    new requests go to the colocated instances whenever one serves (coordinator/router.py);
            only an arrangement without one splits them over prefill and decode instances.
            A prefill or decode instance beside a colocated one gets no new work.
  colocated instance: prompt tokens at lp/s, answer tokens at ld/s. Busy share of prefill
            f = lp * (c + s * g) (c: seconds per prompt token, attention included at the mean
            prompt length; s: steps with prompt tokens per prompt token at the chunk budget; g:
            such a step's fixed cost, the GGUF panel path and a prompt step's own, stepmodel.py)
            and of decode ld * a (a: seconds per decode, KV reads included). With continuous
            batching its running decodes n satisfy n = ld * o / (1 - f - ld * a) (o: a step's
            fixed cost); its utilisation, for the queueing and for saturation, also counts each
            prompt step's own overhead, lp * s * o (a burst of prompts with few streams runs a
            step per chunk, streams or not).
            A stream's worst gaps are the steps that carry a prefill chunk: o + a * n + the
            chunk of the longest prompt that the stream at the
            attainment target meets (the prompts arriving there while it is prefilled and while it
            answers are Poisson, m on average, so for a share t of streams none of them is longer
            than the 1 + ln(t) / m quantile of recent prompts, t = 0.9; below m = -ln t that share
            meets no prompt at all, and its gaps are decode steps. One chunk of a long prompt is
            enough to break a stream's p99 gap; the chunk is up to the budget, and it is read as
            that prompt's last whole chunk, whose queries score every token before them: deep in
            a long prompt a chunk's step is the longest it brings), that step taken
            at the same share of its measured spread (gap_tail: one slow step is the gap, where a
            prompt's many chunk steps average out in its TTFT). TTFT: the prompt's chunk steps,
            stretched by the queueing factor 1 + u / (2 (1 - u)) of its utilisation u, plus the
            queued prompt tokens ahead.
            Its streams' mean time per token (TPOT): a step of its n decodes, stretched by the
            share of its time that prefill takes, (o + a * n) / (1 - lp * c).
  prefill instance: TTFT of a whole prompt's step, stretched the same way, plus the queue.
  decode instance: n = ld * o / (1 - ld * a); every gap is one decode step, o + a * n, and so is
            its TPOT. Prompts up to the local-prefill threshold it prefills itself, in chunks of
            the budget beside its streams: a local prompt's TTFT is all its chunk steps, the
            queueing wait of the local prompts' mean service, and the prompt tokens queued there
            ahead of it, chunked the same way. (Those queued tokens also chunk its streams' steps
            while they last; the gap leaves that transient out, as a decision's horizon outlasts it.)
  running decodes now, spread evenly, set a floor under n (a backlog takes time to drain).
  stream cap (colocated_cap, where the server caps an instance's streams: serve --adaptive,
            control/stream_cap.py): a colocated instance admits no prompt past it, so its n is at
            most the cap (or what it holds now, never evicted); the requests past it wait in its
            queue, which its utilisation, past 1 there, already reads as a TTFT the queue sets.
            Without the bound the fluid n of an overload (its slack held at MIN_SLACK) put dozens
            of streams beside each chunk: demand_unseen_overload, session 29 on an AMX Xeon, at
            the newest seconds' 3.2-4.0 req/s a 128-token chunk's gap read 0.53-0.60 s where the
            instances, capped at 21-23 streams, stepped it at 0.30-0.37 s.

Per SLO class (requests that name one: `slo_class` in the body; serve --slo-classes gives each
class its targets): a class's TTFT is its own prompts' service (its mean prompt, chunked as above
or whole on a prefill instance) plus the wait every arrival meets at that instance (the queueing
factor times the mean prompt's service, and the queued prompt tokens ahead). So a burst of long
summaries with a 15 s TTFT target is judged by their own service against 15 s, and the chats
queued behind them by their short service plus that wait against theirs.

An instance past its capacity is held at 2% slack: its prediction is large but finite, so a
less overloaded arrangement still ranks better.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.control.stepmodel import StepModel, prefill_attn_ktok2

MIN_SLACK = 0.02  # 1 - utilisation, for an instance given more work than it can do


@dataclass(slots=True, frozen=True)
class ClassDemand:
    """The requests of one SLO class among the prompt window's."""

    name: str
    share: float                   # its share of the window's requests
    mean_prompt: float
    prompts: tuple[int, ...] = ()  # its prompt lengths, sorted
    mean_answer: float = 0.0       # its requests' mean max_tokens


@dataclass(slots=True, frozen=True)
class Demand:
    """What arrived over the last window, per second, and how long it was."""

    request_rate: float = 0.0
    prompt_rate: float = 0.0       # prompt tokens/s
    answer_rate: float = 0.0       # answer tokens/s (each request's max_tokens)
    mean_prompt: float = 0.0
    mean_answer: float = 0.0
    prompts: tuple[int, ...] = ()  # the window's prompt lengths, sorted
    # per SLO class, over the prompt window; () when no request there named one
    classes: tuple[ClassDemand, ...] = ()
    # the same read over only the newest few seconds (rates and prompts alike; None: not read): a
    # move chosen on the window's demand must also hold on it, since the window lags a burst's onset
    # and mixes two regimes at a boundary (MixController.decide)
    newest: "Demand | None" = None

    def prompt_quantile(self, q: float) -> int:
        if not self.prompts:
            return 0
        return self.prompts[min(len(self.prompts) - 1, max(0, int(q * len(self.prompts))))]

    @classmethod
    def from_arrivals(cls, arrivals: list[tuple], now_s: float, window_s: float,
                      prompt_window_s: float | None = None, newest_s: float | None = None) -> "Demand":
        """arrivals: (time, prompt tokens, max answer tokens[, SLO class name]), any order; rates
        from those in (now - window_s, now], prompt lengths and classes from a window of
        prompt_window_s (default the same): a longer one, since a few documents a minute already
        stall colocated streams. Requests that name no class ("") count as one class "" when
        others do. newest_s: also read the newest that many seconds alone, as `newest`."""
        newest = cls.from_arrivals(arrivals, now_s, newest_s) if newest_s else None
        recent = [(x[1], x[2]) for x in arrivals if now_s - window_s < x[0] <= now_s]
        prompt_window_s = prompt_window_s or window_s
        window = [(x[1], x[3] if len(x) > 3 else "", x[2]) for x in arrivals
                  if now_s - prompt_window_s < x[0] <= now_s]
        prompts = tuple(sorted(p for p, _, _ in window))
        classes: tuple[ClassDemand, ...] = ()
        if any(name for _, name, _ in window):
            by_name: dict[str, list[tuple[int, int]]] = {}
            for p, name, a in window:
                by_name.setdefault(name, []).append((p, a))
            classes = tuple(ClassDemand(name, len(pa) / len(window), sum(p for p, _ in pa) / len(pa),
                                        tuple(sorted(p for p, _ in pa)), sum(a for _, a in pa) / len(pa))
                            for name, pa in sorted(by_name.items()))
        if not recent:
            return cls(prompts=prompts, classes=classes, newest=newest)
        n = len(recent)
        return cls(request_rate=n / window_s, prompt_rate=sum(p for p, _ in recent) / window_s,
                   answer_rate=sum(a for _, a in recent) / window_s, mean_prompt=sum(p for p, _ in recent) / n,
                   mean_answer=sum(a for _, a in recent) / n, prompts=prompts, classes=classes, newest=newest)

    def describe(self) -> str:
        return (f"demand {self.request_rate:.2f} req/s, {self.prompt_rate:.0f} prompt + {self.answer_rate:.0f} "
                f"answer tokens/s, prompts p90 {self.prompt_quantile(0.9)} max {self.prompt_quantile(1.0)}")


@dataclass(slots=True, frozen=True)
class Held:
    """One live instance: the role it would play, and what it holds now (it keeps it)."""

    role: str
    queued_prompt_tokens: int = 0
    num_running: int = 0


@dataclass(slots=True, frozen=True)
class Prediction:
    ttft_s: float
    gap_s: float
    serving: str                   # which instances take new work, e.g. "2 colocated"
    saturated: tuple[str, ...] = ()  # the stages given more work than they can do
    tpot_s: float = 0.0            # a stream's mean time per output token (the slowest instance's)
    # per SLO class of the demand: (name, TTFT, share of requests); () when requests name none
    ttft_by_class: tuple[tuple[str, float, float], ...] = ()

    def pressure(self, ttft_target_s: float, gap_target_s: float, tpot_target_s: float | None = None) -> float:
        """The worst prediction over its target. The gap is the worst stutter a stream sees; TPOT,
        when a target is given, is how fast answers stream on average (an end-to-end deadline on
        long answers is a TPOT target in disguise)."""
        worst = max(self.ttft_s / ttft_target_s, self.gap_s / gap_target_s)
        return max(worst, self.tpot_s / tpot_target_s) if tpot_target_s else worst


def _queueing(u: float) -> float:
    """Mean wait in units of the service time, M/D/1 (Pollaczek-Khinchine with no service variance)."""
    return u / (2 * (1 - u))


@dataclass(slots=True, frozen=True)
class WhatIf:
    model: StepModel
    chunk_budget: int = 256
    attainment: float = 0.9  # the share of streams whose worst gap the prediction covers
    gap_tail: float = 1.0    # a step carrying prompt tokens, at that share of its spread, over the model's mean
                             # (online_stepmodel.OnlineStepModel.prompt_step_tail): a gap is one step, not a mean
    colocated_cap: int | None = None  # the streams a colocated instance may hold (None: no cap)

    def gap_s(self, chunk: int, n: int, kv: int, prompt: int = 0) -> float:
        """The gap a stream meets at a step with a `chunk`-token prompt piece beside n decodes: the
        last whole chunk of a `prompt`-token prompt (0: the prompt's first chunk), whose queries
        score every token before them. A chunk deep in a long prompt is the longest step it brings
        (demand_rotation, session 24: 64-token chunks at tokens 1,050-1,200 of a summary, 67-76
        attention ktok2 where a first chunk scores 2, stepped 0.38-0.50 s beside 7 streams, the
        longest pauses of the run, while the gap read for a first chunk was about 0.2 s)."""
        start = max(prompt - chunk, 0)
        step = self.model.step_s(chunk, prefill_attn_ktok2(start, chunk), n, kv)
        return step * self.gap_tail if chunk > 0 else step

    @staticmethod
    def _prompt_steps_per_token(prompts: tuple[int, ...] | list[int], mean_prompt: float, budget: int) -> float:
        """Steps that carry prompt tokens, per prompt token, at `budget` tokens a step: the prompts
        cut into chunks (a 300-token prompt is 5 steps at 64 tokens, 2 at 256); with none listed,
        a prompt of the mean length."""
        if prompts:
            return sum(-(-p // budget) for p in prompts) / max(sum(prompts), 1)
        mean = max(mean_prompt, 1.0)
        return math.ceil(mean / budget) / mean

    def _per_token(self, demand: Demand) -> tuple[float, float, float]:
        """(c, a, context): seconds per prompt token and per decode, and a decode's mean context."""
        m = self.model
        c = m.per_prefill_token_s + m.per_prefill_attn_s * demand.mean_prompt / 2000.0
        context = demand.mean_prompt + demand.mean_answer / 2
        return c, m.per_decode_seq_s + m.per_decode_kv_token_s * context, context

    def predict(self, held: list[Held], demand: Demand, local_max_tokens: int = 0) -> Prediction:
        """held: one per live instance. local_max_tokens: a separated mix's decode instances prefill
        prompts up to this long themselves (serve --disagg-policy threshold); 0: every prompt remote."""
        colocated = [h for h in held if h.role == "colocated"]
        if colocated:
            return self._colocated(colocated, demand)
        prefill, decode = [h for h in held if h.role == "prefill"], [h for h in held if h.role == "decode"]
        if not (prefill and decode):
            return Prediction(math.inf, math.inf, "no instance for a stage", ("prefill", "decode"))
        return self._separated(prefill, decode, demand, local_max_tokens)

    def _chunk(self, tokens: float) -> int:
        return int(min(self.chunk_budget, tokens))

    def _chunked_s(self, tokens: int, n: int, kv: int) -> float:
        """One prompt of `tokens` prefilled in chunks of the budget, each step beside n decodes."""
        m = self.model
        return sum(m.step_s(self._chunk(tokens - s), prefill_attn_ktok2(s, self._chunk(tokens - s)), n, kv)
                   for s in range(0, max(int(tokens), 0), self.chunk_budget))

    def _colocated(self, serving: list[Held], demand: Demand) -> Prediction:
        m, k = self.model, len(serving)
        c, a, context = self._per_token(demand)
        lp, ld = demand.prompt_rate / k, demand.answer_rate / k
        # Each step that carries prompt tokens pays a fixed cost beside them: the GGUF panel path
        # (per_panel_step_s), and its own overhead where no stream's step would have run anyway. So
        # the chunk budget sets how much an instance's prompt work costs, not only its pauses
        # (demand_unseen_overload, session 27 on an AMX Xeon: 64-token chunks stepped 164-176 ms, 366
        # prompt tokens/s, 256-token chunks 400-420 ms, 610/s; a line per token read them alike, so
        # every budget looked as overloaded in the agents' bursts and the shortest pause won).
        steps = self._prompt_steps_per_token(demand.prompts, demand.mean_prompt, self.chunk_budget)
        c_panel = c + steps * m.prompt_step_fixed_s
        u = lp * (c_panel + steps * m.overhead_s) + ld * a  # busy share; past 1 the prompt steps alone overrun
        # the streams step with the prompt chunks, so their steps' overhead is what the rest leaves
        slack = max(1 - (lp * c_panel + ld * a), MIN_SLACK)
        fluid_n = ld * m.overhead_s / slack
        gaps, ttfts, tpots = [], [], []
        prompt = max(int(demand.mean_prompt), 1)
        decode_share = max(1 - lp * c_panel, MIN_SLACK)  # the share of its time not spent on prompts
        c_queued = c + (m.overhead_s + m.prompt_step_fixed_s) / max(self.chunk_budget, 1)
        by_class: list[list[float]] = [[] for _ in demand.classes]
        capped = min(fluid_n, self.colocated_cap) if self.colocated_cap else fluid_n
        for h in serving:
            n = math.ceil(max(capped, h.num_running))
            kv = int(n * context)
            decode_step = m.step_s(0, 0.0, n, kv)
            tpots.append(decode_step / decode_share)

            def service_of(tokens: int) -> float:
                return self._chunked_s(tokens, n, kv)

            service = service_of(prompt)
            chunk = self._chunk(h.queued_prompt_tokens)
            # the queued prompts' chunks: as deep as the window's longest prompt reaches. With no
            # prompt in the window the queue's prompt lengths are unknown and its chunks are read as
            # first chunks: the queued tokens are many prompts' sum, not one prompt's depth
            # (demand_rotation_overload_x2, session 25 on 6e40f4f: 70 s after the last arrival the
            # backlog read as one prompt of its whole size put a 32-token chunk's step at 372 ms, and
            # a spurious role change followed at 112-113 s in every repeat)
            depth = min(h.queued_prompt_tokens, demand.prompt_quantile(1.0))
            if demand.prompts:
                # the prompts whose chunks a stream's steps carry: those arriving while it is prefilled
                # and while it answers (its steps, prefills among them), m of them on average
                life_s = service + demand.mean_answer * decode_step / slack
                meets = demand.request_rate / k * life_s
                share = 1 + math.log(self.attainment) / meets if meets > 0 else 0.0
                if share > 0:  # else that share of streams meets no prompt at all
                    met = demand.prompt_quantile(share)
                    chunk, depth = max(chunk, self._chunk(met)), max(depth, met)
            gaps.append(self.gap_s(chunk, n, kv, depth))
            wait = service * _queueing(min(u, 1 - MIN_SLACK)) + h.queued_prompt_tokens * c_queued
            ttfts.append(service + wait)
            for ttft_c, cls in zip(by_class, demand.classes):
                ttft_c.append(service_of(max(int(cls.mean_prompt), 1)) + wait)
        return Prediction(min(ttfts), max(gaps), f"{k} colocated", ("colocated",) if u >= 1 - MIN_SLACK else (),
                          max(tpots), tuple((cls.name, min(t), cls.share) for cls, t in zip(demand.classes, by_class)))

    def _separated(self, prefill: list[Held], decode: list[Held], demand: Demand,
                   local_max_tokens: int = 0) -> Prediction:
        """Prompts up to local_max_tokens (by the window's prompt lengths) are prefilled on the decode
        instances, in chunks beside their streams; the rest go through the prefill instances. The TTFT
        is the one at the attainment share of requests (the faster group's if it holds that share)."""
        m = self.model
        c, a, context = self._per_token(demand)
        local = [p for p in demand.prompts if p <= local_max_tokens] if local_max_tokens > 0 else []
        share = len(local) / len(demand.prompts) if demand.prompts else 0.0
        local_mean = sum(local) / len(local) if local else 0.0
        remote_rate = max(demand.prompt_rate - demand.request_rate * share * local_mean, 0.0)
        remote_mean = max(int((demand.prompt_rate - demand.request_rate * share * local_mean)
                              / max(demand.request_rate * (1 - share), 1e-9)), 1) if share < 1 else 1
        prompt = max(int(demand.mean_prompt), 1) if not local else remote_mean
        service = m.step_s(prompt, prefill_attn_ktok2(0, prompt))
        # a whole prompt a step: each pays the step's overhead, the GGUF panel path and a prompt step's own cost once
        u_prefill = (remote_rate * c + demand.request_rate * (1 - share) * (m.overhead_s + m.prompt_step_fixed_s)) \
            / len(prefill)
        wait = (service * _queueing(min(u_prefill, 1 - MIN_SLACK))
                + min(h.queued_prompt_tokens for h in prefill) * c)
        ttft = service + wait
        ld = demand.answer_rate / len(decode)
        local_rate = demand.request_rate * share * local_mean / len(decode)  # prompt tokens/s on each
        # local prompts in chunks beside the streams, each chunk's step paying the panel path (and its
        # overhead where no stream's step would have run), as on a colocated instance
        local_steps = self._prompt_steps_per_token(local, 0.0, self.chunk_budget) if local else 0.0
        c_local = c + local_steps * m.prompt_step_fixed_s
        u_decode = ld * a + local_rate * (c_local + local_steps * m.overhead_s)
        fluid_n = ld * m.overhead_s / max(1 - (ld * a + local_rate * c_local), MIN_SLACK)
        gaps, decodes = [], []
        chunk = self._chunk(max(local)) if local else 0
        for h in decode:
            n = math.ceil(max(fluid_n, h.num_running))
            kv = int(n * context)
            gaps.append(self.gap_s(chunk, n, kv, max(local) if local else 0))
            decodes.append((n, kv, h.queued_prompt_tokens))
        q_decode = _queueing(min(u_decode, 1 - MIN_SLACK))

        def local_ttft(tokens: float) -> float:
            """A local prompt's chunk steps beside the instance's streams, the queueing wait of the
            local prompts' mean service, and the prompt tokens queued there ahead of it (chunked
            as the arrivals are): on the decode instance the router would pick, the least waiting."""
            own, typical = max(int(tokens), 1), max(int(local_mean), 1)
            return min(self._chunked_s(own, n, kv) + self._chunked_s(typical, n, kv) * (q_decode + queued / typical)
                       for n, kv, queued in decodes)

        def ttft_of(local_share: float, local_mean_tokens: float, remote_tokens: float) -> float:
            """The TTFT at the attainment share: the faster group's if it holds that share."""
            remote = m.step_s(max(int(remote_tokens), 1), prefill_attn_ktok2(0, max(int(remote_tokens), 1))) + wait
            if local_share <= 0:
                return remote
            fast, slow = sorted(((local_ttft(local_mean_tokens), local_share), (remote, 1 - local_share)))
            return fast[0] if fast[1] >= self.attainment else slow[0]

        if local:
            ttft = ttft_of(share, local_mean, prompt)
        by_class = []
        for cls in demand.classes:
            mine = [p for p in cls.prompts if p <= local_max_tokens] if local_max_tokens > 0 else []
            rest = [p for p in cls.prompts if p > local_max_tokens] if mine else list(cls.prompts)
            by_class.append((cls.name, ttft_of(len(mine) / max(len(cls.prompts), 1),
                                               sum(mine) / len(mine) if mine else 0.0,
                                               sum(rest) / len(rest) if rest else cls.mean_prompt), cls.share))
        saturated = tuple(stage for stage, u in (("prefill", u_prefill), ("decode", u_decode)) if u >= 1 - MIN_SLACK)
        return Prediction(ttft, max(gaps), f"{len(prefill)} prefill + {len(decode)} decode", saturated, max(gaps),
                          tuple(by_class))
