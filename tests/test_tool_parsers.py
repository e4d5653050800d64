"""Tool-call parsers: what parse() finds in whole outputs, and that streaming finds the same for
any cutting of the output into deltas."""

from __future__ import annotations

import re

import pytest
from helpers import cuttings

from nanoserve.serve.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    StreamDelta,
    ToolParser,
    make_tool_parser,
    tool_parser_for,
)

CALL_ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", '{"tz": "Europe/Paris"}')

H_WEATHER = ('<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
H_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
H_BAD = '<tool_call>{"name": "g", "arguments": {oops}}</tool_call>'

# (text, parse()'s content, parse()'s calls as (name, arguments))
HERMES_CASES = {
    "one call": (H_WEATHER, None, [WEATHER]),
    "two calls": (H_WEATHER + "\n" + H_TIME, None, [WEATHER, TIME]),
    "text before the call": ("Let me look that up.\n\n" + H_WEATHER,
                             "Let me look that up.", [WEATHER]),
    "text around the calls": ("First.\n" + H_WEATHER + "\nThen: done.  \n",
                              "First.\n\nThen: done.", [WEATHER]),
    "arguments as a string": (r'<tool_call>{"name": "search", "arguments": '
                              r'"{\"query\": \"nanoserve\"}"}</tool_call>',
                              None, [("search", '{"query": "nanoserve"}')]),
    "compact arguments are reserialized": (
        '<tool_call>{"name":"add","arguments":{"a":1,"b":[2.5,true,null]}}</tool_call>',
        None, [("add", '{"a": 1, "b": [2.5, true, null]}')]),
    "unicode arguments": (
        '<tool_call>\n{"name": "translate", "arguments": '
        '{"text": "Grüße aus Zürich ☀", "to": "日本語"}}\n</tool_call>',
        None, [("translate", '{"text": "Grüße aus Zürich ☀", "to": "日本語"}')]),
    "escaped unicode arguments": (
        r'<tool_call>{"name": "greet", "arguments": {"who": "Jos\u00e9 \ud83d\ude00"}}'
        r'</tool_call>',
        None, [("greet", '{"who": "José 😀"}')]),
    "malformed JSON is text": (
        'Calling.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        'Calling.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        []),
    "a call without a name is text": (
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', []),
    "a call without arguments is text": (
        '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    "list arguments are text": (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    "an unclosed tag is text": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    "an unclosed tag around complete JSON is text": (
        '<tool_call>\n{"name": "f", "arguments": {}}\n',
        '<tool_call>\n{"name": "f", "arguments": {}}', []),
    "a good call then a bad one": (H_WEATHER + "\n" + H_BAD, H_BAD, [WEATHER]),
    "no calls": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "tag look-alikes are text": ("Use <tool> or <tool_calls>, not a < b.\n",
                                 "Use <tool> or <tool_calls>, not a < b.", []),
    "a tag's start at the end is text": ("Let me see <tool_ca", "Let me see <tool_ca", []),
    "a close tag alone is text": ("done </tool_call>", "done </tool_call>", []),
    "empty": ("", None, []),
    "only whitespace": (" \n\t ", None, []),
}

L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
L_TIME = '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'

LLAMA3_CASES = {
    "one call": (L_WEATHER, None, [WEATHER]),
    "after the python tag": ("<|python_tag|>" + L_WEATHER, None, [WEATHER]),
    "two calls": (L_WEATHER + "; " + L_TIME, None, [WEATHER, TIME]),
    "two calls on two lines": (L_WEATHER + "\n" + L_TIME, None, [WEATHER, TIME]),
    "an arguments key": ('{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
                         None, [TIME]),
    "arguments as a string": (r'{"name": "search", "parameters": "{\"query\": \"llama\"}"}',
                              None, [("search", '{"query": "llama"}')]),
    "unicode arguments": ('{"name": "translate", "parameters": {"text": "naïve café", '
                          '"to": "中文"}}',
                          None, [("translate", '{"text": "naïve café", "to": "中文"}')]),
    "braces and quotes inside strings": (
        r'{"name": "echo", "parameters": {"s": "a}b{c\"}\\"}}',
        None, [("echo", r'{"s": "a}b{c\"}\\"}')]),
    "whitespace and a trailing separator": (
        '\n  <|python_tag|> {"name": "f", "parameters": {}} ;\n', None, [("f", "{}")]),
    "text before the JSON is all text": ('Here it is: {"name": "f", "parameters": {}}',
                                         'Here it is: {"name": "f", "parameters": {}}', []),
    "no calls": ("Paris is the capital of France.", "Paris is the capital of France.", []),
    "malformed JSON is text": ('{"name": "f", "parameters": {"x": }}',
                               '{"name": "f", "parameters": {"x": }}', []),
    "a call without a name is text": ('{"parameters": {"x": 1}}',
                                      '{"parameters": {"x": 1}}', []),
    "JSON that is not a call is text": ('{"answer": 42}', '{"answer": 42}', []),
    "an unclosed call is text": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par', []),
    "a call then text": ('{"name": "f", "parameters": {}}; and then some text',
                         "and then some text", [("f", "{}")]),
    "a call then a bad call": ('{"name": "f", "parameters": {}};\n{"name": "g", "parameters": {',
                               '{"name": "g", "parameters": {', [("f", "{}")]),
    "a call then a stray brace": ('{"name": "f", "parameters": {}}}', "}", [("f", "{}")]),
    "python code after the tag is text": ('<|python_tag|>print("hi")',
                                          '<|python_tag|>print("hi")', []),
    "the python tag alone is text": ("<|python_tag|>", "<|python_tag|>", []),
    "empty": ("", None, []),
}

CASES = [(HermesToolParser, text, content, calls, name)
         for name, (text, content, calls) in HERMES_CASES.items()] + \
        [(Llama3JsonToolParser, text, content, calls, name)
         for name, (text, content, calls) in LLAMA3_CASES.items()]
CASE_IDS = [f"{cls.__name__}: {name}" for cls, _, _, _, name in CASES]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments) that streaming `pieces` hands out, checking
    that each call's first delta alone carries its id and name, and that indices run 0, 1, ..."""
    deltas = []
    content = []
    for piece in pieces:
        out = parser.feed(piece)
        content.append(out.content)
        deltas += out.tool_calls
    out = parser.finish()
    content.append(out.content)
    deltas += out.tool_calls

    calls: list[list[str]] = []
    ids = set()
    for d in deltas:
        if d.index == len(calls):
            assert CALL_ID.fullmatch(d.id) and d.id not in ids and d.name
            ids.add(d.id)
            calls.append([d.name, d.arguments])
        else:
            assert d.index == len(calls) - 1 and d.id is None and d.name is None
            calls[-1][1] += d.arguments
    return "".join(content), [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("cls, text, content, calls, name", CASES, ids=CASE_IDS)
def test_parse_finds_the_content_and_calls(cls, text, content, calls, name):
    parsed = cls().parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("cls, text, content, calls, name", CASES, ids=CASE_IDS)
def test_streaming_any_cutting_gives_what_parse_gives(cls, text, content, calls, name):
    """Streamed content concatenates to parse()'s content exactly (None as ""), not only after
    stripping; each call comes once, with parse()'s name and exactly its arguments."""
    parsed = cls().parse(text)
    expected = (parsed.content or "", [(c.name, c.arguments) for c in parsed.tool_calls])
    for pieces in cuttings(text):
        assert stream(cls(), pieces) == expected, pieces


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser])
def test_call_ids_are_unique_openai_style_ids(cls):
    text = {HermesToolParser: H_WEATHER + H_TIME, Llama3JsonToolParser: L_WEATHER + ";" + L_TIME}
    ids = [c.id for c in cls().parse(text[cls]).tool_calls + cls().parse(text[cls]).tool_calls]
    assert len(set(ids)) == 4 and all(CALL_ID.fullmatch(i) for i in ids)


