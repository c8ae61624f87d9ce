"""Render (chat template + tokenize) and derender (incremental detokenize + stop strings)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.api.render import Renderer, RenderError, StopStringMatcher

MULTIBYTE_TEXT = "héllo 中文字符 😀🎉 naïve — ünïcödé ☃ world, the end"


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    from splitserve.models.loader import load_tokenizer

    tokenizer, template = load_tokenizer(None)  # the bundled SmolLM2 GGUF: a real byte-level BPE
    return Renderer(tokenizer, template)


def test_chat_render_matches_the_models_own_template(renderer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é 中"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    rendered = renderer.render_chat(messages)
    expected = renderer.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.text == expected
    assert rendered.text.endswith("<|im_start|>assistant\n")
    assert rendered.token_ids == renderer.tokenizer.encode(expected, add_special_tokens=False)


def test_chat_render_without_generation_prompt(renderer):
    rendered = renderer.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not rendered.text.endswith("<|im_start|>assistant\n")


def test_text_content_parts_are_joined(renderer):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    as_parts = renderer.render_chat([{"role": "user", "content": parts}])
    as_string = renderer.render_chat([{"role": "user", "content": "Hello there"}])
    assert as_parts.token_ids == as_string.token_ids


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([{"role": "user", "content": 42}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "messages[0].content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
    ([{"role": None, "content": "x"}], "messages[0].role"),
])
def test_bad_messages_raise_render_error_naming_the_field(renderer, messages, param):
    with pytest.raises(RenderError) as info:
        renderer.render_chat(messages)
    assert info.value.param == param


def test_developer_is_rendered_as_system_when_the_template_lacks_it(renderer):
    assert not renderer.developer_role  # SmolLM2's ChatML template knows system, user, assistant
    as_developer = renderer.render_chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}])
    as_system = renderer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}])
    assert as_developer.text == as_system.text


NAMING_TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]"
                   "{{ m.content }}{% endfor %}")


def test_a_template_that_names_developer_and_name_gets_them(renderer):
    custom = Renderer(renderer.tokenizer, NAMING_TEMPLATE + "{# developer #}")
    assert custom.developer_role
    text = custom.render_chat([{"role": "developer", "content": "d"},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}]).text
    assert text == "[developer]d[user:ann]hi"


def test_null_content_is_allowed_only_for_an_assistant_calling_tools(renderer):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    custom = Renderer(renderer.tokenizer, NAMING_TEMPLATE)
    text = custom.render_chat([{"role": "user", "content": "x"},
                               {"role": "assistant", "content": None, "tool_calls": [call]}]).text
    # this template has no tool support: the call is written into the content (the fallback)
    assert text == '[user]x[assistant]<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_incremental_detokenization_never_splits_a_character(renderer):
    token_ids = renderer.tokenize(MULTIBYTE_TEXT, add_special_tokens=False)
    # Byte-level BPE splits several of these characters over two or more tokens.
    assert any("\ufffd" in renderer.detokenize([t]) for t in token_ids)
    out = renderer.new_output_text(stop=[])
    deltas = [out.add_tokens([t], finished=i == len(token_ids) - 1) for i, t in enumerate(token_ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE_TEXT == out.text


def test_special_tokens_are_not_shown(renderer):
    token_ids = renderer.tokenize("Hi<|im_end|>", add_special_tokens=False)
    out = renderer.new_output_text(stop=[])
    assert out.add_tokens(token_ids, finished=True) == "Hi"


@pytest.mark.parametrize("stop,expected", [
    (["o 中"], "héll"),            # spans a space and a multi-byte character, over tokens
    (["😀🎉"], "héllo 中文字符 "),
    (["the end", "world"], "héllo 中文字符 😀🎉 naïve — ünïcödé ☃ "),  # earliest hit wins
    (["not there"], MULTIBYTE_TEXT),
])
def test_stop_strings_match_across_tokens_and_are_trimmed(renderer, stop, expected):
    token_ids = renderer.tokenize(MULTIBYTE_TEXT, add_special_tokens=False)
    out = renderer.new_output_text(stop=stop)
    deltas = [out.add_tokens([t], finished=i == len(token_ids) - 1) for i, t in enumerate(token_ids)]
    assert "".join(deltas) == expected == out.text
    assert out.stopped == (expected != MULTIBYTE_TEXT)


def test_after_a_stop_hit_nothing_more_is_emitted(renderer):
    out = renderer.new_output_text(stop=["b"])
    assert out.add_tokens(renderer.tokenize("abc", add_special_tokens=False), finished=False) == "a"
    assert out.add_tokens(renderer.tokenize("more", add_special_tokens=False), finished=True) == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1,
       max_size=4), max_size=3), cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stop_matcher_equals_cutting_the_whole_text_at_the_stop_complete_first(text, stops, cuts):
    # the stop complete earliest (on a tie the longer, which starts earlier): what a character-at-a-time
    # stream stops on, whatever the cuts (hypothesis found stops "a" and "baa" on "baa" cut after "ba")
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    expected = text[:min(hits)[1]] if hits else text
    matcher = StopStringMatcher(stops)
    bounds = sorted(set([0, len(text)] + [c for c in cuts if c <= len(text)]))
    emitted, hit = "", False
    for lo, hi in zip(bounds, bounds[1:]):
        piece, hit = matcher.feed(text[lo:hi])
        emitted += piece
        if hit:
            break
    if not hit:
        emitted += matcher.flush()
    assert emitted == expected
    assert hit == bool(hits)


def test_a_stop_that_starts_earlier_but_ends_later_loses_to_the_one_complete_first_however_cut():
    for cuts in ([], [1], [2]):
        matcher, emitted = StopStringMatcher(["a", "baa"]), ""
        for lo, hi in zip([0, *cuts], [*cuts, 3]):
            piece, hit = matcher.feed("baa"[lo:hi])
            emitted += piece
            if hit:
                break
        assert (emitted, hit) == ("b", True), cuts
