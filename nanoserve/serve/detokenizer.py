"""Incremental detokenization for streaming, and the text and bytes of single tokens (logprobs).

Streamed text grows by whole characters only: a multi-byte character split across tokens
decodes to U+FFFD until its last byte arrives, so a piece is released only when the decoded tail
no longer ends in U+FFFD. Each call decodes a short window (the tokens since the last release
plus a few before them for context), not the whole output.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, context_tokens: int = 4,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer  # None: a model without a tokenizer, no text
        self.context_tokens = context_tokens
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the tokens after read_offset
        self.read_offset = 0  # tokens before this are released as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Appends tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            if len(self.ids) - self.read_offset <= 4:
                return ""
            # A character is at most 4 bytes and a token at least one: a U+FFFD that 4 more
            # tokens did not complete is invalid bytes. Release all but the last 3 tokens (a
            # character may still be arriving there), so the window stays short.
            end = len(self.ids) - 3
            after = self._decode(self.ids[self.prefix_offset:end])
            return self._release(after[len(before):], end)
        return self._release(after[len(before):], len(self.ids))

    def _release(self, piece: str, end: int) -> str:
        self.read_offset = end
        self.prefix_offset = max(0, end - self.context_tokens)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of the output: whatever is left, incomplete characters included."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        piece = self._decode(self.ids[self.prefix_offset:])[len(before):]
        self.read_offset = len(self.ids)
        self.text += piece
        return piece


def text_with_offsets(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """`ids` decoded as a prompt is (special tokens included) and each token's character start
    in that text (a character split over several tokens belongs to the first of them, as in
    streamed logprobs' offsets)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    ends: list[int] = []
    for t in ids:
        detok.add([t])
        ends += [len(detok.text)] * (detok.read_offset - len(ends))
    detok.flush()
    ends += [len(detok.text)] * (len(ids) - len(ends))
    return detok.text, [0] + ends[:-1] if ids else []


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the BPE vocabulary's
    spelling of raw bytes)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class TokenText:
    """A token's text alone (as the tokenizer decodes it, special tokens included) and its raw
    bytes. For byte-level BPE vocabularies the bytes are the token's own, so a token holding part
    of a multi-byte character gives those bytes (its text is then U+FFFD); otherwise they are
    the UTF-8 of its text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder: dict[str, int] | None = None
        self._special: set[int] = set()
        if tokenizer is None:
            return
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        self._special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self.tokenizer is None:
            text, raw = f"token_id:{token_id}", None
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = None
            if self._byte_decoder is not None and token_id not in self._special:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                    raw = bytes(self._byte_decoder[c] for c in piece)
        hit = (text, list(raw if raw is not None else text.encode("utf-8", "replace")))
        self._cache[token_id] = hit
        return hit
