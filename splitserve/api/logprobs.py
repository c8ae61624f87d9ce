"""Logprobs in OpenAI's two response shapes, from the engine's per-token TokenLogprobs.

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": null}
    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                  "text_offset": [...]}

A token's text is the token decoded alone, so a token holding part of a UTF-8 character shows
U+FFFD and its `bytes` are those of that text, not the token's raw bytes (vLLM does the same).
"""
from __future__ import annotations

from collections.abc import Callable

from splitserve.protocol import TokenLogprobs

TokenText = Callable[[int], str]


def _chat_entry(token_text: TokenText, token_id: int, logprob: float) -> dict:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_text: TokenText, entries: list[TokenLogprobs]) -> dict:
    content = []
    for e in entries:
        item = _chat_entry(token_text, e.token_id, e.logprob)
        item["top_logprobs"] = [_chat_entry(token_text, t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]
        content.append(item)
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """The completions shape; keeps the running text offset across a stream's chunks."""

    def __init__(self, token_text: TokenText, start_offset: int = 0) -> None:
        self.token_text, self.offset = token_text, start_offset

    def chunk(self, entries: list[TokenLogprobs]) -> dict:
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self.token_text(e.token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            # as vLLM: the sampled token is always among its own alternatives
            top = {self.token_text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
            top.setdefault(text, e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def prompt(self, prompt_ids: list[int], entries: list[TokenLogprobs], prompt_chars: int) -> dict:
        """An echoed prompt's part: its first token has no logprob (nothing comes before it), the
        others the engine's `entries`. Offsets start at 0; the answer's then start at prompt_chars."""
        self.offset = 0
        first = self.token_text(prompt_ids[0])
        self.offset = len(first)
        rest = self.chunk(entries)
        self.offset = prompt_chars
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}
