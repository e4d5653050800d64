"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the
most likely alternatives at its position, computed on the device from the prefill's own hidden
states (the prefill runs anyway; scoring adds the head over the scored rows).

The head runs over a bounded number of rows at a time: a 152K-token vocabulary in float32 is
0.6 MB per row, so a whole 8K-token chunk at once would need 5 GB for its logits alone; each
call reads the whole lm_head weight (1.2 GB for Qwen3-8B), so calls of few rows pay for that
again and again. The memory profile runs one call of ROWS_PER_HEAD_CALL rows
(ModelRunner._profile_free_bytes), so its peak is in the KV budget. No log_softmax tensor is
made: a logprob is its logit less the row's log-sum-exp, and the top alternative (k <= 1, as
lm-eval asks) is a max, not a top-k over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.engine.sampler import to_host
from nanoserve.outputs import TokenLogprobs

ROWS_PER_HEAD_CALL = 512


@dataclass
class PromptScores:
    """The scored rows' results, on the device until read."""

    logprobs: torch.Tensor  # f32 [R]: each row's next prompt token
    top_logprobs: torch.Tensor  # f32 [R, max(k, 1)], most likely first
    top_ids: torch.Tensor  # int64 [R, max(k, 1)]


def score_rows(head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
               hidden: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor,
               next_ids: torch.Tensor, k: int) -> PromptScores:
    """`head(hidden, delta)` -> float32 logits; `rows`: the hidden rows to score, `next_ids`:
    the token that follows each. The raw distribution's logprobs (no temperature, no filters),
    as the sampled tokens' logprobs are."""
    out_lp, out_vals, out_ids = [], [], []
    for lo in range(0, rows.numel(), ROWS_PER_HEAD_CALL):
        r = rows[lo:lo + ROWS_PER_HEAD_CALL]
        h = hidden.index_select(0, r)
        d = None if delta is None else delta.index_select(0, r)
        logits = head(h, d)
        lse = logits.logsumexp(-1, keepdim=True)
        chosen = logits.gather(1, next_ids[lo:lo + ROWS_PER_HEAD_CALL, None])
        out_lp.append((chosen - lse).squeeze(1))
        if k <= 1:
            values, ids = logits.max(-1, keepdim=True)
        else:
            values, ids = logits.topk(k, dim=-1)
        out_vals.append(values - lse)
        out_ids.append(ids)
    return PromptScores(torch.cat(out_lp), torch.cat(out_vals), torch.cat(out_ids))


@dataclass
class UnreadScores:
    """One sequence's scored rows of one step, on the device until a step that synchronizes
    anyway (one that samples) reads them: a prompt's chunks before its last add no wait."""

    scores: PromptScores
    next_ids: list[int]
    k: int

    def __len__(self) -> int:
        return len(self.next_ids)


def slice_scores(scores: PromptScores, next_ids: list[int], counts: list[int],
                 ks: list[int | None]) -> list[UnreadScores | None]:
    """`scores` (rows in batch order) per sequence: `counts[i]` rows of sequence i, with
    `ks[i]` alternatives; views on the device, nothing read."""
    out: list[UnreadScores | None] = []
    at = 0
    for count, k in zip(counts, ks, strict=True):
        rows = slice(at, at + count)
        out.append(UnreadScores(PromptScores(scores.logprobs[rows], scores.top_logprobs[rows],
                                             scores.top_ids[rows]), next_ids[rows], k or 0)
                   if count else None)
        at += count
    return out


def read_scores(pending: list[list[UnreadScores]]) -> list[list[TokenLogprobs]]:
    """Each sequence's unread scores as TokenLogprobs, in order, behind one synchronization."""
    flat = [u for group in pending for u in group]
    if not flat:
        return [[] for _ in pending]
    width = max(max(u.k for u in flat), 1)  # steps computed max(their k, 1) columns each

    def columns(t: torch.Tensor) -> torch.Tensor:
        t = t[:, :width]
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    lps, vals, ids = (t.tolist() for t in to_host(
        torch.cat([u.scores.logprobs for u in flat]),
        torch.cat([columns(u.scores.top_logprobs) for u in flat]),
        torch.cat([columns(u.scores.top_ids) for u in flat])))
    out, at = [], 0
    for group in pending:
        items: list[TokenLogprobs] = []
        for u in group:
            rows = range(at, at + len(u))
            if u.k == 0:
                items += [TokenLogprobs(t, lps[i], ()) for t, i in zip(u.next_ids, rows,
                                                                       strict=True)]
            else:
                items += [TokenLogprobs(t, lps[i], tuple(zip(ids[i][:u.k], vals[i][:u.k],
                                                             strict=True)))
                          for t, i in zip(u.next_ids, rows, strict=True)]
            at += len(u)
        out.append(items)
    return out
