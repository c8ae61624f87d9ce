"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request -> a ToolPlan: what the chat
template sees, whether the answer is parsed for calls, and the grammar that forces a call.

    tool_choice  none      tools left out of the prompt, the answer is plain content
                 auto      tools in the prompt, calls parsed out of the answer (default with tools)
                 required  tools in the prompt, the answer is one or more calls (a grammar forces it)
                 {"type": "function", "function": {"name": N}}   exactly one call of N (grammar)

Every mistake is a 400 naming its field (OpenAI's rules: function tools only, names of at most 64
letters, digits, `_` or `-`, each declared once; a forced choice needs tools and names a declared one).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from splitserve.api.openai_schema import ApiError
from splitserve.api.tool_parsers import ToolParser
from splitserve.grammars import json_schema_grammar

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(slots=True)
class ToolPlan:
    template_tools: list[dict] | None = None  # as the request gave them, for the chat template
    parse: bool = False  # derender calls out of the answer
    grammar: str | None = None  # a forced call's grammar (serialized xgrammar Grammar)


def check_tools(tools: list | None) -> list[dict]:
    """-> the declared functions ({"name", "description"?, "parameters"?}); ApiError 400."""
    if tools is None:
        return []
    if not tools:
        raise ApiError(400, "tools must hold at least one tool; leave tools out to declare none", param="tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, 'only function tools are supported: {"type": "function", "function": {...}}',
                           param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ApiError(400, 'a function tool needs "function": {"name": ..., "parameters": {...}}',
                           param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ApiError(400, f"a function name is 1 to 64 letters, digits, '_' or '-', got {name!r}",
                           param=f"{where}.function.name")
        if name in names:
            raise ApiError(400, f"the function {name!r} is declared twice", param=f"{where}.function.name")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ApiError(400, "a function's description must be a string", param=f"{where}.function.description")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ApiError(400, "a function's parameters must be a JSON schema object",
                           param=f"{where}.function.parameters")
        names.add(name)
        functions.append(function)
    return functions


def forced_names(tool_choice: str | dict | None, functions: list[dict]) -> list[str] | None:
    """None when no call is forced, else the functions one of which must be called."""
    names = [f["name"] for f in functions]
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        chosen = names
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        chosen = [tool_choice["function"]["name"]]
        if names and chosen[0] not in names:
            raise ApiError(400, f"tool_choice names the function {chosen[0]!r}, which tools do not declare "
                                f"(declared: {', '.join(names)})", param="tool_choice.function.name")
    else:
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not names:
        raise ApiError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice")
    return chosen


def plan_tools(tools: list | None, tool_choice: str | dict | None, parallel_tool_calls: bool,
               parser: type[ToolParser], response_format: dict | None) -> ToolPlan:
    functions = check_tools(tools)
    forced = forced_names(tool_choice, functions)
    if not functions or tool_choice == "none":
        return ToolPlan()
    plan = ToolPlan(template_tools=tools, parse=True)
    if forced is None:
        return plan
    if response_format and response_format.get("type", "text") != "text":
        raise ApiError(400, "response_format cannot be combined with tool_choice 'required' or a named function: "
                            "the answer is a tool call", param="response_format")
    for i, f in enumerate(functions):
        if f["name"] in forced and f.get("parameters"):
            try:
                json_schema_grammar(json.dumps(f["parameters"]))
            except ValueError as e:
                raise ApiError(400, f"the parameters of {f['name']!r} cannot be forced: {e}",
                               param=f"tools[{i}].function.parameters") from None
    chosen = [f for f in functions if f["name"] in forced]
    # a named function is called once (OpenAI's rule); `required` may call several when allowed
    parallel = parallel_tool_calls and tool_choice == "required"
    try:
        plan.grammar = parser.forced_grammar(chosen, parallel).serialize_json()
    except (ValueError, RuntimeError) as e:
        raise ApiError(400, f"the tools cannot be forced: {e}", param="tool_choice") from None
    return plan
