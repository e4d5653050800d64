"""Reasoning out of a thinking model's text: Qwen3's <think>...</think> before its answer."""

from __future__ import annotations

from nanoserve.serve.tool_parsers import StrippedPieces, partial_tag_len

OPEN = "<think>"
CLOSE = "</think>"
STARTS = ("auto", "reasoning", "content")


class Qwen3ReasoningParser:
    """Splits one request's output into (reasoning, content), whole (parse) or as it streams
    (feed, then finish once at its end); any cutting of the text into deltas gives parse()'s
    split, None streaming as "".

    With </think>: the reasoning is the text before it, less a leading <think>, stripped of
    surrounding whitespace; the content is the text after it, less its leading whitespace.
    Without: an output that opens with <think> was cut off while thinking, so all of it is
    reasoning (stripped); any other output is all content, verbatim. Empty parts are None.

    `starts_in` is where the output starts when the prompt already says so: "reasoning" when the
    chat template ends the prompt with <think> (the output is reasoning until </think>, even
    unclosed), "content" when it closed thinking (enable_thinking=False: the output is all
    content, verbatim). "auto" decides from the output as above, so streaming must hold back an
    output that does not open with <think> until </think> or its end shows which it is.
    """

    def __init__(self, starts_in: str = "auto") -> None:
        if starts_in not in STARTS:
            raise ValueError(f"starts_in must be one of {', '.join(STARTS)}, not {starts_in!r}")
        self.starts_in = starts_in
        self._buf = ""  # text not yet handed out
        # head: deciding whether the output opens with <think>; reasoning: until </think>;
        # undecided: no <think> opened, reasoning only if a </think> comes; content: the rest
        self._phase = "content" if starts_in == "content" else "head"
        self._searched = 0  # undecided: _buf[:_searched] holds no </think>
        self._reasoning = StrippedPieces()
        self._content_started = starts_in == "content"  # the content keeps leading whitespace

    def parse(self, text: str) -> tuple[str | None, str | None]:
        if self.starts_in == "content":
            return None, text or None
        opened = text.lstrip().startswith(OPEN)
        body = text.lstrip()[len(OPEN):] if opened else text
        reasoning, closed, content = body.partition(CLOSE)
        if closed:
            return reasoning.strip() or None, content.lstrip() or None
        if opened or self.starts_in == "reasoning":
            return body.strip() or None, None
        return None, text or None

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase == "head":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self._buf, self._phase = head[len(OPEN):], "reasoning"
            elif OPEN.startswith(head) and not final:
                return "", ""
            else:
                self._phase = "reasoning" if self.starts_in == "reasoning" else "undecided"
        if self._phase == "undecided":
            end = self._buf.find(CLOSE, self._searched)
            if end >= 0:
                self._phase = "reasoning"
            elif final:
                self._phase, self._content_started = "content", True
            else:
                self._searched = max(0, len(self._buf) - len(CLOSE) + 1)
                return "", ""
        if self._phase == "reasoning":
            end = self._buf.find(CLOSE)
            if end >= 0:
                reasoning = self._reasoning.push(self._buf[:end])
                self._buf, self._phase = self._buf[end + len(CLOSE):], "content"
            else:
                free = len(self._buf) - (0 if final else partial_tag_len(self._buf, CLOSE))
                reasoning = self._reasoning.push(self._buf[:free])
                self._buf = self._buf[free:]
        if self._phase == "content":
            if not self._content_started:
                self._buf = self._buf.lstrip()
                self._content_started = bool(self._buf)
            content, self._buf = self._buf, ""
        return reasoning, content


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
