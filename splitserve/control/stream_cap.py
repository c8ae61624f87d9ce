"""The stream cap: how many streams an instance may hold before more would make every one late.

Past capacity a colocated instance that admits every prompt slows every stream it holds: each
step carries more decodes and the admitted prompts' chunks, and answers that need a steady pace
end past their deadlines together (demand_rotation_overload_x2, session 26: the adaptive server
admitted all 52 writing requests of a 10 s surge within 0.6 s of each, stepped at about 0.35 s a
token, and none of them answered within its 40 s; the separated pair's first four, on a decode
instance the backlog had not reached, did). A cap holds the requests past it in the queue, where
they wait for a stream to end, and keeps the pace of those admitted.

The cap is the most streams whose steps, as the step model reads them, keep each class's
per-token allowance: its gap target (and the TPOT target, when one is set), and, where the class
has an end-to-end target, (e2e - TTFT target) / its mean answer length (what is left of the
deadline once the first token came as late as allowed, over the tokens still to come; at least
half the e2e target). The strictest class among those with at least MIN_SHARE of the window's
requests binds, times `headroom`. A step of n streams costs

    fixed + n * (per decode + per KV token * context + prompt work per stream)

where prompt work per stream is what admitting the stream's successors costs: in a steady state
every stream that ends lets one prompt in, so each of n streams brings a prompt's prefill once
per answer (per prefill token * mean prompt / mean answer) into the steps; the prompts arriving in
the newest seconds where they are lighter than the window's (successor_s). A decode instance
prefills only what its local threshold keeps, which this leaves out. A prefill instance holds no
streams of its own: no cap.

Below capacity the cap is not reached (the streams that run are fewer); it bites where admitting
one more would make the steps too slow for the strictest class to meet its deadlines. It never
evicts a running stream, and it never holds a prompt that ends on its first token (a prefill
instance's) or a stream that has begun its answer (handed over with its first token, or
preempted): those would pause with the client waiting (Scheduler.max_streams). So on a decode
instance it holds only the prompts it prefills itself; a separated mix's streams are not capped.
"""
from __future__ import annotations

import math

from splitserve.control.stepmodel import StepModel
from splitserve.control.whatif import Demand

MIN_SHARE = 0.1  # a class with fewer of the window's requests does not set the allowance alone
NO_CAP = 256  # a cap this large is no cap (max_num_seqs defaults to 64)


def allowance_s(demand: Demand, targets) -> float | None:
    """The strictest per-token allowance, seconds, of the classes in the window (None: no demand).
    targets: a MixTargets (of(name) -> (TTFT, gap); e2e_of(name) -> e2e or None)."""
    if demand.request_rate <= 0 and not demand.classes:
        return None
    rows = [(c.name, c.mean_answer or demand.mean_answer) for c in demand.classes if c.share >= MIN_SHARE]
    if not rows:
        rows = [("", demand.mean_answer)]
    best = math.inf
    for name, answer in rows:
        ttft, gap = targets.of(name)
        a = min(gap, targets.tpot_s) if targets.tpot_s else gap
        e2e = targets.e2e_of(name)
        if e2e is not None and answer >= 1:
            a = min(a, max(e2e - ttft, e2e / 2) / answer)
        best = min(best, a)
    return best if math.isfinite(best) else None


def successor_s(model: StepModel, demand: Demand) -> float:
    """A colocated stream's share of its successor's prompt work, seconds a step: the prompt's tokens
    and its step (at least one) over the answer's steps. The successors are the prompts arriving
    now, so where the newest seconds' prompts read lighter than the window's, theirs count: at a
    phase boundary from long prompts to short ones the window still holds the long ones
    (demand_rotation, session 30: 2-3 streams an instance at 39.6-40.6 s, the window full of
    1,300-token summaries, while the chats of the next phase came and waited 4.0-5.0 s for a first
    token). Heavier newest seconds are not taken over the window (five seconds may hold one
    document among chats); the window catches up within its own length."""
    def share(d: Demand) -> float:
        return (model.per_prefill_token_s * d.mean_prompt + model.per_prompt_step_s) / max(d.mean_answer, 1.0)

    window = share(demand)
    newest = demand.newest
    if newest is not None and newest.request_rate > 0:
        return min(window, share(newest))
    return window


def stream_cap(model: StepModel, role: str, demand: Demand, allowance: float | None,
               headroom: float = 0.9) -> int | None:
    """The most streams an instance of `role` may hold (None: no cap; see the module's text)."""
    if role == "prefill" or allowance is None:
        return None
    answer = max(demand.mean_answer, 1.0)
    context = demand.mean_prompt + answer / 2
    per_stream = model.per_decode_seq_s + model.per_decode_kv_token_s * context
    if role == "colocated":
        per_stream += successor_s(model, demand)
    if per_stream <= 0:
        return None
    room = allowance * headroom - model.overhead_s - model.per_panel_step_s
    n = max(1, int(room / per_stream))  # steps too slow for any pace: one stream still runs
    return None if n >= NO_CAP else n
