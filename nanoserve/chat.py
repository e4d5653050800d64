"""Conversations as chat templates take them, and the template arguments a caller may set."""

from __future__ import annotations

import json
from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages with an assistant's tool call arguments as objects: OpenAI sends them
    as JSON text, and templates write them out with tojson (text that is not JSON stays)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
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


# apply_chat_template's own parameters and the variables templates are given: a caller's
# chat_template_kwargs may set none of them (a "chat_template" would run the caller's own
# Jinja in the server)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length",
    "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A caller's chat_template_kwargs (enable_thinking, say): names that are not reserved,
    values that are JSON scalars. ValueError naming the first that is not."""
    for key, value in (kwargs or {}).items():
        if not isinstance(key, str) or not key.isidentifier() or \
                key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set {key!r}")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"chat_template_kwargs[{key!r}] must be a string, number, "
                             f"boolean or null")
    return dict(kwargs or {})
