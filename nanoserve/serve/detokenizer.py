"""Incremental detokenization for streaming: text grows by whole characters only.

A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives, so a
piece is released only when the decoded tail no longer ends in U+FFFD. Each call decodes a short
window (the tokens since the last release plus a few before them for context), not the whole
output.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, context_tokens: int = 4) -> None:
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the tokens after read_offset
        self.read_offset = 0  # tokens before this are released as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        """Appends tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before):]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.context_tokens)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of the output: whatever is left, incomplete characters included."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        piece = self._decode(self.ids[self.prefix_offset:])[len(before):]
        self.read_offset = len(self.ids)
        self.text += piece
        return piece
