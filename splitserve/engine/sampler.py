"""Next-token choice per request: greedy, or temperature / top-k / top-p with a per-request seed.

A seeded request draws from its own generator, one draw per token, so its output does not
depend on which other requests share the batch.
"""
from __future__ import annotations

import torch

from splitserve.engine.request import Request
from splitserve.protocol import TokenLogprobs


def token_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> dict[Request, TokenLogprobs]:
    """The sampled tokens' log-probabilities for the requests that asked (params.logprobs set),
    from the raw logits (a copy taken before `sample`, which edits them in place)."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return {}
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(requests[i].params.logprobs for i in rows)
    top = logprobs.topk(k, dim=-1) if k else None
    out = {}
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs
        out[requests[i]] = TokenLogprobs(
            tokens[i], float(logprobs[j, tokens[i]]),
            top.indices[j, :n].tolist() if n else [], top.values[j, :n].tolist() if n else [])
    return out


SCORE_ROWS = 256  # prompt positions scored at once: 256 x a 49k vocabulary is 50 MB of fp32


def prompt_token_logprobs(logits: torch.Tensor, targets: list[tuple[Request, int]]) -> None:
    """logits: [num_scored, vocab], row i predicting targets[i]'s token; appends each token's
    TokenLogprobs to its request's prompt_logprobs, in prompt order."""
    for first in range(0, len(targets), SCORE_ROWS):
        rows = torch.log_softmax(logits[first:first + SCORE_ROWS].float(), dim=-1)
        part = targets[first:first + SCORE_ROWS]
        k = max(r.params.prompt_logprobs for r, _ in part)
        top = rows.topk(k, dim=-1) if k else None
        for j, (request, token) in enumerate(part):
            n = request.params.prompt_logprobs
            request.prompt_logprobs.append(TokenLogprobs(
                token, float(rows[j, token]), top.indices[j, :n].tolist() if n else [],
                top.values[j, :n].tolist() if n else []))


def _suppress_stops(logits: torch.Tensor, requests: list[Request]) -> None:
    # min_tokens: end-of-sequence and stop tokens may not be chosen before the minimum.
    for row, request in enumerate(requests):
        params = request.params
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += list(request.eos_token_ids)
            if banned:
                logits[row, banned] = float("-inf")


def _draw(logits: torch.Tensor, request: Request, default: torch.Generator) -> int:
    # logits: [vocab] for one request
    params = request.params
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set whose mass reaches top_p (the first token is always kept)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = request.generator if request.generator is not None else default
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, requests: list[Request], default: torch.Generator) -> list[int]:
    """logits: [num_requests, vocab] (fp32 or lower); returns one token id per request."""
    logits = logits.float()
    _suppress_stops(logits, requests)
    greedy = logits.argmax(dim=-1).tolist()
    return [greedy[i] if r.params.greedy else _draw(logits[i], r, default)
            for i, r in enumerate(requests)]
