"""A chat answer read by the server's parsers: its reasoning (reasoning.py), its content and its
tool calls (tool_parsers.py), whole or as it streams."""

from __future__ import annotations

from typing import Any

from nanoserve.serve.reasoning import REASONING_PARSERS
from nanoserve.serve.tool_parsers import ToolCallDelta, make_tool_parser


def answer_starts_in(prompt: str) -> str:
    """Whether the answer to this rendered prompt starts inside the model's thinking (the
    template opened it), after it (the template closed it: enable_thinking false), or either
    (the reasoning parser's starts_in)."""
    end = prompt.rstrip()
    if end.endswith("<think>"):
        return "reasoning"
    if end.endswith("</think>"):
        return "content"
    return "auto"


class AnswerReader:
    """One answer's parsers. `reasoning`: a REASONING_PARSERS name or None, the answer
    starting as `starts_in` says; `tools`: a tool parser's name, or None when the request's
    answer is not read for tool calls; `parallel` False keeps its first call only."""

    def __init__(self, reasoning: str | None, tools: str | None, starts_in: str = "auto",
                 parallel: bool = True) -> None:
        self.reasoning = REASONING_PARSERS[reasoning](starts_in) if reasoning else None
        self.tools = make_tool_parser(tools) if tools else None
        self.max_calls = None if parallel else 1
        self.calls = 0  # tool calls whose streaming has begun

    def read(self, text: str, finish_reason: str) -> dict[str, Any]:
        """The whole answer: {"text"} and, where there are any, "reasoning_content" and
        "tool_calls", and "finish_reason" "tool_calls" when a finished answer made calls."""
        out: dict[str, Any] = {"text": text, "finish_reason": finish_reason}
        if self.reasoning is not None:
            out["reasoning_content"], text = self.reasoning.parse(text)
            out["text"] = text
        if self.tools is not None and text:
            parsed = self.tools.parse(text)
            out["text"] = parsed.content
            if parsed.tool_calls:
                out["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.tool_calls[:self.max_calls]]
                if finish_reason == "stop":
                    out["finish_reason"] = "tool_calls"
        return out

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """The next piece of a streamed answer (final: the last): its reasoning, content and
        tool-call deltas as OpenAI streams them: a call's first with its id and name, then the
        pieces of its arguments (parallel False: those of its first call only)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more = self.reasoning.finish()
                reasoning, content = reasoning + more[0], content + more[1]
        if self.tools is None:
            return reasoning, content, []
        deltas = [self.tools.feed(content)] + ([self.tools.finish()] if final else [])
        calls = [call for d in deltas for call in d.tool_calls
                 if (self.max_calls is None or call.index < self.max_calls)
                 and (call.name is not None or call.arguments)]
        self.calls += sum(1 for call in calls if call.name is not None)
        return reasoning, "".join(d.content for d in deltas), [_delta_body(c) for c in calls]


def _delta_body(call: ToolCallDelta) -> dict[str, Any]:
    """A call's first delta: index, id, type and function name and arguments; a later one:
    index and the next piece of function arguments."""
    fn: dict[str, Any] = {"arguments": call.arguments}
    body: dict[str, Any] = {"index": call.index, "function": fn}
    if call.name is not None:
        body.update(id=call.id, type="function")
        fn["name"] = call.name
    return body
