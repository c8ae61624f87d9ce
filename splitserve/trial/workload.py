"""What each request asks: real text cut to an exact number of tokens, and a fixed answer length.

The bundled public-domain texts (splitserve/data/) are tokenized once with the served model's
tokenizer into one long token stream; a prompt of n tokens is a window of that stream at a
seeded offset (wrapping around), with the class's question appended, so prompts are sent as
token ids and their lengths are exact. Answers use ignore_eos, so every arrangement generates
exactly `max_tokens` tokens per request.
"""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from splitserve.trial.arrivals import Arrival, generate_arrivals
from splitserve.trial.classes import Patience
from splitserve.trial.spec import SpecError, TrialSpec

Tokenize = Callable[[str], list[int]]
DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data"


@dataclass(slots=True)
class PlannedRequest:
    index: int
    class_name: str
    send_at_s: float                # seconds after the trial's start
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int | None = None     # the class's, sent in the request body
    patience: Patience | None = None  # the class's: when its client gives up

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def bundled_text() -> str:
    """All bundled texts joined, in a fixed order so the token stream is reproducible."""
    paths = sorted(DATA_DIR.glob("*.txt"))
    if not paths:
        raise FileNotFoundError(f"no bundled prompt text in {DATA_DIR}; reinstall splitserve")
    return "\n\n".join(p.read_text() for p in paths)


class PromptSource:
    """Cuts windows of exact length from one token stream of real text."""

    def __init__(self, tokenize: Tokenize, text: str | None = None):
        self.tokenize = tokenize
        self.stream = tokenize(text if text is not None else bundled_text())  # [num_corpus_tokens]
        if len(self.stream) < 16:
            raise ValueError(f"the prompt text tokenized to only {len(self.stream)} tokens; give more text")
        self._questions: dict[str, list[int]] = {}

    def question_tokens(self, question: str) -> list[int]:
        if question not in self._questions:
            self._questions[question] = self.tokenize(question)
        return self._questions[question]

    def prompt(self, num_tokens: int, rng: np.random.Generator, question: str | None = None) -> list[int]:
        tail = self.question_tokens(question) if question else []
        body = num_tokens - len(tail)
        if body < 1:
            raise SpecError(f"a prompt of {num_tokens} tokens cannot hold its question of {len(tail)} tokens; "
                            "raise the class's prompt_tokens min or shorten the question")
        start = int(rng.integers(0, len(self.stream)))
        stream = np.asarray(self.stream)
        positions = (start + np.arange(body)) % len(stream)  # wrap around: any length fits
        return stream[positions].tolist() + tail


@dataclass(slots=True, frozen=True)
class RequestShape:
    """What a planned request asks, without its text: what the trial sends and the planner simulates."""

    index: int
    class_name: str
    send_at_s: float
    num_prompt_tokens: int
    max_tokens: int
    priority: int | None = None
    patience: Patience | None = None
    question: str | None = None


def request_shapes(spec: TrialSpec, arrivals: list[Arrival], rng: np.random.Generator) -> list[RequestShape]:
    """Give each arrival a class (from the arrival or the mix) and lengths. The one place these
    draws are made: the trial (plan_requests) and the planner (spec_shapes) both call it, so a
    seed gives them the same requests by construction."""
    names = list(spec.mix)
    weights = np.asarray([spec.mix[n] for n in names], dtype=float)
    weights /= weights.sum()
    shapes = []
    for index, arrival in enumerate(arrivals):
        class_name = arrival.class_name or names[int(rng.choice(len(names), p=weights))]
        cls = spec.classes.get(class_name)
        if arrival.prompt_tokens is not None:
            num_prompt = arrival.prompt_tokens
        elif cls is not None:
            num_prompt = cls.prompt_tokens.sample(rng)
        else:
            raise SpecError(f"arrivals: class {class_name!r} has no lengths; define it under workload.classes")
        num_answer = arrival.answer_tokens if arrival.answer_tokens is not None else cls.answer_tokens.sample(rng)
        shapes.append(RequestShape(index, class_name, arrival.time_s, int(num_prompt), int(num_answer),
                                   cls.priority if cls is not None else None,
                                   cls.patience if cls is not None else None,
                                   cls.question if cls is not None else None))
    return shapes


