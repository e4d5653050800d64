"""Tool-call parsers: what parse() finds in whole outputs; that streaming finds the same for any
cutting of the output into deltas, each call's name first and then its arguments in pieces; and
what streaming keeps of a call that proves broken after it began to stream."""

from __future__ import annotations

import json
import re

import pytest
from helpers import cuttings

from nanoserve.serve.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedOutput,
    StreamDelta,
    ToolCallDelta,
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
# nested objects and arrays; braces, brackets, quotes, escaped quotes and backslashes in strings
EDIT = (r'{"path": "a.py", "patch": {"old": "def f() {\n  return \"}\";\n}", '
        r'"new": "x = \"{[\\\"}\""}, "ranges": [{"from": 1, "to": [2, {}]}, "]}"], '
        r'"empty": {}}')

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
    "compact arguments are kept as written": (
        '<tool_call>{"name":"add","arguments":{"a":1,"b":[2.5,true,null]}}</tool_call>',
        None, [("add", '{"a":1,"b":[2.5,true,null]}')]),
    "arguments' spacing is kept": (
        '<tool_call>{"name": "f", "arguments": {\n  "a" : [ 1 ,2 ] ,"b":{ }\n}}</tool_call>',
        None, [("f", '{\n  "a" : [ 1 ,2 ] ,"b":{ }\n}')]),
    "unicode arguments": (
        '<tool_call>\n{"name": "translate", "arguments": '
        '{"text": "Grüße aus Zürich ☀", "to": "日本語"}}\n</tool_call>',
        None, [("translate", '{"text": "Grüße aus Zürich ☀", "to": "日本語"}')]),
    "escaped unicode arguments stay escaped": (
        r'<tool_call>{"name": "greet", "arguments": {"who": "Jos\u00e9 \ud83d\ude00"}}'
        r'</tool_call>',
        None, [("greet", r'{"who": "Jos\u00e9 \ud83d\ude00"}')]),
    "a lone surrogate escape stays escaped": (
        r'<tool_call>{"name": "f", "arguments": {"s": "\ud83d"}}</tool_call>',
        None, [("f", r'{"s": "\ud83d"}')]),
    "nested braces and braces, quotes and escapes in strings": (
        '<tool_call>{"name": "edit", "arguments": ' + EDIT + '}</tool_call>', None,
        [("edit", EDIT)]),
    "arguments before the name": (
        '<tool_call>{"arguments": {"tz": "Europe/Paris"}, "name": "get_time"}</tool_call>',
        None, [TIME]),
    "members after the arguments": (
        '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}, "id": [1, {}]}'
        '</tool_call>', None, [TIME]),
    "an escaped name": (
        r'<tool_call>{"name": "get\u005ftime", "arguments": {"tz": "Europe/Paris"}}</tool_call>',
        None, [TIME]),
    "an escaped key": (
        r'<tool_call>{"name": "get_time", "argument\u0073": {"tz": "Europe/Paris"}}</tool_call>',
        None, [TIME]),
    "the first of a repeated key counts": (
        '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}, "name": "x", '
        '"parameters": {}}</tool_call>', None, [TIME]),
    "a name that is not a string is text": (
        '<tool_call>{"name": get_time, "arguments": {}}</tool_call>',
        '<tool_call>{"name": get_time, "arguments": {}}</tool_call>', []),
    "an empty name is text": (
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>', []),
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
    "nested braces and braces, quotes and escapes in strings": (
        '{"name": "edit", "parameters": ' + EDIT + '}; ' + L_TIME, None,
        [("edit", EDIT), TIME]),
    "compact arguments are kept as written": ('{"name":"f","parameters":{"a":[1,{"b":2}]}}',
                                               None, [("f", '{"a":[1,{"b":2}]}')]),
    "parameters before the name": ('{"parameters": {"tz": "Europe/Paris"}, "name": "get_time"}',
                                   None, [TIME]),
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

# where streaming differs from parse(): a call that began to stream and then proved broken stays a
# call, with the pieces it had, and nothing more of it goes out (case -> content, calls)
HERMES_STREAMED = {
    "malformed JSON is text": ("Calling.", [("get_weather", '{"city": }')]),
    "an unclosed tag is text": ("Sure.", [("get_weather", '{"city": "Par')]),
    "an unclosed tag around complete JSON is text": ("", [("f", "{}")]),
    "a good call then a bad one": ("", [WEATHER, ("g", "{oops}")]),
}
LLAMA3_STREAMED = {
    "malformed JSON is text": ("", [("f", '{"x": }')]),
    "an unclosed call is text": ("", [("get_weather", '{"city": "Par')]),
    "a call then a bad call": ("", [("f", "{}"), ("g", "{")]),
}

CASES = [(HermesToolParser, text, content, calls, HERMES_STREAMED.get(name), name)
         for name, (text, content, calls) in HERMES_CASES.items()] + \
        [(Llama3JsonToolParser, text, content, calls, LLAMA3_STREAMED.get(name), name)
         for name, (text, content, calls) in LLAMA3_CASES.items()]
CASE_IDS = [f"{case[0].__name__}: {case[-1]}" for case in CASES]


def stream_deltas(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    """The content and the call deltas that feeding `pieces`, then finish(), hands out."""
    content, deltas = [], []
    for out in [*map(parser.feed, pieces), parser.finish()]:
        content.append(out.content)
        deltas += out.tool_calls
    return "".join(content), deltas


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments) that streaming `pieces` hands out, checking
    that each call's first delta alone carries its id and name, that its later deltas each carry
    a piece of its arguments, and that indices run 0, 1, ..."""
    content, deltas = stream_deltas(parser, pieces)
    calls: list[list[str]] = []
    ids = set()
    for d in deltas:
        if d.index == len(calls):
            assert CALL_ID.fullmatch(d.id) and d.id not in ids and d.name
            ids.add(d.id)
            calls.append([d.name, d.arguments])
        else:
            assert d.index == len(calls) - 1 and d.id is None and d.name is None and d.arguments
            calls[-1][1] += d.arguments
    return content, [(name, arguments) for name, arguments in calls]


def feed_each(parser: ToolParser, pieces: list[str]) -> list[StreamDelta]:
    return [parser.feed(piece) for piece in pieces]


@pytest.mark.parametrize("cls, text, content, calls, streamed, name", CASES, ids=CASE_IDS)
def test_parse_finds_the_content_and_calls(cls, text, content, calls, streamed, name):
    parsed = cls().parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("cls, text, content, calls, streamed, name", CASES, ids=CASE_IDS)
def test_streaming_any_cutting_gives_what_parse_gives_but_for_broken_calls(
        cls, text, content, calls, streamed, name):
    """Streamed content concatenates to parse()'s content exactly (None as ""), not only after
    stripping; each call comes once, with parse()'s name, its pieces concatenating to exactly
    its arguments. A broken call that began to stream gives what the case says, every cutting
    alike."""
    parsed = cls().parse(text)
    expected = (parsed.content or "", [(c.name, c.arguments) for c in parsed.tool_calls])
    if streamed is not None:
        assert streamed != expected
        expected = streamed
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
    assert parser.feed('Let me check.\n<tool_call>\n{"name": "get_weather", ') == \
        StreamDelta("Let me check.", [])
    out = parser.feed('"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    assert out.content == ""
    [call] = out.tool_calls
    assert (call.index, call.name, call.arguments) == (0, *WEATHER)


def test_hermes_streams_the_name_first_then_the_arguments_as_they_come():
    parser = HermesToolParser()
    out = feed_each(parser, ['<tool_call>\n{"name": "get_we', 'ather", "arguments": ',
                             '{"city": ', '"Paris", "unit": "celsius"', "}", "}\n</tool_",
                             "call>"])
    assert [o.content for o in out] == [""] * 7
    assert [o.tool_calls for o in out[:2]] == [[], []]  # no name, then no arguments yet
    [first] = out[2].tool_calls
    assert CALL_ID.fullmatch(first.id)
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": ')
    assert [o.tool_calls for o in out[3:]] == [
        [ToolCallDelta(0, None, None, '"Paris", "unit": "celsius"')],
        [ToolCallDelta(0, None, None, "}")], [], []]  # neither the outer brace nor the tag
    assert parser.finish() == StreamDelta("", [])


def test_a_name_and_an_opened_object_give_a_first_delta_with_empty_arguments():
    parser = HermesToolParser()
    [first] = parser.feed('<tool_call>{"name": "f", "arguments": ').tool_calls + \
        parser.feed("{").tool_calls
    assert (first.index, first.name, first.arguments) == (0, "f", "{")
    parser = Llama3JsonToolParser()
    assert parser.feed('{"name": "f", "parameters": ') == StreamDelta("", [])
    [first] = parser.feed("{").tool_calls
    assert (first.index, first.name, first.arguments) == (0, "f", "{")


def test_an_escaped_name_is_decoded_once_its_string_closes():
    parser = HermesToolParser()
    assert parser.feed(r'<tool_call>{"name": "get\u005f') == StreamDelta("", [])
    assert parser.feed(r'we\"ather\\", "arguments": ') == StreamDelta("", [])
    [first] = parser.feed('{"a').tool_calls
    assert (first.name, first.arguments) == ('get_we"ather\\', '{"a')


def file_arguments(lines: int = 200) -> str:
    """A long arguments object, as an agent writing a file writes it: JSON-escaped code full of
    braces, brackets, quotes and backslashes."""
    code = "".join(f'def f{i}(x):\n    return {{"k{i}": [x, "}}\\"{{", \'\\\\\']}}\n'
                   for i in range(lines))
    return json.dumps({"path": "src/big.py", "content": code, "mode": {"append": False}})


LONG_CALLS = {HermesToolParser: '<tool_call>\n{{"name": "write_file", "arguments": {}}}\n'
                                "</tool_call>",
              Llama3JsonToolParser: '<|python_tag|>{{"name": "write_file", "parameters": {}}}'}


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser])
def test_long_arguments_fed_a_character_at_a_time_stream_as_they_are_written(cls):
    args = file_arguments()
    text = LONG_CALLS[cls].format(args)
    args_at = text.index(args)
    parser = cls()
    sent = ""
    deltas = []
    for i, out in enumerate(feed_each(parser, list(text))):
        assert out.content == ""
        deltas += out.tool_calls
        sent = "".join(d.arguments for d in deltas)
        seen = text[args_at:i + 1][:len(args)]  # the arguments' text written so far
        if i < args_at:
            assert deltas == []
        elif cls is HermesToolParser:
            # nothing held back, but for what could be the start of the close tag
            assert seen.startswith(sent) and len(seen) - len(sent) < len("</tool_call>")
        else:
            assert sent == seen
        if i == args_at:
            assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "write_file", "{")]
    assert parser.finish() == StreamDelta("", [])
    assert len(deltas) > len(args) // 2
    assert sent == args == cls().parse(text).tool_calls[0].arguments
    assert json.loads(sent) == json.loads(args)


@pytest.mark.parametrize("cls, text", [
    (HermesToolParser, '<tool_call>{"arguments": {"tz": "Europe/Paris"}, "name": "get_time"}'
                       '</tool_call>'),
    (HermesToolParser, r'<tool_call>{"name": "get_time", "arguments": "{\"tz\": '
                       r'\"Europe/Paris\"}"}</tool_call>'),
    (Llama3JsonToolParser, '{"parameters": {"tz": "Europe/Paris"}, "name": "get_time"}'),
    (Llama3JsonToolParser, r'{"name": "get_time", "parameters": "{\"tz\": \"Europe/Paris\"}"}'),
], ids=["hermes, arguments first", "hermes, string arguments", "llama3, parameters first",
        "llama3, string parameters"])
def test_arguments_before_the_name_or_as_a_string_go_out_whole_at_the_calls_end(cls, text):
    parser = cls()
    outs = feed_each(parser, list(text))
    assert all(o == StreamDelta("", []) for o in outs[:-1])
    [call] = outs[-1].tool_calls
    assert (call.index, call.name, call.arguments) == (0, *TIME)
    assert parser.finish() == StreamDelta("", [])


def test_hermes_holds_back_what_could_start_the_close_tag_inside_the_arguments():
    parser = HermesToolParser()
    [first] = parser.feed('<tool_call>{"name": "f", "arguments": {"html": "</tool').tool_calls
    assert first.arguments == '{"html": "'
    assert parser.feed('s>"}').tool_calls == [ToolCallDelta(0, None, None, '</tools>"}')]
    assert parser.feed("}</tool_call>") == StreamDelta("", [])


def test_hermes_a_call_broken_after_it_streamed_stays_a_call_and_goes_no_further():
    text = 'Sure.\n<tool_call>{"name": "f", "arguments": {"a": 1}, }</tool_call>\nDone.'
    parser = HermesToolParser()
    content, deltas = stream_deltas(parser, list(text))
    assert content == "Sure.\n\nDone."  # no piece of the broken call is content as well
    assert [(d.index, d.name) for d in deltas[:1]] == [(0, "f")]
    assert "".join(d.arguments for d in deltas) == '{"a": 1}'
    assert HermesToolParser().parse(text) == ParsedOutput(text, [])  # parse(): content


@pytest.mark.parametrize("cls, text", [
    (HermesToolParser, 'Writing.<tool_call>{"name": "f", "arguments": {"code": "x = {'),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"code": "x = {'),
])
def test_a_call_cut_off_after_it_streamed_gets_nothing_more_at_finish(cls, text):
    """As when max_tokens cuts the model off mid-arguments."""
    parser = cls()
    deltas = [d for out in feed_each(parser, [text[:-3], text[-3:]]) for d in out.tool_calls]
    assert "".join(d.arguments for d in deltas) == '{"code": "x = {'
    assert parser.finish() == StreamDelta("", [])
    assert cls().parse(text).tool_calls == []


def test_hermes_two_calls_stream_as_indices_0_and_1_each_name_first():
    text = "Checking." + H_WEATHER + "\n" + H_TIME
    content, deltas = stream_deltas(HermesToolParser(), list(text))
    assert content == "Checking."
    assert [(d.index, d.name) for d in deltas if d.name] == [(0, "get_weather"), (1, "get_time")]
    for index, (name, arguments) in enumerate([WEATHER, TIME]):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == name and all(d.name is None for d in mine[1:])
        assert len(mine) == len(arguments) and "".join(d.arguments for d in mine) == arguments
    assert [d.index for d in deltas] == sorted(d.index for d in deltas)


def test_llama3_streams_plain_text_at_once():
    parser = Llama3JsonToolParser()
    assert parser.feed("Paris").content == "Paris"
    assert parser.feed(" is the capital.").content == " is the capital."


def test_llama3_streams_each_calls_name_then_its_arguments_in_pieces():
    parser = Llama3JsonToolParser()
    [first] = parser.feed('<|python_tag|>{"name": "get_weather", "parameters": {"city": ') \
        .tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": ')
    assert parser.feed('"Paris", "unit": "celsius"}') == \
        StreamDelta("", [ToolCallDelta(0, None, None, '"Paris", "unit": "celsius"}')])
    assert parser.feed("}") == StreamDelta("", [])
    [second] = parser.feed('; {"name": "get_time", "parameters": {').tool_calls
    assert (second.index, second.name, second.arguments) == (1, "get_time", "{")
    assert parser.feed('"tz": "Europe/Paris"}}') == \
        StreamDelta("", [ToolCallDelta(1, None, None, '"tz": "Europe/Paris"}')])
    assert parser.finish() == StreamDelta("", [])


def test_llama3_separated_calls_fed_a_character_at_a_time_stream_in_pieces():
    _, deltas = stream_deltas(Llama3JsonToolParser(), list(L_WEATHER + "; " + L_TIME))
    for index, (name, arguments) in enumerate([WEATHER, TIME]):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == name and len(mine) == len(arguments)
        assert "".join(d.arguments for d in mine) == arguments


def test_llama3_a_call_broken_after_it_streamed_stays_a_call_and_calls_go_on():
    text = '{"name": "f", "parameters": {"a": 1}, "b": }; {"name": "g", "parameters": {}} ok'
    assert stream(Llama3JsonToolParser(), list(text)) == ("ok", [("f", '{"a": 1}'), ("g", "{}")])
    assert Llama3JsonToolParser().parse(text).content == text


def test_hermes_finish_flushes_an_unclosed_call_that_did_not_stream_as_content():
    parser = HermesToolParser()
    assert parser.feed('<tool_call>{"name": "f", "argu') == StreamDelta("", [])
    out = parser.finish()
    assert (out.content, out.tool_calls) == ('<tool_call>{"name": "f", "argu', [])


def test_llama3_finish_flushes_an_unclosed_object_that_did_not_stream_as_content():
    parser = Llama3JsonToolParser()
    assert parser.feed('{"name": "f", "para') == StreamDelta("", [])
    out = parser.finish()
    assert (out.content, out.tool_calls) == ('{"name": "f", "para', [])


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
