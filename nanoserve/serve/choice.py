"""One completion's output as it arrives from the engine, and the prompt it echoes."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.outputs import TokenLogprobs
from nanoserve.serve.async_engine import Delta
from nanoserve.serve.detokenizer import IncrementalDetokenizer

FINISH_REASONS = {"stop": "stop", "length": "length"}  # the ones a client gets as such


@dataclass
class EchoedPrompt:
    """A prompt as `echo` sends it before each of its completions."""

    text: str  # as the client sent it (a string), or its token ids decoded
    ids: list[int]
    starts: list[int] | None  # each token's character offset in `text` (when logprobs are on)


class Choice:
    """One completion's output as it arrives: tokens, text released so far (whole characters),
    which characters each token ended at (for logprobs sent with their own text), and what
    was sent of both.

    `keep_output` False (echo with max_tokens 0, scoring only): the one token the engine
    generates is dropped, and the completion ends with "length" (its max_tokens of 0)."""

    def __init__(self, index: int, tokenizer, want_logprobs: bool, incremental: bool = True,
                 echo: EchoedPrompt | None = None, keep_output: bool = True) -> None:
        self.index = index
        self.incremental = incremental  # False: only the token ids are kept
        self.detok = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self.logprobs: list | None = [] if want_logprobs else None
        self.ends: list[int] = []  # character end of each released token in detok.text
        self.sent_chars = 0
        self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_text: str | None = None
        self.error: str | None = None
        self.echo = echo
        self.echo_sent = False
        self.keep_output = keep_output
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.keep_output:
            self._add_tokens(delta)
        if delta.finish_reason is None:
            return
        self.finish_reason, self.stop_text, self.error = (
            delta.finish_reason, delta.stop_text, delta.error)
        if not self.keep_output and self.finish_reason in FINISH_REASONS:
            self.finish_reason, self.stop_text = "length", None
        if self.incremental:
            self.detok.flush()
            self._resolve()

    def _add_tokens(self, delta: Delta) -> None:
        if self.incremental:
            for t in delta.token_ids:  # one at a time: each token's end offset is known
                self.ids.append(t)
                self.detok.add([t])
                self._resolve()
        else:
            self.ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs:
            self.logprobs += delta.logprobs

    def _resolve(self) -> None:
        while len(self.ends) < self.detok.read_offset:
            self.ends.append(len(self.detok.text))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        return self.done and self.finish_reason not in FINISH_REASONS

    def starts(self, lo: int, hi: int) -> list[int]:
        """Character offsets of output tokens lo..hi in the choice's text (echoed prompt
        first)."""
        base = len(self.echo.text) if self.echo is not None else 0
        return [base + (self.ends[i - 1] if i else 0) for i in range(lo, hi)]

    def take(self, safe_chars: int | None) -> tuple[str, int, int]:
        """Text up to `safe_chars` (None: all of it, finished) not sent yet, and the range of
        tokens whose logprobs go with it."""
        if safe_chars is None:
            final = self.stop_text if self.stop_text is not None else self.detok.text
            text = final[self.sent_chars:]
            self.sent_chars = max(self.sent_chars, len(final))
            hi = len(self.logprobs) if self.logprobs is not None else 0
        else:
            safe_chars = max(safe_chars, self.sent_chars)
            text = self.detok.text[self.sent_chars:safe_chars]
            self.sent_chars = safe_chars
            hi = self.sent_logprobs
            if self.logprobs is not None:
                while hi < min(len(self.ends), len(self.logprobs)) and \
                        self.ends[hi] <= safe_chars:
                    hi += 1
        lo, self.sent_logprobs = self.sent_logprobs, max(self.sent_logprobs, hi)
        return text, lo, hi