def test_hermes_holds_back_a_possible_open_tag_and_releases_it_when_it_is_not_one():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool").content == "Hi"
    assert parser.feed("s are fun").content == " <tools are fun"


def test_hermes_streams_text_before_a_call_before_the_call_completes():
    parser = HermesToolParser()
    assert parser.feed('Let me check.\n<tool_call>\n{"name": "get_weather", ').content == \
        "Let me check."
    out = parser.feed('"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    assert out.content == ""
    [call] = out.tool_calls
    assert (call.index, call.name, call.arguments) == (0, *WEATHER)


def test_hermes_hands_out_a_call_whole_when_its_close_tag_arrives():
    parser = HermesToolParser()
    assert parser.feed(H_WEATHER[:-1]) == StreamDelta("", [])
    [call] = parser.feed(">").tool_calls
    assert (call.index, call.name, call.arguments) == (0, *WEATHER)
    assert parser.finish().tool_calls == []


def test_hermes_finish_flushes_an_unclosed_call_as_content():
    parser = HermesToolParser()
    assert parser.feed('<tool_call>{"name": "f", "arguments": {').content == ""
    out = parser.finish()
    assert (out.content, out.tool_calls) == ('<tool_call>{"name": "f", "arguments": {', [])


def test_llama3_streams_plain_text_at_once():
    parser = Llama3JsonToolParser()
    assert parser.feed("Paris").content == "Paris"
    assert parser.feed(" is the capital.").content == " is the capital."


def test_llama3_holds_json_until_its_object_closes():
    parser = Llama3JsonToolParser()
    assert parser.feed('<|python_tag|>{"name": "get_weather", "parameters": {"city": ') == \
        StreamDelta("", [])
    assert parser.feed('"Paris", "unit": "celsius"}') == StreamDelta("", [])
    [call] = parser.feed("}").tool_calls
    assert (call.index, call.name, call.arguments) == (0, *WEATHER)
    [call] = parser.feed("; " + L_TIME).tool_calls
    assert (call.index, call.name, call.arguments) == (1, *TIME)


def test_llama3_finish_flushes_an_unclosed_object_as_content():
    parser = Llama3JsonToolParser()
    parser.feed('{"name": "f", "parameters": {')
    out = parser.finish()
    assert (out.content, out.tool_calls) == ('{"name": "f", "parameters": {', [])


def test_models_map_to_their_tool_parsers():
    assert {t: tool_parser_for(t) for t in ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral")} \
        == {"qwen3": "hermes", "qwen3_moe": "hermes", "qwen2": "hermes", "llama": "llama3_json",
            "mistral": None}


def test_make_tool_parser_makes_a_new_parser_of_each_registered_name():
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
    for name, cls in TOOL_PARSERS.items():
        first, second = make_tool_parser(name), make_tool_parser(name)
        assert type(first) is cls and first is not second


def test_make_tool_parser_names_the_known_parsers_for_an_unknown_one():
    with pytest.raises(ValueError, match=r"unknown tool parser 'mistral'; known: hermes, "
                                         r"llama3_json"):
        make_tool_parser("mistral")
