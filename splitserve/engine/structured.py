"""Structured output in the engine: a JSON schema or a grammar becomes a token mask applied on
every step.

xgrammar (chosen over llguidance: its CPU wheel ships a C++ mask kernel for torch tensors and
compiles JSON schemas directly; see docs/benchmarks.md "Formats") compiles the schema against this
model's tokenizer once (cached here by its text); each request holds its own `GrammarMatcher`,
which says which tokens may come next and advances over each token the request produces.

Answers are compact JSON (no whitespace between tokens), so no raw control character is ever
valid in one; xgrammar's string rule still admits some (U+000B, measured), which Python's json
and most parsers reject: tokens whose text holds one are banned outright. A newline is spared:
a forced tool call's markup needs it, and no JSON grammar here admits one.

A decode instance (and a resumed request) rebuilds the matcher and advances it over the answer
tokens produced elsewhere, so the grammar continues exactly where it was.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from splitserve.engine.request import Request
from splitserve.grammars import grammar_from_wire, json_schema_grammar
from splitserve.grammars import xgrammar as _xgrammar

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept (a forced tool call repeats its tools' grammar)


class GrammarBackend:
    """One per engine: the tokenizer's grammar view and the compiler, built on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None
        self._banned: torch.Tensor | None = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _compiler_for_model(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._eos or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            decode = self._tokenizer.convert_ids_to_tokens
            texts = [self._tokenizer.convert_tokens_to_string([t]) if t is not None else ""
                     for t in decode(list(range(min(len(self._tokenizer), self.vocab_size))))]
            self._banned = torch.tensor([i for i, t in enumerate(texts) if any(ord(c) < 0x20 and c != "\n" for c in t)],
                                        dtype=torch.long)
        return self._compiler

    def attach(self, request: Request, answer_tokens: list[int]) -> None:
        """Give the request its matcher, advanced over the answer tokens it already has.
        ValueError if the schema cannot be compiled or the tokens do not fit it."""
        params = request.params
        if params.grammar is not None:
            key = ("grammar", params.grammar)
        elif params.json_schema is not None:
            key = ("json_schema", params.json_schema)
        else:
            return
        matcher = _xgrammar().GrammarMatcher(self._compile(key))
        for token in answer_tokens:
            if not matcher.accept_token(token):
                raise ValueError(f"token {token} produced so far does not fit the request's grammar")
        request.grammar = RequestGrammar(matcher, self._banned)

    def _compile(self, key: tuple[str, str]):
        compiled = self._compiled.get(key)
        if compiled is None:
            kind, text = key
            grammar = grammar_from_wire(text) if kind == "grammar" else json_schema_grammar(text)
            try:
                compiled = self._compiler_for_model().compile_grammar(grammar)
            except RuntimeError as e:
                raise ValueError(f"the grammar cannot be compiled for this model: {e}") from None
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled


class RequestGrammar:
    __slots__ = ("matcher", "banned")

    def __init__(self, matcher, banned: torch.Tensor) -> None:
        self.matcher, self.banned = matcher, banned

    @property
    def active(self) -> bool:
        return not self.matcher.is_terminated()


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request]) -> None:
    """Bans, in place, every token a request's grammar does not allow next."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.active]
    if not rows:
        return
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[-1])
    for i in rows:
        requests[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    for i in rows:
        logits[i, requests[i].grammar.banned] = float("-inf")


def advance_grammars(requests: list[Request], tokens: list[int]) -> None:
    for request, token in zip(requests, tokens):
        if request.grammar is not None and request.grammar.active:
            request.grammar.matcher.accept_token(token)  # the mask allowed it, so it is accepted
