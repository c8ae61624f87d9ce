"""The OpenAI-compatible HTTP request bodies and the error body, validated by pydantic.

Strict types (a string where a number belongs is a 400, as with OpenAI), no NaN or
infinity, and ranges checked here, so a handler only ever sees well-formed values. Fields
OpenAI defines that we do not act on (user, presence_penalty...) are accepted and ignored.
"""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16
SEED_RANGE = dict(ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed accepts


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
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = Field(None)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logprobs: bool | int | None = None
    # as in vLLM: each choice also carries the generated token ids; a stream then sends a chunk
    # for every engine step, even one whose text the detokenizer still holds back
    return_token_ids: bool = False

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
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    tools: list[dict] | None = None

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def answer_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length"]
