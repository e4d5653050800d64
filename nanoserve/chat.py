"""Conversations as chat templates take them."""

from __future__ import annotations

import json
from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages with an assistant's tool call arguments as objects: OpenAI sends them
    as JSON text, and templates write them out with tojson (text that is not JSON stays)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments":
                                                         _arguments(c["function"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def _arguments(fn: dict[str, Any]) -> Any:
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args
