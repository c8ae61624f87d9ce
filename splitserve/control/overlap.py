"""The buyer's first question about a workload: do long prompts collide with other requests?

For `splitserve workload analyze --profile` (trial/analyze.py calls `analyze_records`). With the profile's
step model, each long prompt (>= long_input_tokens) occupies an instance for its prefill,
[arrival, arrival + prefill time); each answer streams for about answer_tokens decode steps
after its own prefill. Then:
  arrivals_during_long_prefill  share of the other requests that arrive inside such a window
                                (their first token waits behind it on a colocated engine);
  streams_hit_by_long_prefill   share of answers (more than one token) streaming while one runs
                                (on a colocated engine they pause for it, or slow down for its
                                chunks; on a separated one they do not).
No queueing is modelled (an estimate for sizing, not a prediction: `splitserve plan` simulates).
"""
from __future__ import annotations

import bisect

from splitserve.control.profile_file import Profile

SEPARATE_ABOVE = 0.10   # share of streams hit above which separation likely pays
COLOCATE_BELOW = 0.03   # below which colocated serving has nothing to fear


def _merge(windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    starts, ends = [], []
    for s, e in sorted(windows):
        if starts and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


def _overlaps(starts: list[float], ends: list[float], s: float, e: float) -> bool:
    """Does [s, e] meet any merged window?"""
    i = bisect.bisect_right(starts, e) - 1
    return i >= 0 and ends[i] > s


def analyze_overlap(times_s: list[float], prompt_tokens: list[int], answer_tokens: list[int], profile: Profile,
                    long_input_tokens: int = 1000, threads: int = 1) -> dict:
    if not (len(times_s) == len(prompt_tokens) == len(answer_tokens)) or not times_s:
        raise ValueError("analyze_overlap: give one arrival time, prompt length and answer length per request")
    if long_input_tokens < 1:
        raise ValueError(f"--long-input-tokens: must be >= 1, got {long_input_tokens}")
    model = profile.steps.for_threads(threads)
    long_idx = [i for i, n in enumerate(prompt_tokens) if n >= long_input_tokens]
    windows = [(times_s[i], times_s[i] + model.prefill_s(prompt_tokens[i])) for i in long_idx]
    starts, ends = _merge(windows)
    long_set = set(long_idx)
    others = [i for i in range(len(times_s)) if i not in long_set]
    arrivals_hit = sum(_overlaps(starts, ends, times_s[i], times_s[i]) for i in others)
    streams, streams_hit = 0, 0
    for i, (t, n, m) in enumerate(zip(times_s, prompt_tokens, answer_tokens)):
        if m < 2:
            continue
        begin = t + model.prefill_s(n)
        end = begin + (m - 1) * model.decode_step_s(1, n + m // 2)
        streams += 1
        # a window that is the stream's own prefill does not count: it ended at `begin`
        streams_hit += _overlaps(starts, ends, begin + 1e-9, end)
    mean_long_prefill = (sum(e - s for s, e in windows) / len(windows)) if windows else 0.0
    long_share = len(long_idx) / len(times_s)
    arrivals_share = arrivals_hit / len(others) if others else 0.0
    streams_share = streams_hit / streams if streams else 0.0
    return {"long_input_tokens": long_input_tokens, "threads": threads, "long_share": long_share,
            "mean_long_prefill_s": mean_long_prefill, "arrivals_during_long_prefill": arrivals_share,
            "streams_hit_by_long_prefill": streams_share,
            "recommendation": recommend(long_share, mean_long_prefill, arrivals_share, streams_share,
                                        long_input_tokens, threads)}


def analyze_records(records, profile: Profile, long_input_tokens: int = 1000, threads: int = 1) -> dict:
    """`analyze_overlap` over trace records (trial/traces.TraceRecord: time_s, prompt_tokens, answer_tokens)."""
    records = sorted(records, key=lambda r: r.time_s)
    return analyze_overlap([r.time_s for r in records], [r.prompt_tokens for r in records],
                           [r.answer_tokens for r in records], profile, long_input_tokens, threads)


def recommend(long_share: float, mean_prefill_s: float, arrivals_hit: float, streams_hit: float,
              threshold: int, threads: int) -> str:
    if long_share == 0:
        return (f"Keep colocated: no prompt reaches {threshold} tokens, so no long prefill ever stalls a stream; "
                "separating the stages would only split the cores.")
    facts = (f"{streams_hit:.0%} of answers would be streaming when a >= {threshold}-token prompt is being "
             f"prefilled, and {arrivals_hit:.0%} of requests arrive during one (long inputs are {long_share:.0%} "
             f"of requests; each takes about {mean_prefill_s:.2f} s to prefill on {threads} thread(s) by the profile)")
    if streams_hit >= SEPARATE_ABOVE or arrivals_hit >= SEPARATE_ABOVE:
        return (f"Separation likely pays: {facts}. On a colocated engine those streams pause for a whole "
                "prefill, or slow down beside its chunks; separate prefill instances keep them steady. "
                "Size the pools with `splitserve plan` and confirm with a trial.")
    if streams_hit < COLOCATE_BELOW and arrivals_hit < COLOCATE_BELOW:
        return (f"Keep colocated: {facts}. Long prompts rarely meet other requests, so separating the stages "
                "would mostly split the cores; a chunked colocated engine absorbs the few collisions.")
    return (f"Borderline: {facts}. A chunked colocated engine may absorb this; run `splitserve plan` and a "
            "trial of both before choosing.")


def render_overlap(result: dict) -> str:
    return (f"long prompts (>= {result['long_input_tokens']} tokens): {result['long_share']:.0%} of requests, "
            f"~{result['mean_long_prefill_s']:.2f} s prefill each on {result['threads']} thread(s)\n"
            f"requests arriving during a long prefill: {result['arrivals_during_long_prefill']:.0%}; "
            f"answers streaming during one: {result['streams_hit_by_long_prefill']:.0%}\n"
            f"{result['recommendation']}")
