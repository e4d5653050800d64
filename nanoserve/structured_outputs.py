"""What a request's output must match: a JSON schema, any JSON object, a regular expression, one
of given strings, or a Lark grammar (vLLM's `structured_outputs`; the OpenAI server's
`response_format` and `tool_choice` become one). Checked for shape here; whether the grammar
compiles against the model's tokenizer is the engine's check (engine/grammar.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nanoserve.errors import InvalidParameter

FIELD = "structured_outputs"
# JSON as json.dumps writes it (", " and ": ", no other whitespace), unless a schema sets its
# own: free whitespace lets a model pad a value with spaces until max_tokens ends it
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: json (a JSON schema, as an object or its JSON text), json_object (any
    JSON object), regex, choice (the output is one of these strings), grammar (Lark)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("regex", self.regex),
                                           ("choice", self.choice), ("grammar", self.grammar))
                 if value is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidParameter(FIELD, f"{FIELD}: give exactly one of json, json_object, "
                                          f"regex, choice, grammar (got {given or 'none'})")
        if self.json is not None:  # kept as canonical JSON text: hashable, frozen
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameter(FIELD, f"{FIELD}.{name} must be a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) for c in choice):
                raise InvalidParameter(FIELD, f"{FIELD}.choice must be a non-empty list of "
                                              f"strings")
            object.__setattr__(self, "choice", choice)

    def llguidance_grammar(self) -> tuple[str, str]:
        """(format, text) for llguidance.grammar_from."""
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            schema.setdefault("x-guidance", COMPACT_JSON)
            return "json_schema", json.dumps(schema)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "lark", self.grammar


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidParameter(FIELD, f"{FIELD}.json is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise InvalidParameter(FIELD, f"{FIELD}.json must be a JSON schema object, got "
                                      f"{type(schema).__name__}")
    return json.dumps(schema, sort_keys=True)
