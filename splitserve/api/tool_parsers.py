"""Tool-call formats: how a model writes a call, and how the frontend reads it back.

A tool parser is one request's derender state for calls (text deltas in; content text and
`ToolCallDelta`s out, in the order OpenAI streams them) and, as class methods, its format:
the grammar that forces a call (`tool_choice` required or a named function) and the text that
stands in for a chat template that knows nothing of tools. `serve --tool-call-parser NAME`
picks one from TOOL_PARSERS.

Hermes (Qwen2/Qwen2.5/Qwen3, Hermes-2/3) writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Streaming: the call's first delta (id, name, empty arguments) leaves as soon as the name and
the `"arguments":` key are read, then the arguments' characters as they come, so the markup
never reaches the content. Whitespace next to a call is not content. Text that opens and closes
a call but is not one (not JSON, no name) is passed on as content, as the model wrote it; a call
the answer's end cuts short keeps what was streamed of it, or is dropped if its name was not read.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from splitserve.grammars import json_schema_grammar, xgrammar

ANY_ARGUMENTS = {"type": "object", "properties": {}}  # a function declared without parameters


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # which call of the answer (0, 1, ...)
    arguments: str = ""  # the next characters of the call's arguments (a JSON object's text)
    id: str | None = None  # set on a call's first delta only, with the name
    name: str | None = None


Piece = str | ToolCallDelta  # content text, or part of a call


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(ABC):
    name: str

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The next text of the answer -> what can be sent now."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The answer ended: whatever was held back."""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer -> (content or None, OpenAI tool_calls): the stream's pieces, joined."""
        content, calls = [], []
        for piece in self.feed(text) + self.finish():
            if isinstance(piece, str):
                content.append(piece)
            elif piece.id is not None:
                calls.append({"id": piece.id, "type": "function",
                              "function": {"name": piece.name, "arguments": piece.arguments}})
            else:
                calls[piece.index]["function"]["arguments"] += piece.arguments
        return ("".join(content) or None) if calls else "".join(content), calls

    # ---- the format ----------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def forced_grammar(cls, functions: list[dict], parallel: bool):
        """An xgrammar Grammar whose every sentence is one call (several if parallel) of one of
        `functions` ({"name", "parameters"}) with arguments valid under its parameters.
        ValueError if a parameters schema cannot be used."""

    @classmethod
    @abstractmethod
    def tools_prompt(cls, functions: list[dict]) -> str:
        """System-prompt text that declares the tools, for a chat template without tool support."""

    @classmethod
    @abstractmethod
    def render_call(cls, name: str, arguments: dict) -> str:
        """An earlier assistant call, as the model would have written it."""

    @classmethod
    @abstractmethod
    def render_result(cls, content: str) -> str:
        """A tool's result, as the model expects to read it."""


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_CALL_END = re.compile(r"\s*\}\s*</tool_call>")


