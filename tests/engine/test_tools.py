"""Tool requests without the model: parsing, the grammar text, output parsing, streaming
hold-back, and the prefix cache's prefix arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ncap.engine import chat_params
from ncap.engine.chat_template import ChatTemplate
from ncap.engine.prefix_cache import common_prefix
from ncap.engine.tools import ToolChoiceText, parse_calls, tool_grammar, tool_spec
from ncap.errors import InvalidType, InvalidValue

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, InvalidValue, "tools.[0].type"),
        ({"tools": [WEATHER, WEATHER]}, InvalidValue, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            InvalidValue,
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            InvalidType,
            "tools.[0].function.parameters",
        ),
        (
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            InvalidValue,
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    body: dict[str, Any], error: type[Exception], param: str
) -> None:
    with pytest.raises(error) as info:
        chat_params({"messages": MESSAGES, **body})
    assert getattr(info.value, "param", None) == param


def test_tool_choice_none_means_no_tools_and_named_means_one() -> None:
    assert (
        chat_params({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"}).tools is None
    )
    named = tool_spec(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert named is not None and [t.name for t in named.callable] == ["get_time"]
    spec = tool_spec({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    assert spec is not None and (spec.choice, spec.parallel) == ("auto", False)


def test_grammar_offers_prose_only_under_auto() -> None:
    auto = tool_spec({"tools": [WEATHER, TIME]})
    required = tool_spec({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert auto is not None and required is not None
    assert tool_grammar(auto).startswith("root ::= tool-calls | prose\n")
    assert tool_grammar(required).startswith("root ::= tool-calls\n")
    assert '\\"get_weather\\"' in tool_grammar(required) or "get_weather" in tool_grammar(required)
    assert tool_grammar(required).count("root ::=") == 1


def test_calls_are_parsed_with_ids_and_json_arguments() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    read = parse_calls(text)
    assert read is not None and read.complete
    (call,) = read.calls
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"timezone": "UTC"})
    assert call.id.startswith("call_")
    assert parse_calls("Hello") is None


def test_a_closing_tag_inside_an_argument_string_is_part_of_the_string() -> None:
    # what a pattern-based reader split into two calls, or handed back as prose
    args = {"tz": "UTC+5 </tool_call> Even <tool_call>"}
    block = json.dumps({"name": "get_time", "arguments": args})
    read = parse_calls(f"<tool_call>\n{block}\n</tool_call>\n<tool_call>\n{block}\n</tool_call>")
    assert read is not None and read.complete
    assert [json.loads(c.arguments) for c in read.calls] == [args, args]


@pytest.mark.parametrize(
    ("text", "name", "arguments"),
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UT', "get_time", '{"tz": "UT'),
        ('<tool_call>\n{"name": "get_t', "get_time", ""),  # one tool begins so: completed
        ('<tool_call>\n{"name": "get_', "get_", ""),  # two do: as far as it went
        ("<tool_ca", "", ""),
        # the arguments were whole, the block was cut after them
        (
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"} }\n</tool',
            "get_time",
            '{"tz": "UTC"}',
        ),
    ],
)
def test_a_call_cut_by_the_token_limit_is_a_partial_call(
    text: str, name: str, arguments: str
) -> None:
    read = parse_calls(text, ["get_time", "get_weather"])
    assert read is not None and not read.complete
    (call,) = read.calls
    assert (call.name, call.arguments) == (name, arguments)


def test_whole_calls_before_a_cut_one_are_kept() -> None:
    whole = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    read = parse_calls(f'{whole}\n{whole}\n<tool_call>\n{{"name": "get_weather", "argu')
    assert read is not None and not read.complete
    assert [(c.name, c.arguments) for c in read.calls] == [
        ("get_time", "{}"),
        ("get_time", "{}"),
        ("get_weather", ""),
    ]


def test_a_call_is_held_back_until_its_choice_ends_prose_is_not() -> None:
    prose = ToolChoiceText()
    assert prose.feed("", False) == ("", None)
    assert prose.feed(" Hello", False) == (" Hello", None)
    call = ToolChoiceText()
    assert call.feed("<tool_call>\n", False) == ("", None)
    text, read = call.feed('{"name": "f", "arguments": {}}\n</tool_call>', True)
    assert text == "" and read is not None and read.calls[0].name == "f" and read.complete
    cut = ToolChoiceText(["f"])
    cut.feed("<tool_call>\n{", False)
    text, read = cut.feed('"na', True)  # a cut call is still a call, never prose
    assert text == "" and read is not None and not read.complete
    assert [(c.name, c.arguments) for c in read.calls] == [("f", "")]


def test_grammar_strings_refuse_raw_control_characters() -> None:
    spec = tool_spec({"tools": [WEATHER], "tool_choice": "required"})
    assert spec is not None
    (char,) = [r for r in tool_grammar(spec).splitlines() if r.startswith("char ::=")]
    assert "\\x00-\\x1F" in char and "\\x7F" in char


def test_chatml_fallback_renders_tools_calls_and_results() -> None:
    template = ChatTemplate(None)
    spec = tool_spec({"tools": [WEATHER]})
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "rain"},
    ]
    text = template.render(history, spec)
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [((), (1,), 0), ((1, 2, 3), (1, 2, 3), 3), ((1, 2, 3), (1, 2, 4), 2), ((5,), (1,), 0)],
)
def test_common_prefix(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    assert common_prefix(a, b) == n == common_prefix(b, a)
    long = tuple(range(1000))
    assert common_prefix(long, (*long[:777], -1)) == 777


def test_a_call_without_a_free_string_still_has_a_grammar() -> None:
    """A const name and enum-only arguments: no ``char`` rule to replace, no refusal."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            },
        },
    }
    spec = tool_spec({"tools": [tool], "tool_choice": "required"})
    assert spec is not None and tool_grammar(spec).startswith("root ::= tool-calls\n")
