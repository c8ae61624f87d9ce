"""Per-request sampling settings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


# Below any top-token probability of a vocabulary under a million tokens, so the same token
# set; far above float32's smallest number, which a top_p of 5e-324 rounded to (0 kept no
# token at all and the sampler raised).
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: each sampled token's logprob and the k most likely alternatives
    logprobs: int | None = None
    # None: no prompt logprobs; k >= 0: each prompt token's logprob (the first has none) and the k
    # most likely alternatives, from the prefill (what evaluation harnesses score prompts with)
    prompt_logprobs: int | None = None
    json_schema: str | None = None  # structured output: the answer is JSON valid under this schema
    # structured output: any xgrammar grammar (Grammar.serialize_json), e.g. a forced tool call
    grammar: str | None = None
    # a resumed request: the last n prompt tokens are answer tokens made elsewhere (its grammar
    # advances over them)
    answer_prefix_len: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        self.top_p = max(float(self.top_p), MIN_TOP_P)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 disable it)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer or None")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise bad("json_schema", "must be None or a JSON schema as a string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or self.json_schema is not None):
            raise bad("grammar", "must be None or a serialized xgrammar Grammar, and not given with json_schema")
        if not isinstance(self.answer_prefix_len, int) or isinstance(self.answer_prefix_len, bool) \
                or self.answer_prefix_len < 0:
            raise bad("answer_prefix_len", "must be an integer >= 0")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