def _json_string(escaped: str) -> str | None:
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet handled
        self._state = self._on_text  # the handler for where the answer stands: text | header | arguments | end
        self._space = ""  # whitespace after content: sent only if content follows it
        self._call_space = ""  # the whitespace before an open tag: content again if no call follows
        self._depth, self._in_string, self._escaped = 0, False, False  # the arguments' JSON, so far

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._state(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state == self._on_text:
            self._content(self._buf, out)
        # a call cut before its name was read (max_tokens, a stop string) is dropped: its markup is
        # no content, and finish_reason says why the answer ended
        self._buf = ""
        if self._space and not self.num_calls:
            out.append(self._space)
        self._space = ""
        return out

    def _content(self, text: str, out: list[Piece]) -> None:
        text, self._space = self._space + text, ""
        kept = text.rstrip()
        self._space = text[len(kept):]
        if kept:
            out.append(kept)

    # Each state handler consumes what it can; True when it changed state (run again).

    def _on_text(self, out: list[Piece]) -> bool:
        start = self._buf.find(self.OPEN)
        if start < 0:  # hold back a tail that may begin the tag
            hold = next((n for n in range(min(len(self.OPEN) - 1, len(self._buf)), 0, -1)
                         if self.OPEN.startswith(self._buf[-n:])), 0)
            self._content(self._buf[:len(self._buf) - hold], out)
            self._buf = self._buf[len(self._buf) - hold:]
            return False
        self._content(self._buf[:start], out)
        self._call_space, self._space = self._space, ""  # whitespace before a call is layout, not content
        self._buf, self._state = self._buf[start + len(self.OPEN):], self._on_header
        return True

    def _on_header(self, out: list[Piece]) -> bool:
        header = _HEADER.match(self._buf)
        name = _json_string(header.group(1)) if header else None
        if name is not None:
            out.append(ToolCallDelta(self.num_calls, "", new_call_id(), name))
            self._buf, self._state = self._buf[header.end():], self._on_arguments
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        end = self._buf.find(self.CLOSE)
        if end < 0:
            return False
        body, self._buf, self._state = self._buf[:end], self._buf[end + len(self.CLOSE):], self._on_text
        call = self._whole_call(body)
        if call is None:
            self._content(self._call_space + self.OPEN + body + self.CLOSE, out)
        else:
            out += [ToolCallDelta(self.num_calls, "", new_call_id(), call[0]), ToolCallDelta(self.num_calls, call[1])]
            self.num_calls += 1
        return True

    @staticmethod
    def _whole_call(body: str) -> tuple[str, str] | None:
        """A call written in another order than name, arguments ("arguments" first, no arguments)."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

    def _on_arguments(self, out: list[Piece]) -> bool:
        end = None
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        taken = len(self._buf) if end is None else end
        out.append(ToolCallDelta(self.num_calls, self._buf[:taken]))
        self._buf = self._buf[taken:]
        if end is None:
            return False
        self.num_calls += 1
        self._state = self._on_end
        return True

    def _on_end(self, out: list[Piece]) -> bool:
        """After the arguments: `}` and the closing tag. Anything else up to the tag (extra
        keys) is dropped: the call was already sent."""
        done = _CALL_END.match(self._buf)
        if done:
            self._buf, self._state = self._buf[done.end():], self._on_text
            return True
        rest = self._buf.lstrip()
        rest = rest[1:].lstrip() if rest.startswith("}") else rest
        if self.CLOSE.startswith(rest) or not rest:
            return False  # still on its way
        close = self._buf.find(self.CLOSE)
        if close < 0:
            return False
        self._buf, self._state = self._buf[close + len(self.CLOSE):], self._on_text
        return True

    # ---- the format ----------------------------------------------------------------------

    @classmethod
    def forced_grammar(cls, functions: list[dict], parallel: bool):
        cases = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or ANY_ARGUMENTS},
                  "required": ["name", "arguments"]} for f in functions]
        schema = cases[0] if len(cases) == 1 else {"anyOf": cases}
        call_json = str(json_schema_grammar(json.dumps(schema)))
        calls = 'hermes_call ("\\n" hermes_call)*' if parallel else "hermes_call"
        ebnf = (f"{call_json}\nhermes_calls ::= {calls}\n"
                f'hermes_call ::= "{cls.OPEN}\\n" root "\\n{cls.CLOSE}"\n')
        return xgrammar().Grammar.from_ebnf(ebnf, root_rule_name="hermes_calls")

    @classmethod
    def tools_prompt(cls, functions: list[dict]) -> str:
        declared = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
        return ("You may call functions to answer. These are the functions, as JSON schemas:\n"
                f"<tools>\n{declared}\n</tools>\n"
                "To call one, write its name and arguments as JSON between tags, one call per block:\n"
                f'{cls.OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{cls.CLOSE}\n'
                "Each result comes back between <tool_response> tags.")

    @classmethod
    def render_call(cls, name: str, arguments: dict) -> str:
        return f"{cls.OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{cls.CLOSE}"

    @classmethod
    def render_result(cls, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}