def spec_shapes(spec: TrialSpec) -> list[RequestShape]:
    """The requests a trial of `spec` plans (before any text is cut): its seed's arrival stream,
    then its content stream's classes and lengths."""
    arrival_rng, content_rng = workload_streams(spec.seed)
    return request_shapes(spec, generate_arrivals(spec.arrivals, arrival_rng), content_rng)


def plan_requests(spec: TrialSpec, arrivals: list[Arrival], source: PromptSource,
                  rng: np.random.Generator) -> list[PlannedRequest]:
    """Each arrival's class and lengths (request_shapes), then its prompt tokens: every text
    offset is drawn after every length, so the text never moves the lengths."""
    return [PlannedRequest(s.index, s.class_name, s.send_at_s, source.prompt(s.num_prompt_tokens, rng, s.question),
                           s.max_tokens, s.priority, s.patience)
            for s in request_shapes(spec, arrivals, rng)]


def recut(plan: list[PlannedRequest], spec: TrialSpec, source: PromptSource,
          rng: np.random.Generator) -> list[PlannedRequest]:
    """The same requests (class, send time, prompt and answer lengths) with their prompts cut
    from other places of the text. A server keeps a prefix cache: replaying the very same
    prompts (a sweep's next rate, or a warm-up) would find them cached and skip their prefill."""
    out = []
    for req in plan:
        cls = spec.classes.get(req.class_name)
        question = cls.question if cls is not None else None
        out.append(dataclasses.replace(req, prompt_token_ids=source.prompt(req.num_prompt_tokens, rng, question)))
    return out


def probe_length(plan: list[PlannedRequest], multiplier: float, min_requests: int,
                 min_seconds: float | None) -> int:
    """How many requests a capacity probe at `multiplier` replays: at least `min_requests`, and
    enough that its arrivals span `min_seconds` of real time at that rate. A fixed count would make
    a probe at a high rate a burst of a few seconds, decided by a single slow request; a span gives
    every probed rate a steady state of the same length. May exceed the plan: see `tiled`."""
    if not plan or min_seconds is None:
        return min_requests
    period = plan_period(plan)
    if period <= 0:
        return max(min_requests, len(plan))
    horizon = min_seconds * multiplier        # plan-time seconds covered by the probe's span
    whole, rest = divmod(horizon, period)
    within = sum(1 for r in plan if r.send_at_s - plan[0].send_at_s < rest)
    return max(min_requests, int(whole) * len(plan) + within)


def plan_period(plan: list[PlannedRequest]) -> float:
    """The plan's span plus one mean gap: tiling the plan at this period keeps its rate."""
    if len(plan) < 2:
        return 0.0
    span = plan[-1].send_at_s - plan[0].send_at_s
    return span + span / (len(plan) - 1)


def tiled(plan: list[PlannedRequest], count: int, copy_text) -> list[PlannedRequest]:
    """The plan's first `count` requests, repeating the plan (same classes, lengths and gaps, one
    period later each time) when `count` exceeds it. `copy_text(plan, k)` gives the k-th copy
    (k >= 1) its own prompt text, so no copy finds its prompts in the prefix cache."""
    if count <= len(plan):
        return plan[:count]
    out, period, k = list(plan), plan_period(plan), 1
    while len(out) < count:
        shifted = [dataclasses.replace(r, index=r.index + k * len(plan), send_at_s=r.send_at_s + k * period)
                   for r in copy_text(plan, k)]
        out.extend(shifted[: count - len(out)])
        k += 1
    return out


def content_stream(seed: int, run: int) -> np.random.Generator:
    """Prompt contents for replay `run` (-1: the warm-up); the same for every arrangement."""
    return np.random.default_rng(np.random.SeedSequence([seed, 1_000_000 + run + 1]))


def workload_streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent streams for arrivals and contents: changing the mix never moves arrival times."""
    arrival_seq, content_seq = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(arrival_seq), np.random.default_rng(content_seq)
