"""Render (messages -> token ids) and derender (token ids -> text, stop strings), on CPU.

This is the only module that turns text into tokens or back. Engines see token ids only.

    render:   messages --chat template (Jinja2)--> prompt text --tokenizer--> token ids
    derender: token ids --DecodeStream--> text deltas --StopStringMatcher--> client text

Tools reach the template as transformers' apply_chat_template passes them (`tools`, and
assistant `tool_calls` with their arguments as objects). A template that never reads `tools`
(the bundled SmolLM2's) gets them written into the messages instead, in the tool parser's own
format: a system prompt declaring them, earlier calls as the model would write them, results
as a user turn (see `inline_tools`).

The incremental detokenizer never emits half a UTF-8 character: the tokenizer's own
`DecodeStream` holds bytes back until they form whole characters, so a stream never shows
U+FFFD and the concatenated deltas equal the text of a non-streamed answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers.decoders import DecodeStream

from splitserve.api.tool_parsers import HermesToolParser, ToolParser

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


class RenderError(ValueError):
    """A user's messages cannot be rendered (bad role, template refused them...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _flatten_content(content: object, index: int) -> str:
    """OpenAI content: a string, or a list of {"type": "text", "text": ...} parts (null is
    checked by the caller, since whether it is allowed depends on the message)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RenderError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                  param=f"messages[{index}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise RenderError("content must be a string or a list of text parts",
                      param=f"messages[{index}].content")


def _tool_calls(calls: object, index: int) -> list[dict]:
    """An assistant message's OpenAI tool_calls -> the template's form (arguments as objects)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise RenderError("tool_calls must be a non-empty list of calls", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type", "function") != \
                "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RenderError('each tool call is {"id": ..., "type": "function", "function": {"name": ..., '
                              '"arguments": "<JSON object>"}}', f"{where}[{j}]")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RenderError("a tool call's arguments must be a JSON object (as text)",
                              f"{where}[{j}].function.arguments")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _normalize_message(m: dict, index: int, developer_role: bool, call_ids: set[str]) -> dict:
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise RenderError(f"unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}", f"messages[{index}].role")
    if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
        raise RenderError("name must be a string", f"messages[{index}].name")
    msg = {k: v for k, v in m.items() if v is not None or k == "content"}
    # OpenAI's rule: only an assistant message that calls tools may leave out its text. A null
    # user message used to render as an empty turn and generate until the context was full.
    if m.get("content") is None:
        if not (role == "assistant" and m.get("tool_calls")):
            raise RenderError(f"a {role} message needs content (a string or a list of text parts); only an "
                              f"assistant message with tool_calls may have null content",
                              f"messages[{index}].content")
        msg["content"] = ""  # templates concatenate content: None would raise or print "None"
    else:
        msg["content"] = _flatten_content(m["content"], index)
    if role == "developer" and not developer_role:
        msg["role"] = "system"  # OpenAI's newer name for the system role; most templates predate it
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise RenderError("only an assistant message carries tool_calls", f"messages[{index}].tool_calls")
        msg["tool_calls"] = _tool_calls(m["tool_calls"], index)
        call_ids.update(c["id"] for c in msg["tool_calls"])
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RenderError("a tool message needs tool_call_id: the id of the call it answers",
                              f"messages[{index}].tool_call_id")
        if call_id not in call_ids:
            raise RenderError(f"tool_call_id {call_id!r} answers no tool call of an earlier assistant message",
                              f"messages[{index}].tool_call_id")
    return msg


def inline_tools(messages: list[dict], tools: list[dict] | None, fmt: type[ToolParser]) -> list[dict]:
    """Tools, calls and results written into plain messages, for a template that has no tool support."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)}
        elif m["role"] == "tool":
            m = {"role": "user", "content": fmt.render_result(m["content"])}
        out.append(m)
    if tools:
        prompt = fmt.tools_prompt([t["function"] for t in tools])
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


class Renderer:
    """Chat template + tokenizer of one model; holds no weights."""

    def __init__(self, tokenizer, chat_template: str | None, tool_format: type[ToolParser] = HermesToolParser) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizer: fast encode/decode
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        # The same environment HF templates are written for (sandboxed: templates ship with
        # model files, which we do not trust to run arbitrary code).
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = self._raise_from_template
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # Compiled once: compiling the template per request would dominate render time.
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        # A template that names the developer role renders it itself; for any other one a
        # developer message is rendered as a system message (what vLLM and OpenAI's own docs do).
        self.developer_role = bool(self.chat_template) and "developer" in self.chat_template
        # Whether the template renders tools itself (reads the `tools` variable), as Qwen's do
        self.supports_tools = bool(self.chat_template) and \
            "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))
        self.tool_format = tool_format
        self._token_texts: dict[int, str] = {}
        self._special = {
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or "",
        }

    @staticmethod
    def _raise_from_template(message: str) -> None:
        raise RenderError(f"the model's chat template refused the messages: {message}", "messages")

    def normalize_messages(self, messages: list[dict]) -> list[dict]:
        if not messages:
            raise RenderError("messages must hold at least one message", "messages")
        call_ids: set[str] = set()
        return [_normalize_message(m, i, self.developer_role, call_ids) for i, m in enumerate(messages)]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> RenderedPrompt:
        if self._template is None:
            raise RenderError("this model has no chat template; use /v1/completions instead", "messages")
        messages = self.normalize_messages(messages)
        if not self.supports_tools:
            messages, tools = inline_tools(messages, tools, self.tool_format), None
        try:
            text = self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **self._special)
        except RenderError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError) as e:
            raise RenderError(f"the chat template could not render these messages: {e}", "messages") from e
        # The template already wrote any BOS/special tokens: don't add them twice.
        return RenderedPrompt(text, self.tokenize(text, add_special_tokens=False))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch calls release the GIL while Rust works (`encode` holds it: measured 0.56 s
        # with no other thread running for a 900 kB prompt), so the serving loop keeps going.
        try:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # JSON can carry lone surrogates ("\\udcff"), which are not text
            raise RenderError("the text is not valid Unicode (it holds a lone surrogate)", "prompt") from None

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (logprobs name tokens this way); cached: a stream asks per token."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text

    def new_output_text(self, stop: list[str]) -> OutputText:
        return OutputText(self.backend, stop)


def load_renderer(model: str | None, tool_call_parser: str = "hermes"):
    from splitserve.api.tool_parsers import TOOL_PARSERS
    from splitserve.models.loader import load_tokenizer

    tokenizer, chat_template = load_tokenizer(model)
    return Renderer(tokenizer, chat_template, TOOL_PARSERS[tool_call_parser])


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas, across delta boundaries.

    "First" is the stop that is complete earliest, as if the text arrived one character at a time
    (on a tie, the longer one, which starts earlier): so the answer does not depend on how the
    tokens' text was cut into deltas. With stops "a" and "baa", "baa" stops at "b" whether it came
    as one delta or two: "a" is complete before "baa" is. Holds back the last (longest stop - 1)
    characters, since they may begin a stop string that the next delta completes; the stop string
    itself is never emitted.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit now, whether a stop string was hit)."""
        if not self.stop:
            return delta, False
        self.pending += delta
        # (end, start) of each stop's first occurrence: its first start is also its first end
        hits = [(i + len(s), i) for s, i in ((s, self.pending.find(s)) for s in self.stop) if i >= 0]
        if hits:
            emit, self.pending = self.pending[:min(hits)[1]], ""
            return emit, True
        cut = max(0, len(self.pending) - self.hold)
        emit, self.pending = self.pending[:cut], self.pending[cut:]
        return emit, False

    def flush(self) -> str:
        emit, self.pending = self.pending, ""
        return emit


class OutputText:
    """One request's derender state: token ids in, client-visible text deltas out."""

    def __init__(self, backend, stop: list[str]) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = StopStringMatcher(stop)
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string ended the answer

    def add_tokens(self, token_ids: list[int], finished: bool) -> str:
        """Decode new tokens; returns the text to emit. After a stop-string hit, returns ''."""
        if self.stopped:
            return ""
        pieces = []
        for tid in token_ids:
            piece = self._stream.step(self._backend, tid)
            if piece:
                pieces.append(piece)
        emit, hit = self._stop.feed("".join(pieces))
        if hit:
            self.stopped = True
        elif finished:
            emit += self._stop.flush()
        self.text += emit
        return emit


class NoText:
    """The derender state of a request whose text another process makes (an API process of
    `serve --api-server-count N`, which detokenizes and finds stop strings itself)."""

    stopped = False
    text = ""

    def add_tokens(self, token_ids: list[int], finished: bool) -> str:
        return ""
