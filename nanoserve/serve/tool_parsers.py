"""Tool calls out of a model's text, whole (parse) or as it streams (feed, then finish).

A parser reads one request's output. A call is a JSON object with a non-empty string "name" and
"arguments" (Llama's "parameters") that is an object or a string holding the JSON; where a key
comes twice, its first member counts (streaming cannot wait for later ones). A call's arguments
are the model's own text of the object, not a re-serialization (its spacing and escapes kept:
no ensure_ascii question arises), or the string's content.

Streaming hands a call out as OpenAI streams it: once its name is read and its arguments object
has opened, a first delta with the call's index, id and name, then the arguments' text in
pieces as the model writes them, up to the brace that closes them. A call whose arguments come
before its name, or are not an object, goes out whole, in one delta, once its text is complete.

For valid calls streaming agrees with parse for any cutting of the text into deltas: the content
pieces concatenate to parse()'s content ("" for None), and each call comes out once, in order,
with parse()'s name, its argument pieces concatenating to parse()'s arguments.

Content is the text outside the calls, stripped of surrounding whitespace. Text that only looks
like a call (bad JSON, no name, no arguments, an open tag the output never closed) is content,
verbatim: nothing here raises on a model's output.

Broken calls are where streaming and parse() differ. A call that began to stream and then proves
broken (bad JSON, cut off by max_tokens, its tag never closed) stays a call in the stream, with
the pieces it had: a stream cannot take back what it sent (OpenAI and vLLM stream calls the same
way). Nothing more goes out for it, not even as content. parse() of the same text, which sees
it whole, reports it as content.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from json.decoder import scanstring


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it: the model's own (see above)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there was only tool calls (or nothing)
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: its first piece carries id and name; the arguments of
    all its pieces concatenate to the call's arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    content: str
    tool_calls: list[ToolCallDelta]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_JSON_SPACE = " \t\n\r"
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_ARGUMENT_KEYS = ("arguments", "parameters")


def _skip_json_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _object_members(text: str, pos: int) -> tuple[list[tuple[str, object, int, int]], int]:
    """The members of the JSON object at text[pos], in order, as (key, value, where the value's
    text starts, where it ends), and where the object ends. ValueError where it is not one."""
    if not text.startswith("{", pos):
        raise ValueError("not an object")
    members: list[tuple[str, object, int, int]] = []
    pos = _skip_json_space(text, pos + 1)
    if text.startswith("}", pos):
        return members, pos + 1
    while True:
        if not text.startswith('"', pos):
            raise ValueError("not a key")
        key, pos = scanstring(text, pos + 1)
        pos = _skip_json_space(text, pos)
        if not text.startswith(":", pos):
            raise ValueError("no colon")
        start = _skip_json_space(text, pos + 1)
        value, pos = _DECODER.raw_decode(text, start)
        members.append((key, value, start, pos))
        pos = _skip_json_space(text, pos)
        if text.startswith("}", pos):
            return members, pos + 1
        if not text.startswith(",", pos):
            raise ValueError("no comma")
        pos = _skip_json_space(text, pos + 1)


def read_call(text: str, pos: int = 0) -> tuple[str, str, int] | None:
    """The call whose JSON object starts at text[pos] as (name, arguments, where the object
    ends), or None when the text there is not one (see the module's docstring)."""
    try:
        members, end = _object_members(text, pos)
    except (ValueError, RecursionError):
        return None
    name = next((value for key, value, _, _ in members if key == "name"), None)
    arguments = next((m for m in members if m[0] in _ARGUMENT_KEYS), None)
    if not isinstance(name, str) or not name or arguments is None:
        return None
    _, value, start, stop = arguments
    if isinstance(value, dict):
        return name, text[start:stop], end
    if isinstance(value, str):
        return name, value, end
    return None


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (not all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StrippedPieces:
    """Turns pieces of a text into pieces of the text stripped of surrounding whitespace: leading
    whitespace is dropped, trailing whitespace is held until more text follows it, and what is
    held at the end is never handed out."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:
        return None


class _CallText:
    """A call's JSON object read as its text grows, each character once: its first "name"
    member's string, where its arguments object opens and closes (when it can stream: an object
    after the name), and where the call's object ends. Braces and brackets are counted outside
    strings, escapes followed: on valid JSON all of this is what read_call finds, and on invalid
    JSON read_call finds no call whatever this reads."""

    def __init__(self, start: int) -> None:
        self.pos = start  # the text before pos has been read
        self.depth = 0  # braces and brackets open, outside strings
        self.in_string = False
        self.escaped = False
        self.string_at = 0  # where the string being read opened
        # "object" until its brace; at depth 1 "key", "value" or "" (in one); "junk": no object
        self.expect = "object"
        self.key: str | None = None  # the key of the member being read
        self.met: set[str] = set()  # "name", "arguments": their first members have begun
        self.reading_name = False
        self.name: str | None = None
        self.args_at: int | None = None  # where the arguments object opens, when it streams
        self.args_end: int | None = None  # just after the brace that closes it
        self.end: int | None = None  # just after the brace that closes the call's object
        self.index: int | None = None  # the call's index, once its first delta went out
        self.sent = 0  # in the text, where the arguments not yet handed out start

    def read(self, text: str, stop: int) -> None:
        """Reads on up to text[stop] or the object's end, whichever comes first."""
        while self.pos < stop and self.end is None:
            self._char(text, self.pos)
            self.pos += 1

    def _char(self, text: str, i: int) -> None:
        c = text[i]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_read(text[self.string_at:i + 1])
            return
        if self.depth == 0:
            if self.expect == "object" and c == "{":
                self.depth, self.expect = 1, "key"
            elif c not in _JSON_SPACE:
                self.expect = "junk"  # not an object: nothing more to learn
            return
        if self.depth == 1 and self.expect == "value" and c not in _JSON_SPACE:
            self._value_opens(c, i)
        if c == '"':
            self.in_string, self.string_at = True, i
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.end = i + 1
            elif self.depth == 1 and self.args_at is not None and self.args_end is None:
                self.args_end = i + 1
        elif self.depth == 1 and c == ":":
            self.expect = "value"
        elif self.depth == 1 and c == ",":
            self.expect = "key"

    def _string_read(self, literal: str) -> None:
        if self.expect == "key":
            self.key, self.expect = _json_string(literal), ""
        elif self.reading_name:
            self.reading_name = False
            self.name = _json_string(literal) or None

    def _value_opens(self, c: str, i: int) -> None:
        self.expect = ""
        member = "arguments" if self.key in _ARGUMENT_KEYS else self.key
        if member not in ("name", "arguments") or member in self.met:
            return
        self.met.add(member)
        if member == "name":
            self.reading_name = c == '"'
        elif c == "{" and self.name is not None:
            self.args_at = self.sent = i
        # otherwise the call (if it is one) goes out whole at its end


def _parsed(content: str, calls: list[ToolCall]) -> ParsedOutput:
    return ParsedOutput(content.strip() or None, calls)


class ToolParser(ABC):
    """One request's tool-call parser: parse() a whole output, or feed() its deltas and then
    finish() once at its end."""

    def __init__(self) -> None:
        self._content = StrippedPieces()
        self._calls_out = 0

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput: ...

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta: ...

    def _call_delta(self, name: str, arguments: str) -> ToolCallDelta:
        self._calls_out += 1
        return ToolCallDelta(self._calls_out - 1, new_call_id(), name, arguments)

    def _stream(self, call: _CallText, text: str, stop: int) -> list[ToolCallDelta]:
        """Reads `call` on to text[stop]: its first delta once it can stream, then each new piece
        of its arguments."""
        call.read(text, stop)
        if call.args_at is None:
            return []
        upto = call.pos if call.args_end is None else call.args_end
        piece, call.sent = text[call.sent:upto], upto
        if call.index is None:
            first = self._call_delta(call.name, piece)
            call.index = first.index
            return [first]
        return [ToolCallDelta(call.index, None, None, piece)] if piece else []

    def _delta(self, content: list[str], calls: list[ToolCallDelta]) -> StreamDelta:
        return StreamDelta(self._content.push("".join(content)), calls)


def _body_call(body: str) -> tuple[str, str] | None:
    """The call that a Hermes call's body is (JSON whitespace around it allowed), if any."""
    call = read_call(body, _skip_json_space(body, 0))
    if call is None or _skip_json_space(body, call[2]) != len(body):
        return None
    return call[0], call[1]


class HermesToolParser(ToolParser):
    """Qwen3, Qwen2.5 and Hermes: each call is <tool_call>{"name": ..., "arguments": ...}
    </tool_call>, anywhere in the output; the text around the calls is content. A call's body
    ends at the first close tag, wherever it is: streamed arguments hold back what could be its
    start."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet handed out
        self._in_call = False  # _buf is the body of an open call, its open tag consumed
        self._searched = 0  # in a call: _buf[:_searched] holds no close tag
        self._call = _CallText(0)  # in a call: its body, read so far

    def parse(self, text: str) -> ParsedOutput:
        content: list[str] = []
        calls: list[ToolCall] = []
        done = 0
        for match in self._CALL.finditer(text):
            content.append(text[done:match.start()])
            call = _body_call(match.group(1))
            if call is None:
                content.append(match.group(0))
            else:
                calls.append(ToolCall(new_call_id(), *call))
            done = match.end()
        content.append(text[done:])
        return _parsed("".join(content), calls)

    def feed(self, delta: str) -> StreamDelta:
        self._buf += delta
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._in_call:
                end = self._buf.find(self.CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buf) - len(self.CLOSE) + 1)
                    # a possible start of the close tag is not yet known to be the body's
                    body_end = len(self._buf) - partial_tag_len(self._buf, self.CLOSE)
                    calls += self._stream(self._call, self._buf, body_end)
                    break
                calls += self._stream(self._call, self._buf, end)
                body = self._buf[:end]
                self._buf = self._buf[end + len(self.CLOSE):]
                self._in_call = False
                if self._call.index is None:  # not streamed: the call goes out whole, or not
                    call = _body_call(body)
                    if call is None:
                        content.append(self.OPEN + body + self.CLOSE)
                    else:
                        calls.append(self._call_delta(*call))
            else:
                start = self._buf.find(self.OPEN)
                if start < 0:
                    free = len(self._buf) - partial_tag_len(self._buf, self.OPEN)
                    content.append(self._buf[:free])
                    self._buf = self._buf[free:]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start + len(self.OPEN):]
                self._in_call, self._searched, self._call = True, 0, _CallText(0)
        return self._delta(content, calls)

    def finish(self) -> StreamDelta:
        rest = self._buf
        if self._in_call:
            # an unclosed call is content, unless it streamed: then it stays what it sent
            rest = "" if self._call.index is not None else self.OPEN + rest
        self._buf, self._in_call = "", False
        return self._delta([rest], [])


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the output is {"name": ..., "parameters": ...} (or
    "arguments"), possibly after <|python_tag|>, several calls separated by ";". An output that
    does not start with "{" (after whitespace and the tag) is content. Calls end at the first
    text that is not one: from there on (from the start, when it is the first) it is content.
    When streaming, a call that began to stream stays one, broken or not."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        # _buf is text not yet handed out; in an object it runs from where content would start
        # if the object is not a call: the output's start for the first, else the object's "{"
        self._buf = ""
        self._phase = "head"  # head -> object <-> separator; content from any of them
        self._object_at = 0  # in an object: where its "{" is in _buf
        self._call = _CallText(0)  # in an object: the object, read so far
        self._semicolon_seen = False  # in a separator

    def parse(self, text: str) -> ParsedOutput:
        pos = self._json_start(text)
        if pos is None:
            return _parsed(text, [])
        calls: list[ToolCall] = []
        content_at = 0
        while pos < len(text) and text[pos] == "{":
            call = read_call(text, pos)
            if call is None:
                break
            calls.append(ToolCall(new_call_id(), call[0], call[1]))
            pos = _skip_space(text, call[2])
            if text.startswith(";", pos):
                pos = _skip_space(text, pos + 1)
            content_at = pos
        return _parsed(text[content_at:], calls)

    def _json_start(self, text: str) -> int | None:
        pos = _skip_space(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = _skip_space(text, pos + len(self.PYTHON_TAG))
        return pos if text.startswith("{", pos) else None

    def feed(self, delta: str) -> StreamDelta:
        self._buf += delta
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._phase == "head" and not self._read_head():
                break
            if self._phase == "object":
                calls += self._stream(self._call, self._buf, len(self._buf))
                if self._call.end is None:
                    break
                calls += self._close_object()
            if self._phase == "separator" and not self._read_separator():
                break
            if self._phase == "content":
                content.append(self._buf)
                self._buf = ""
                break
        return self._delta(content, calls)

    def _close_object(self) -> list[ToolCallDelta]:
        """At its object's end: a call goes out whole, unless it streamed, and calls go on; text
        that is not a call is content from its start on. A streamed call counts as a call here
        even where it proves broken: the stream has made it one."""
        whole: list[ToolCallDelta] = []
        if self._call.index is None:
            call = read_call(self._buf, self._object_at)
            if call is None:
                self._phase = "content"
                return []
            whole.append(self._call_delta(call[0], call[1]))
        self._buf = self._buf[self._call.end:]
        self._phase, self._semicolon_seen = "separator", False
        return whole

    def _read_head(self) -> bool:
        """Decides from the output's start whether it is JSON; False while it cannot yet."""
        text = self._buf.lstrip()
        if text.startswith(self.PYTHON_TAG):
            text = text[len(self.PYTHON_TAG):].lstrip()
        elif self.PYTHON_TAG.startswith(text):
            return False
        if not text:
            return False
        if text.startswith("{"):
            self._start_object(len(self._buf) - len(text))
        else:
            self._phase = "content"
        return True

    def _read_separator(self) -> bool:
        """Drops the space and ";" between calls; False while only those have come."""
        for i, c in enumerate(self._buf):
            if c.isspace():
                continue
            if c == ";" and not self._semicolon_seen:
                self._semicolon_seen = True
                continue
            self._buf = self._buf[i:]
            if c == "{":
                self._start_object(0)
            else:
                self._phase = "content"
            return True
        self._buf = ""
        return False

    def _start_object(self, at: int) -> None:
        self._phase, self._object_at, self._call = "object", at, _CallText(at)

    def finish(self) -> StreamDelta:
        streamed = self._phase == "object" and self._call.index is not None
        rest = "" if streamed else self._buf  # a streamed call stays what it sent
        self._buf, self._phase = "", "content"
        return self._delta([rest], [])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

_PARSER_OF_MODEL_TYPE = {
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen2": "hermes",
    "llama": "llama3_json",
}


def tool_parser_for(model_type: str) -> str | None:
    """The tool parser that a model of this Hugging Face model_type writes calls for, if any."""
    return _PARSER_OF_MODEL_TYPE.get(model_type)


def make_tool_parser(name: str) -> ToolParser:
    """A new parser (one per request) of TOOL_PARSERS' `name`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
