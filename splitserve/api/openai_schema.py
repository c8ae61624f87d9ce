"""The OpenAI-compatible HTTP request bodies and the error body, validated by pydantic.

Strict types (a string where a number belongs is a 400, as with OpenAI), no NaN or
infinity, and ranges checked here, so a handler only ever sees well-formed values. Every
number has both bounds: what the engine accepts and what the wire (msgspec: int64, or uint64
for a seed) can carry, so no accepted value can fail later with a 500. Fields OpenAI defines
that we do not act on (user, presence_penalty...) are accepted within OpenAI's ranges and
ignored; unknown fields are ignored.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

import annotated_types

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from splitserve.config import PRIORITY_BOUNDS

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_COUNT = 2**31 - 1  # token counts, top_k: far past any context, well inside int64
SEED_RANGE = dict(ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed and msgpack accept
MAX_SLO_CLASS_CHARS = 64
PRIORITY_RANGE = dict(ge=PRIORITY_BOUNDS[0], le=PRIORITY_BOUNDS[1])
TOKEN_ID = Field(ge=0, le=MAX_COUNT)


class ApiError(Exception):
    """An error the client caused (or must be told about), with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s
        self.report: dict | None = None  # splitserve's per-request report (a failed KV transfer)

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if request_id:
            headers["X-Request-Id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def body(self) -> dict:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        if self.report is not None:
            body["splitserve"] = self.report
        return body


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # name, tool_calls, ...
    role: str
    content: str | list[dict] | None = None


class _GenerationFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0.0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_COUNT)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = Field(None)
    stop_token_ids: list[Annotated[int, TOKEN_ID]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # declared so that a JSON request is refused (400) rather than silently answered in free text
    response_format: dict | None = None
    # accepted in OpenAI's (and vLLM's) ranges, not acted on
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2)
    # as in vLLM: each choice also carries the generated token ids; a stream then sends a chunk
    # for every engine step, even one whose text the detokenizer still holds back
    return_token_ids: bool = False
    # as in vLLM: lower is served first when the server runs --scheduling-policy priority
    priority: int = Field(0, **PRIORITY_RANGE)
    # the request's SLO class (`serve --adaptive --slo-classes`): the mix controller judges each
    # class's TTFT and gap by its own targets; a class it was not given counts under the global ones
    slo_class: str | None = Field(None, max_length=MAX_SLO_CLASS_CHARS)

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}",
                           param="stop")
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_COUNT)  # 0: score the prompt (with echo)
    echo: bool = False
    suffix: str | None = None

    def answer_limit(self) -> int | None:
        # max_tokens 0 still runs one step: the prefill that scores the prompt samples a token,
        # which the answer drops
        return 1 if self.max_tokens == 0 else self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, TOKEN_ID]]


def numeric_bounds(schema: type[BaseModel]) -> dict[str, tuple[float | int, float | int]]:
    """{field: (lowest, highest) accepted value} of every scalar numeric field (tests and the fuzzer)."""
    bounds = {}
    for name, info in schema.model_fields.items():
        low = high = None
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Ge):
                low = meta.ge
            elif isinstance(meta, annotated_types.Gt):
                low = meta.gt + 1 if isinstance(meta.gt, int) else math.nextafter(meta.gt, math.inf)
            elif isinstance(meta, annotated_types.Le):
                high = meta.le
            elif isinstance(meta, annotated_types.Lt):
                high = meta.lt - 1 if isinstance(meta.lt, int) else math.nextafter(meta.lt, -math.inf)
        if low is not None or high is not None:
            bounds[name] = (low, high)
    return bounds


FinishReason = Literal["stop", "length"]
