"""Continuous batching: which sequences run in the next step, and with how many tokens.

A step is a decode step (one token for every running sequence), a prefill step (chunks of
waiting prompts under a token budget), or, with resident KV, a mixed step: every running
sequence's next token, and prompt chunks under the budget riding along, as in vLLM's chunked
prefill. Running streams then never wait for a long prompt: each gets a token in
every step, the step with a prefill chunk included. With streamed layers (offload) the two kinds
alternate instead (a decoding sequence's last page lives in its tail row, which the prefill
path does not read), so a stream waits at most one prefill step between tokens.

When decode runs out of pages the newest running sequence is preempted: its pages are freed and
its tokens are recomputed later (prompt + output so far).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.engine.prompt_logprobs import UnreadScores
from nanoserve.engine.sequence import Sequence, Status
from nanoserve.errors import InvalidParameter
from nanoserve.kv.pages import pages_needed
from nanoserve.outputs import TokenLogprobs
from nanoserve.text import plural

if TYPE_CHECKING:
    from nanoserve.kv.manager import KVManager


@dataclass
class Batch:
    is_prefill: bool  # runs through the prefill path: prompt chunks, decode rows riding along
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens fed per sequence (1 for decode)
    num_decode: int = 0  # a mixed step's first seqs decode (one token each); the rest prefill
    # set by the model runner: per sequence, the sampled token's logprobs where asked for
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # set by the model runner, per sequence: the prompt tokens' logprobs this step read (its
    # own and those earlier steps left unread), or, in a step that reads nothing, those it
    # computed, on the device
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    unread_scores: list[UnreadScores | None] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (),
                 detokenize=None, mixed_steps: bool = True) -> None:
        self.kv = kv  # pages come from, and go back to, the KV manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize  # token ids -> text, for stop strings
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.mixed_steps = mixed_steps  # else decode and prefill steps alternate
        self._last_was_prefill = False

    def check_admissible(self, num_prompt_tokens: int) -> None:
        """Raises ValueError for a prompt that can never run (the request is refused alone)."""
        if num_prompt_tokens == 0:
            raise InvalidParameter("prompt", "empty prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidParameter("prompt", f"prompt has {plural(num_prompt_tokens, 'token')}; "
                                             f"max_model_len is {self.max_model_len}, which "
                                             "leaves no room for output",
                                   "context_length_exceeded")
        self.kv.check_fits(num_prompt_tokens)

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq.num_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[Batch | None, list[Sequence]]:
        """The next step's batch, and the sequences that finished while it was made (a context
        that outgrew the whole KV budget)."""
        finished: list[Sequence] = []
        if self.mixed_steps:
            batch = self._schedule_mixed(finished)
        elif self._last_was_prefill and self.running:
            batch = self._schedule_decode(finished) or self._schedule_prefill()
        else:
            batch = self._schedule_prefill() or self._schedule_decode(finished)
        self._last_was_prefill = batch is not None and batch.is_prefill
        return batch, finished

    def _schedule_mixed(self, finished: list[Sequence]) -> Batch | None:
        decode = self._schedule_decode(finished)
        if decode is None:
            return self._schedule_prefill()
        # decode rows ride on top of the prefill budget: chunks keep their size (and cuDNN its
        # plans); a step holds at most max_num_seqs more tokens than the budget
        prefill = self._schedule_prefill()
        if prefill is None:
            return decode
        return Batch(True, decode.seqs + prefill.seqs,
                     decode.num_new_tokens + prefill.num_new_tokens, len(decode.seqs))

    def _schedule_prefill(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        claimed = self._pages_being_computed()
        for seq in self.waiting:
            if budget == 0 or len(self.running) + len(seqs) >= self.max_num_seqs:
                break
            if not seq.prefilling:
                # a prompt being scored is computed whole: logprobs need every position's
                # hidden state, which cached pages do not keep (its own pages are still cached)
                if not seq.scores_prompt:
                    self.kv.reuse_prefix(seq)
                # another prefill is computing the page it needs next: reuse it next step
                # (only sequences that have not started wait, so no two wait for each other)
                if not seq.scores_prompt and self.kv.next_page_key(seq) in claimed:
                    break
                if not self._fits_beside_decodes(seq):
                    break
            chunk = min(seq.num_tokens - seq.num_cached, budget,
                        self.kv.room(seq) - seq.num_cached)
            if chunk <= 0:
                break
            self.kv.count_reuse(seq)  # admitted: what it reused is what its request reports
            self.kv.grow(seq, seq.num_cached + chunk)
            seq.prefilling = True
            claimed |= self._pages_being_computed([seq])
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            seqs.append(seq)
            counts.append(chunk)
            budget -= chunk
            if seq.num_cached + chunk < seq.num_tokens:
                break  # a partial chunk: this prompt continues next step, nothing behind it now
        return Batch(True, seqs, counts) if seqs else None

    def _fits_beside_decodes(self, seq: Sequence) -> bool:
        """Whether a prompt about to start fits whole in the free pages, less what the running
        sequences grow by while it is prefilled (they decode in the same steps). A prompt that
        started without that room would have its pages taken back by the first decode short of
        a page, and start over, again and again."""
        steps = -(-(seq.num_tokens - seq.num_cached) // self.max_num_batched_tokens)
        ps = self.kv.spec.page_size
        growth = sum(max(0, pages_needed(s.num_tokens + s.num_pending + steps, ps) - len(s.pages))
                     for s in self.running)
        return self.kv.room(seq) - growth * ps >= seq.num_tokens

    def _pages_being_computed(self, seqs=None) -> set[bytes]:
        """Prefix-cache keys of the full prompt pages that prefills under way will compute."""
        keys: set[bytes] = set()
        for s in self.waiting if seqs is None else seqs:
            if s.prefilling and self.kv.cache is not None:
                full = (s.num_tokens - 1) // self.kv.spec.page_size
                keys.update(self.kv.page_keys(s, full)[s.num_cached // self.kv.spec.page_size:])
        return keys

    def _schedule_decode(self, finished: list[Sequence]) -> Batch | None:
        batch = []
        for seq in list(self.running):
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_pending and self._reaches_length(seq, seq.num_pending):
                continue  # its last token is in flight: it finishes when that is read
            # room for the token this step writes, after those still in flight
            while not self.kv.grow(seq, seq.num_tokens + seq.num_pending) and \
                    seq.status == Status.RUNNING:
                if not self._release_pages_for(seq):
                    # alone and still out of pages: its context outgrew the whole KV budget
                    self.finish(seq, "length")
                    finished.append(seq)
            if seq.status == Status.RUNNING:
                batch.append(seq)
        return Batch(False, batch, [1] * len(batch)) if batch else None

    def next_step_is_plain_decode(self) -> bool:
        """Whether the next step decodes every running sequence and nothing else, with no
        preemption: nothing can be admitted (nothing waits, or the batch is full), and the free
        pages cover every sequence's next token."""
        if not self.running or self.waiting and len(self.running) < self.max_num_seqs:
            return False
        ps = self.kv.spec.page_size
        need = sum(1 for s in self.running
                   if (s.num_tokens + s.num_pending - 1) // ps >= len(s.pages))
        return need <= self.kv.num_free

    def _release_pages_for(self, seq: Sequence) -> bool:
        """Frees pages for a decoding `seq`: first from partly prefilled prompts, then by
        preempting the newest running sequence (possibly `seq` itself). False if impossible."""
        for other in reversed(self.waiting):
            if other.pages:
                self.kv.free(other)
                other.num_cached, other.prefilling = 0, False
                return True
        if len(self.running) > 1:
            self._preempt(self.running[-1])
            return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_cached, seq.prefilling = 0, False
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: Batch, tokens: list[int | None]) -> list[Sequence]:
        """Advance each sequence by what the step computed; returns those that finished."""
        finished = []
        now = time.perf_counter()
        logprobs = batch.logprobs or [None] * len(batch.seqs)
        read = batch.prompt_logprobs or [None] * len(batch.seqs)
        unread = batch.unread_scores or [None] * len(batch.seqs)
        for seq, n, tok, lp, prompt_lps, scores in zip(batch.seqs, batch.num_new_tokens, tokens,
                                                       logprobs, read, unread, strict=True):
            if seq.is_finished:
                continue  # it stopped in the step before, read back after this one launched
            seq.num_cached += n
            self.kv.cache_full_pages(seq)
            if prompt_lps is not None and seq.prompt_logprobs is not None:
                seq.prompt_logprobs += prompt_lps  # the unread ones included
                seq.unread_scores = []
            elif scores is not None:
                seq.unread_scores.append(scores)
            if tok is None:
                continue  # a prompt chunk that did not reach the prompt's end
            if seq.logprobs is not None and lp is not None:
                seq.logprobs.append(lp)
            if seq.status == Status.WAITING:
                self.waiting.remove(seq)
                seq.status, seq.prefilling = Status.RUNNING, False
                self.running.append(seq)
            seq.token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.grammar is not None and (error := seq.grammar.accept(tok)) is not None:
                seq.error = f"structured output: {error}"
                self.finish(seq, "error")
                finished.append(seq)
                continue
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and tok in self.eos_token_ids or tok in p.stop_token_ids:
            return "stop"
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if p.stop and self.detokenize is not None:
            # Only the recent tokens can complete a stop string (earlier ones were checked in
            # earlier steps): decoding a window keeps a step's cost independent of the output's
            # length. A token holds at least one byte, a character at most four.
            window = 4 * max(len(s) for s in p.stop) + 8
            recent = self.detokenize(seq.output_token_ids[-window:])
            if any(s in recent for s in p.stop):
                text = self.detokenize(seq.output_token_ids)
                seq.output_text = text[:min(i for s in p.stop if (i := text.find(s)) >= 0)]
                return "stop"
        if self._reaches_length(seq):
            return "length"
        return None

    def _reaches_length(self, seq: Sequence, extra: int = 0) -> bool:
        return (seq.num_output_tokens + extra >= seq.params.max_tokens
                or seq.num_tokens + extra >= self.max_model_len)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.finish(seq, "abort")
