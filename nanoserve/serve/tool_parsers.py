"""Tool calls out of a model's text, whole (parse) or as it streams (feed, then finish).

A parser reads one request's output. Streaming agrees with parse for any cutting of the text into
deltas: the content pieces concatenate to parse()'s content ("" for None), and each call comes out
once, in order, with parse()'s name and arguments.

Content is the text outside the calls, stripped of surrounding whitespace. Text that only looks
like a call (bad JSON, no name, no arguments, an open tag the output never closed) is content,
verbatim: nothing here raises on a model's output.

A streamed call is handed out whole, in one delta, once its text is complete. Only then is it
certain to be a call: a model cut off by max_tokens, or writing bad JSON mid-arguments, would
otherwise have streamed pieces of a call that parse() reports as content.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it


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


def call_from_json(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call, or None when it is not one. A call is an object
    with a non-empty string "name" and "arguments" (Llama's "parameters") that is an object
    (serialized here) or a string (taken as the JSON already)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, dict):
        return name, json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        return name, arguments
    return None


def decode_call(text: str) -> tuple[str, str] | None:
    try:
        return call_from_json(json.loads(text))
    except (ValueError, RecursionError):
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

    def _delta(self, content: list[str], calls: list[ToolCallDelta]) -> StreamDelta:
        return StreamDelta(self._content.push("".join(content)), calls)


class HermesToolParser(ToolParser):
    """Qwen3, Qwen2.5 and Hermes: each call is <tool_call>{"name": ..., "arguments": ...}
    </tool_call>, anywhere in the output; the text around the calls is content."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet handed out
        self._in_call = False  # _buf is the body of an open call, its open tag consumed
        self._searched = 0  # in a call: _buf[:_searched] holds no close tag

    def parse(self, text: str) -> ParsedOutput:
        content: list[str] = []
        calls: list[ToolCall] = []
        done = 0
        for match in self._CALL.finditer(text):
            content.append(text[done:match.start()])
            call = decode_call(match.group(1))
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
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(self.CLOSE):]
                self._in_call = False
                call = decode_call(body)
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
                self._in_call, self._searched = True, 0
        return self._delta(content, calls)

    def finish(self) -> StreamDelta:
        rest = (self.OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return self._delta([rest], [])


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class _ObjectEnd:
    """Where a JSON object closes, found as its text grows, by counting braces outside strings.
    On valid JSON this is where a JSON decoder ends the object; on invalid JSON the text up to
    it does not decode either, so streaming and parse() agree on what is a call."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def find(self, text: str, start: int) -> int:
        """Index of the brace in text[start:] that closes the object, else -1."""
        for i in range(start, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == "{":
                self.depth += 1
            elif c == "}":
                self.depth -= 1
                if self.depth == 0:
                    return i
        return -1


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the output is {"name": ..., "parameters": ...} (or
    "arguments"), possibly after <|python_tag|>, several calls separated by ";". An output that
    does not start with "{" (after whitespace and the tag) is content. Calls end at the first
    text that is not one: from there on (from the start, when it is the first) it is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        # _buf is text not yet handed out; in an object it runs from where content would start
        # if the object is not a call: the output's start for the first, else the object's "{"
        self._buf = ""
        self._phase = "head"  # head -> object <-> separator; content from any of them
        self._object_at = 0  # in an object: where its "{" is in _buf
        self._scanned = 0  # in an object: _buf[:_scanned] went through _end
        self._end = _ObjectEnd()
        self._semicolon_seen = False  # in a separator

    def parse(self, text: str) -> ParsedOutput:
        pos = self._json_start(text)
        if pos is None:
            return _parsed(text, [])
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        content_at = 0
        while pos < len(text) and text[pos] == "{":
            try:
                obj, end = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                break
            call = call_from_json(obj)
            if call is None:
                break
            calls.append(ToolCall(new_call_id(), *call))
            pos = _skip_space(text, end)
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
                end = self._end.find(self._buf, self._scanned)
                if end < 0:
                    self._scanned = len(self._buf)
                    break
                call = decode_call(self._buf[self._object_at:end + 1])
                if call is None:
                    self._phase = "content"
                else:
                    calls.append(self._call_delta(*call))
                    self._buf = self._buf[end + 1:]
                    self._phase, self._semicolon_seen = "separator", False
            if self._phase == "separator" and not self._read_separator():
                break
            if self._phase == "content":
                content.append(self._buf)
                self._buf = ""
                break
        return self._delta(content, calls)

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
        self._phase, self._object_at, self._scanned = "object", at, at
        self._end = _ObjectEnd()

    def finish(self) -> StreamDelta:
        rest, self._buf, self._phase = self._buf, "", "content"
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
