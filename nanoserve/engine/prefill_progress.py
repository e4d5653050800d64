"""Progress of long prefills: the prompt tokens computed of those asked for, for the terminal (a
bar with tokens per second and the time left, once a prefill has run for a few seconds) and for
the server's /metrics (serve/metrics.py). A million-token prompt takes minutes to prefill;
nobody should watch a silent terminal meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tqdm import tqdm

from nanoserve.engine.sequence import Sequence

SHOW_AFTER_S = 2.0  # a prefill shorter than this shows no bar


def prefill_counts(seqs: Iterable[Sequence]) -> tuple[int, int]:
    """(prompt tokens computed, prompt tokens) over `seqs`: a finished or decoding sequence's
    prompt counts as computed, cached prefix tokens too; a preempted one's count goes back."""
    done = total = 0
    for seq in seqs:
        total += seq.num_prompt_tokens
        done += seq.num_prompt_tokens if seq.is_finished else min(seq.num_cached,
                                                                  seq.num_prompt_tokens)
    return done, total


class PrefillProgress:
    """A bar over the prompt tokens of a batch's prefills, shown once they have run for
    `show_after` seconds (SHOW_AFTER_S) and finished when they are done. `clock` and
    `make_bar` are the tests' (a fake clock, a bar that records)."""

    def __init__(self, enabled: bool = True, show_after: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 make_bar: Callable[..., tqdm] = tqdm) -> None:
        self.enabled, self.clock, self.make_bar = enabled, clock, make_bar
        self.show_after = SHOW_AFTER_S if show_after is None else show_after
        self.bar: tqdm | None = None
        self.started: float | None = None

    def update(self, done: int, total: int) -> None:
        """The counts now (prefill_counts)."""
        if not self.enabled:
            return
        if total == 0 or done >= total:
            self.finish()
            return
        now = self.clock()
        if self.started is None:
            self.started = now
        if self.bar is None:
            if now - self.started >= self.show_after:
                self.bar = self.make_bar(total=total, initial=done, desc="Prefill", unit="tok",
                                         unit_scale=True, dynamic_ncols=True)
            return
        if total != self.bar.total:  # prompts joined (or a preempted one's outputs count)
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def finish(self) -> None:
        """Every prompt is computed: the bar (if shown) completes and closes."""
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.started = None, None
