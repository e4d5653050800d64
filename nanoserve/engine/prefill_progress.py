"""Progress of long prefills: the prompt tokens computed of those scheduled, for the terminal (a
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
    """(prompt tokens computed, prompt tokens) over the sequences whose prompt is not all
    computed yet; cached prefix tokens count as computed."""
    done = total = 0
    for seq in seqs:
        if not seq.is_finished and seq.num_cached < seq.num_prompt_tokens:
            done += seq.num_cached
            total += seq.num_prompt_tokens
    return done, total


class PrefillProgress:
    """A bar over the prompt tokens of the prefills in flight, shown once they have run for
    `show_after` seconds and closed when they are done (or when the next prefills start over).
    `clock` and `make_bar` are the tests' (a fake clock, a bar that records)."""

    def __init__(self, enabled: bool = True, show_after: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 make_bar: Callable[..., tqdm] = tqdm) -> None:
        self.enabled, self.clock, self.make_bar = enabled, clock, make_bar
        self.show_after = SHOW_AFTER_S if show_after is None else show_after
        self.bar: tqdm | None = None
        self.started: float | None = None
        self.done_at_start = 0
        self.done = self.total = 0

    def update(self, done: int, total: int) -> None:
        """The prefills' counts now (prefill_counts)."""
        if not self.enabled:
            return
        if total == 0 or done >= total:
            if self.bar is not None:
                self.bar.update(self.bar.total - self.bar.n)
            self.close()
            return
        now = self.clock()
        if self.started is None or total != self.total:  # new prefills: the rate starts over
            if self.bar is not None and total != self.total:
                self.close()
            self.started, self.done_at_start = now, done
        self.done, self.total = done, total
        if self.bar is None and now - self.started >= self.show_after:
            self.bar = self.make_bar(total=total, initial=done, desc="Prefill", unit="tok",
                                     unit_scale=True, dynamic_ncols=True)
        elif self.bar is not None:
            self.bar.update(done - self.bar.n)

    @property
    def rate(self) -> float | None:
        """Prompt tokens per second since these prefills started, None before any."""
        if self.started is None or self.clock() <= self.started:
            return None
        return (self.done - self.done_at_start) / (self.clock() - self.started)

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate so far."""
        rate = self.rate
        return (self.total - self.done) / rate if rate else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.started, self.done, self.total = None, None, 0, 0
