"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` checked, the
tools the chat template sees, and, for `tool_choice` "required" or a named function, the
grammar that makes the answer a call of a declared tool in the model's own format (constrained
decoding). The answer is read back into `tool_calls` by the model's parser (tool_parsers.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nanoserve.serve.protocol import APIError, invalid, short
from nanoserve.structured_outputs import COMPACT_JSON, StructuredOutputs

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's shape, {"type": "function", "function": {...}}
    choice: str  # "auto", "none", "required", or "function" (a named one: `name`)
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps an answer's first call only

    @property
    def active(self) -> bool:
        """The answer may hold tool calls (and is parsed for them)."""
        return self.choice != "none"

    @property
    def forces_call(self) -> bool:
        """"required" or a named function: the answer is a call (a grammar holds it to one)."""
        return self.choice in ("required", "function")

    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice; None when it has no tools. 400s name the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", f"'tool_choice' {short(choice)} needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of {\"type\": \"function\", "
                               "\"function\": {...}}")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict) or set(tool) - {"type", "function"}:
            raise invalid("tools", f"tools[{i}] must be {{\"type\": \"function\", "
                                   f"\"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            raise invalid("tools", f"tools[{i}].function.name must be 1-64 letters, digits, "
                                   f"'_' or '-', got {short(fn.get('name'))}")
        if set(fn) - _FUNCTION_FIELDS:
            raise invalid("tools", f"tools[{i}].function: unknown field "
                                   f"{short(sorted(set(fn) - _FUNCTION_FIELDS)[0])}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise invalid("tools", f"tools[{i}].function.parameters must be a JSON schema "
                                   f"object")
        if fn["name"] in names:
            raise invalid("tools", f"tools[{i}]: a second function named {short(fn['name'])}")
        names.append(fn["name"])
    parallel = parallel is not False
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(tools, choice or "auto", parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        raise invalid("tool_choice", f"'tool_choice' names {short(fn['name'])}, which is not "
                                     f"among 'tools'")
    return ToolRequest(tools, "function", fn["name"], parallel)


def forced_call(req: ToolRequest, parser: str) -> StructuredOutputs | None:
    """For "required" or a named function: the grammar of one call of a declared tool (the
    named one) in the parser's format; None otherwise."""
    if not req.forces_call:
        return None
    key = {"hermes": "arguments", "llama3_json": "parameters"}.get(parser)
    if key is None:
        raise APIError(400, f"tool_choice {req.choice!r} is not supported with the "
                            f"{parser!r} tool-call parser", "tool_choice")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": fn["name"]},
                             key: fn.get("parameters") or {"type": "object"}}}
             for fn in req.functions() if req.name in (None, fn["name"])]
    call = json.dumps({"anyOf": calls, "x-guidance": COMPACT_JSON})
    if parser == "hermes":
        lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {call}'
    else:
        lark = f"start: call\ncall: %json {call}"
    return StructuredOutputs(grammar=lark)
