"""Tool calls in the frontend: the Hermes parser (stream and whole), the forced-call grammar, the
number bound of JSON grammars, rendering tools through a template with and without tool support,
and the checks that make every malformed tool, tool_choice or tool message a 400 naming its field."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from splitserve.api.answer import tool_deltas
from splitserve.api.openai_schema import ApiError
from splitserve.api.render import Renderer, RenderError
from splitserve.api.tool_parsers import HermesToolParser, ToolCallDelta
from splitserve.api.tools import plan_tools
from splitserve.grammars import MAX_DIGITS, grammar_from_wire, json_schema_grammar
from tiny_models import QWEN_TOOLS_TEMPLATE, tiny_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": [1, {"a": "}"}]}}'
          '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\n')


def stream_like_the_sdk(text: str, chunk: int) -> tuple[str, list[dict], list[dict]]:
    """Feed `text` in pieces of `chunk` characters; accumulate the deltas as the openai SDK does."""
    parser, deltas = HermesToolParser(), []
    for i in range(0, len(text), chunk):
        deltas += tool_deltas(parser.feed(text[i:i + chunk]))
    deltas += tool_deltas(parser.finish())
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for call in d.get("tool_calls", []):
            if "id" in call:
                calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return content, calls, deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 11, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(chunk):
    content, calls = HermesToolParser().parse(ANSWER)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris', "n": [1, {"a": "}"}]}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    streamed_content, streamed_calls, deltas = stream_like_the_sdk(ANSWER, chunk)
    assert streamed_content == content
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    assert not any("<tool" in d.get("content", "") or "tool_call>" in d.get("content", "") for d in deltas)


def test_a_calls_first_delta_has_index_id_type_name_and_empty_arguments_then_fragments():
    _, _, deltas = stream_like_the_sdk(ANSWER, 4)
    firsts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [(f["index"], f["type"], f["function"]) for f in firsts] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""})]
    fragments = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(fragments) > 3 and all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"}
                                      for f in fragments)
    kinds = ["content" if "content" in d else "first" if "id" in d["tool_calls"][0] else "fragment" for d in deltas]
    n = kinds.count("content")  # all content first, then each call's first delta and its fragments
    assert kinds[:n + 2] == ["content"] * n + ["first", "fragment"] and kinds.count("first") == 2
    # fragments arrive as the model writes them: 4 characters in, 4 characters out (or fewer)
    assert all(len(f["function"]["arguments"]) <= 4 for f in fragments)


@pytest.mark.parametrize("text,content", [
    ("no calls here \n", "no calls here \n"),
    ("x < y and <tool but not a tag", "x < y and <tool but not a tag"),
    ("see <tool_call>not json</tool_call> there", "see <tool_call>not json</tool_call> there"),
    ("cut <tool_call>\n{\"na", "cut"),
])
def test_text_that_is_not_a_call_is_content_as_written(text, content):
    assert HermesToolParser().parse(text) == (content, [])
    assert stream_like_the_sdk(text, 3)[:2] == (content, [])


def test_a_call_cut_short_keeps_its_streamed_arguments():
    content, calls = HermesToolParser().parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Ro'}


def test_delta_merging_never_folds_fragments_into_the_first_delta():
    deltas = tool_deltas([ToolCallDelta(0, "", "call_1", "f"), ToolCallDelta(0, '{"a"'), ToolCallDelta(0, ": 1}")])
    assert deltas == [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}]


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tiny_tokenizer()), max_threads=1)


def accepts(compiler, grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def test_forced_grammar_admits_only_calls_of_the_chosen_functions(compiler):
    functions = [WEATHER["function"], TIME["function"]]
    one = HermesToolParser.forced_grammar(functions, parallel=False)
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, one, weather) and accepts(compiler, one, time_call)
    assert not accepts(compiler, one, weather.replace('"c"', '"k"'))  # not in the enum
    assert not accepts(compiler, one, weather.replace("get_weather", "get_wether"))
    assert not accepts(compiler, one, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, one, "Sure! " + weather)
    assert not accepts(compiler, one, weather + "\n" + time_call)
    assert accepts(compiler, HermesToolParser.forced_grammar(functions, parallel=True), weather + "\n" + time_call)
    assert HermesToolParser().parse(weather)[1][0]["function"]["arguments"] == '{"city": "Rome", "unit": "c"}'


def test_json_numbers_are_bounded_in_every_digit_run(compiler):
    grammar = json_schema_grammar(json.dumps({"type": "object", "properties": {"x": {"type": "number"},
                                                                               "n": {"type": "integer"}}}))
    digits = "9" * MAX_DIGITS
    assert accepts(compiler, grammar, f'{{"x": -{digits}.{digits}e+{digits}, "n": {digits}}}')
    assert not accepts(compiler, grammar, f'{{"x": 1{digits}}}')
    assert not accepts(compiler, grammar, f'{{"x": 1.{digits}1}}')
    assert not accepts(compiler, grammar, f'{{"n": 1{digits}}}')


# ---- rendering -------------------------------------------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
HISTORY = [{"role": "user", "content": "weather in Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]


def test_a_template_with_tools_renders_them_as_transformers_does():
    tokenizer = tiny_tokenizer()
    renderer = Renderer(tokenizer, QWEN_TOOLS_TEMPLATE)
    assert renderer.supports_tools
    ours = renderer.render_chat(HISTORY, tools=[WEATHER]).text
    theirs_messages = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}, HISTORY[2]]
    assert ours == tokenizer.apply_chat_template(theirs_messages, tools=[WEATHER], chat_template=QWEN_TOOLS_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in ours
    assert json.dumps(WEATHER) in ours and "<tool_response>\nsunny, 24 C\n</tool_response>" in ours


def test_a_template_without_tools_gets_them_written_into_the_messages():
    renderer = Renderer(tiny_tokenizer(), None)  # the tiny tokenizer's plain ChatML, as SmolLM2's
    assert not renderer.supports_tools
    text = renderer.render_chat(HISTORY, tools=[WEATHER]).text
    assert text.startswith("<|im_start|>system\nYou may call functions") and json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>" in text
    with_system = renderer.render_chat([{"role": "system", "content": "Be brief."}] + HISTORY, tools=[WEATHER]).text
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions")


@pytest.mark.parametrize("messages,param", [
    (HISTORY[:2] + [{"role": "tool", "content": "x"}], "messages[2].tool_call_id"),
    (HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages[2].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ([HISTORY[0], {"role": "assistant", "content": "x", "tool_calls": []}], "messages[1].tool_calls"),
    ([HISTORY[0], {"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}], "messages[1].tool_calls[0]"),
    ([HISTORY[0], {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    (HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_1", "content": None}], "messages[2].content"),
])
def test_bad_tool_messages_raise_render_error_naming_the_field(messages, param):
    with pytest.raises(RenderError) as info:
        Renderer(tiny_tokenizer(), QWEN_TOOLS_TEMPLATE).render_chat(messages, tools=[WEATHER])
    assert info.value.param == param


def plan(tools, tool_choice=None, parallel=True, response_format=None):
    return plan_tools(tools, tool_choice, parallel, HermesToolParser, response_format)


def test_tool_choice_decides_prompt_parsing_and_grammar(compiler):
    assert plan([WEATHER]).parse and plan([WEATHER]).grammar is None and plan([WEATHER]).template_tools == [WEATHER]
    none = plan([WEATHER], "none")
    assert not none.parse and none.template_tools is None and none.grammar is None
    assert plan(None).template_tools is None and not plan(None, "auto").parse
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert named.parse and accepts(compiler, grammar_from_wire(named.grammar), time_call)
    assert not accepts(compiler, grammar_from_wire(named.grammar), weather)
    assert not accepts(compiler, grammar_from_wire(named.grammar), time_call + "\n" + time_call)
    required = grammar_from_wire(plan([WEATHER, TIME], "required").grammar)
    assert accepts(compiler, required, weather + "\n" + time_call)
    assert not accepts(compiler, grammar_from_wire(plan([WEATHER, TIME], "required", parallel=False).grammar),
                       weather + "\n" + time_call)


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (None, "required", "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([], "auto", "tools"),
    ([{"type": "retrieval"}], "auto", "tools[0].type"),
    ([{"type": "function"}], "auto", "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "auto", "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "required",
     "tools[0].function.parameters"),
])
def test_bad_tools_or_tool_choice_are_400_naming_the_field(tools, choice, param):
    with pytest.raises(ApiError) as info:
        plan(tools, choice)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_a_forced_call_refuses_a_response_format():
    with pytest.raises(ApiError) as info:
        plan([WEATHER], "required", response_format={"type": "json_object"})
    assert info.value.param == "response_format"
