"""A request as the scheduler sees it: its tokens, its KV pages, and how far its KV is computed."""

from __future__ import annotations

import itertools
import time
from enum import Enum

from nanoserve.engine.grammar import SequenceGrammar
from nanoserve.engine.prompt_logprobs import UnreadScores
from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # prompt (or recompute after preemption) not fully prefilled
    RUNNING = "running"  # decoding
    FINISHED = "finished"


class Sequence:
    def __init__(self, token_ids: list[int], params: SamplingParams, index: int = 0,
                 seed: int = 0) -> None:
        self.seq_id = next(_ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.index = index  # which of the request's n completions
        # keys this sequence's random numbers (with the position), so a seeded sequence draws
        # the same tokens whatever else is in its batches, and again after preemption
        self.seed = seed
        self.status = Status.WAITING
        self.pages: list[int] = []
        # Invariant: KV of token_ids[:num_cached] is in this sequence's pages.
        self.num_cached = 0
        # tokens sampled by launched steps, not yet read back (async scheduling): the next one
        # this sequence samples is at position num_tokens + num_pending
        self.num_pending = 0
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages, as computed
        self.num_pages_cached = 0  # its first pages that are in the prefix cache
        self.prefilling = False  # computing its prompt (others wait to reuse its pages)
        self.finish_reason: str | None = None  # stop | length | abort | error
        self.error: str | None = None  # why finish_reason is "error"
        self.output_text: str | None = None  # set when a stop string cut the text
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # one entry per prompt token scored so far; the first token has no logprob (None)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # the prompt tokens scored after those, not read from the device yet (in order)
        self.unread_scores: list[UnreadScores] = []
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None  # queue time ends here
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.grammar: SequenceGrammar | None = None  # constrained decoding (structured outputs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_prompt_scored(self) -> int:
        """Prompt tokens whose logprob is computed (the first, which has none, counted)."""
        if self.prompt_logprobs is None:
            return 0
        return len(self.prompt_logprobs) + sum(len(u) for u in self.unread_scores)

    @property
    def scores_prompt(self) -> bool:
        """Some prompt token still needs its logprob: its prefill must compute every prompt
        position itself (the prefix cache keeps KV, not the hidden states logprobs come from)."""
        return self.prompt_logprobs is not None and \
            self.num_prompt_scored < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, cached={self.num_cached}, "
                f"pages={len(self.pages)}, {self.status.value})")
