"""Chat and text completions: validate, render, submit, and answer in OpenAI's exact format.

    body --checks--> token ids --EngineClient.submit--> TextStream
         --> one JSON answer, or SSE chunks: `data: {...}\\n\\n` ... `data: [DONE]\\n\\n`

Everything a user can get wrong is caught here, before the request reaches an engine:
model name, n, prompt length against the context and the KV cache, token ids, ranges.

Large inputs are rendered and tokenized on a small thread pool, never on the event loop: a
megabyte prompt takes most of a second to tokenize, and a burst of them on the loop once
starved the engine watchdog until it declared healthy engines dead (vLLM moved tokenization
to threads for the same reason); the Rust tokenizer releases the GIL while it works. Small
ones (most requests) stay inline: they take microseconds, and a thread hop per request
made them wait in the pool's queue, where overload piled up instead of getting its 429. The
pool's queue is bounded too: past MAX_PENDING_RENDERS large inputs, 429.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse, StreamingResponse

from splitserve.api.answer import Answer, Echo, error_for
from splitserve.api.engine_client import EngineClient
from splitserve.api.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from splitserve.api.render import Renderer, RenderError
from splitserve.api.text_stream import TextStream
from splitserve.api.response_format import json_schema_for
from splitserve.coordinator.router import NoInstanceAvailable
from splitserve.api.tools import ToolPlan, plan_tools
from splitserve.sampling import SamplingParams

INLINE_RENDER_CHARS = 16_384  # below this, rendering + tokenizing take well under a millisecond
MAX_PENDING_RENDERS = 64
Receive = Callable[[], Awaitable[dict]]  # the ASGI receive channel of the HTTP request


class OpenAIServing:
    def __init__(self, client: EngineClient, renderer: Renderer, render_threads: int | None = None) -> None:
        self.client, self.renderer = client, renderer
        self._render_pool = ThreadPoolExecutor(render_threads or min(4, os.cpu_count() or 1),
                                               thread_name_prefix="render")
        self._num_pending_renders = 0

    async def off_loop(self, size: int, fn, *args):
        """fn(*args) inline when `size` (characters, or ids) is small, else on the render pool."""
        if size < INLINE_RENDER_CHARS:
            return fn(*args)
        if self._num_pending_renders >= MAX_PENDING_RENDERS:
            raise ApiError(429, f"{MAX_PENDING_RENDERS} large prompts are already waiting to be tokenized; "
                                "retry later", "rate_limit_error", code="render_queue_full", retry_after_s=1)
        self._num_pending_renders += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)
        finally:
            self._num_pending_renders -= 1

    # ---- checks shared by every endpoint ------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if not self.client.live_instances():
            raise ApiError(503, "no engine instance is alive; retry later", "server_error",
                           code="no_engine", retry_after_s=5)
        if model is not None and model != self.client.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.client.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab = self.client.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def _capacity_tokens(self) -> int:
        """The most tokens one request may hold: the context, and the smallest live KV cache."""
        kv = min(i.hello.num_blocks_total * i.hello.block_size for i in self.client.live_instances())
        return min(self.client.max_model_len, kv)

    def sampling_params(self, body: ChatCompletionRequest | CompletionRequest, num_prompt: int,
                        grammar: str | None = None) -> SamplingParams:
        if body.n != 1:
            raise ApiError(400, f"only n=1 is supported, got n={body.n}; send n requests instead", param="n")
        logprobs = requested_logprobs(body)
        json_schema = json_schema_for(body.response_format)
        if (json_schema is not None or grammar is not None) and body.min_tokens:
            raise ApiError(400, "min_tokens cannot be combined with response_format or a forced tool call: the "
                                "grammar may have to end the answer first", param="min_tokens")
        stop_token_ids = list(body.stop_token_ids or [])
        self.check_token_ids(stop_token_ids, "stop_token_ids")
        capacity = self._capacity_tokens()
        if num_prompt == 0:
            raise ApiError(400, "the prompt is empty; give at least one token", param="prompt")
        limit = body.answer_limit()
        if num_prompt >= capacity or (limit is not None and num_prompt + limit > capacity):
            raise ApiError(400, f"this model's maximum context length is {capacity} tokens, but you asked "
                                f"for {num_prompt} prompt tokens and {limit or 'at least 1'} completion tokens; "
                                f"shorten the prompt or lower max_tokens", param="max_tokens" if limit and
                           num_prompt < capacity else "messages", code="context_length_exceeded")
        max_tokens = limit if limit is not None else capacity - num_prompt
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                           param="min_tokens")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, min_tokens=body.min_tokens,
                              stop_token_ids=stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
                              json_schema=json_schema, grammar=grammar)

    def tool_plan(self, body) -> ToolPlan:
        return plan_tools(body.tools, getattr(body, "tool_choice", None), getattr(body, "parallel_tool_calls", True),
                          self.renderer.tool_format, getattr(body, "response_format", None))

    async def render_chat(self, body, plan: ToolPlan | None = None) -> tuple[str, list[int]]:
        plan = plan or self.tool_plan(body)
        messages = [m.model_dump(exclude_none=False) for m in body.messages]
        size = sum(len(str(m.get("content") or "")) for m in messages) + (len(str(body.tools)) if body.tools else 0)
        try:
            rendered = await self.off_loop(size, self.renderer.render_chat, messages, body.add_generation_prompt,
                                           plan.template_tools)
        except RenderError as e:
            raise ApiError(400, str(e), param=e.param) from None
        return rendered.text, rendered.token_ids

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop(len(text), self.renderer.tokenize, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.off_loop(4 * len(token_ids), self.renderer.detokenize, token_ids)

    async def completion_prompt_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"batched prompts are not supported (got {len(prompt)}); "
                                    f"send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.tokenize(prompt)
        self.check_token_ids(prompt, "prompt")
        return list(prompt)

    async def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, stop: list[str],
                     priority: int = 0, slo_class: str | None = None) -> TextStream:
        try:
            return await self.client.generate(request_id, token_ids, params, stop, priority, slo_class or "")
        except (NoInstanceAvailable, ValueError) as e:
            raise submit_error(e) from None

    # ---- endpoints -----------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request_id: str, receive: Receive):
        self.check_model(body.model)
        plan = self.tool_plan(body)
        _, token_ids = await self.render_chat(body, plan)
        params = self.sampling_params(body, len(token_ids), plan.grammar)
        stream = await self.submit(request_id, token_ids, params, body.stop_strings(), body.priority,
                                   body.slo_class)
        answer = Answer("chat", f"chatcmpl-{request_id}", self.client.model_name, body.include_usage,
                        body.return_token_ids, self.renderer.token_text if params.logprobs is not None else None,
                        tool_parser=self.renderer.tool_format() if plan.parse else None)
        if body.stream:
            return self._streaming(answer.chat_chunks(stream), request_id)
        return await self._full(answer, stream, request_id, receive)

    async def completion(self, body: CompletionRequest, request_id: str, receive: Receive):
        self.check_model(body.model)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 scores the prompt alone: it needs echo: true (and logprobs for "
                                "the scores)", param="max_tokens")
        token_ids = await self.completion_prompt_ids(body)
        params = self.sampling_params(body, len(token_ids))
        echo = None
        if body.echo:
            # with logprobs, the prompt's own logprobs come back too (evaluation harnesses score with them)
            params.prompt_logprobs = params.logprobs
            echo = Echo(await self.detokenize(token_ids) if not isinstance(body.prompt, str) else body.prompt,
                        token_ids if params.logprobs is not None else None, score_only=body.max_tokens == 0)
        stream = await self.submit(request_id, token_ids, params, body.stop_strings(), body.priority,
                                   body.slo_class)
        answer = Answer("text", f"cmpl-{request_id}", self.client.model_name, body.include_usage,
                        body.return_token_ids, self.renderer.token_text if params.logprobs is not None else None,
                        echo)
        if body.stream:
            return self._streaming(answer.text_chunks(stream), request_id)
        return await self._full(answer, stream, request_id, receive)

    @staticmethod
    def _streaming(chunks: AsyncIterator[bytes], request_id: str) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"})

    async def _full(self, answer: Answer, stream: TextStream, request_id: str, receive: Receive) -> JSONResponse:
        watcher = asyncio.create_task(abort_on_disconnect(receive, stream))
        texts, token_ids, logprobs, prompt_logprobs, last = [], [], [], None, None
        try:
            async for event in stream:
                prompt_logprobs = prompt_logprobs or event.prompt_logprobs  # the first set: a retry may repeat it
                event = answer.view(event)
                texts.append(event.text)
                token_ids.extend(event.token_ids)
                logprobs.extend(event.logprobs or [])
                last = event
        finally:
            watcher.cancel()
            stream.close()  # a cancelled handler aborts the request too
        if last.error:
            raise error_for(last)
        return JSONResponse(answer.full("".join(texts), last, token_ids, logprobs, prompt_logprobs),
                            headers={"X-Request-Id": request_id})


def submit_error(e: NoInstanceAvailable | ValueError) -> ApiError:
    """The answer to a request the dispatcher could not take (here or for an API process)."""
    if not isinstance(e, NoInstanceAvailable):
        return ApiError(400, str(e))
    if e.status == 503:  # no instance able to serve a stage is alive: not the client's rate
        return ApiError(503, str(e), "server_error", code="no_engine", retry_after_s=e.retry_after_s)
    return ApiError(429, str(e), "rate_limit_error", code="queue_full", retry_after_s=e.retry_after_s)


def requested_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """-> None, or how many alternatives each token's logprob comes with. Chat: logprobs is a
    boolean and top_logprobs the count (it needs logprobs: true); completions: logprobs is the count."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ApiError(400, "for chat completions logprobs is a boolean; give the number of alternatives "
                                "as top_logprobs", param="logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if isinstance(body.logprobs, bool):
        raise ApiError(400, "for completions logprobs is the number of alternatives (0 to 20), not a boolean",
                       param="logprobs")
    if body.top_logprobs is not None:
        raise ApiError(400, "completions take the number of alternatives as logprobs, not top_logprobs",
                       param="top_logprobs")
    return body.logprobs


async def abort_on_disconnect(receive: Receive, stream: TextStream) -> None:
    """A non-streaming client that leaves is noticed too: its request is aborted in the engine."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.close()
