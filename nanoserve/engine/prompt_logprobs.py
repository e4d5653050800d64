"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the
most likely alternatives at its position, computed on the device from the prefill's own hidden
states (the prefill runs anyway; scoring adds the head over the scored rows).

The head runs over a bounded number of rows at a time: a 152K-token vocabulary in float32 is
0.6 MB per row, so a whole 8K-token chunk at once would need 5 GB for its logits alone. 128 rows'
logits and their log_softmax fit the room the memory profile keeps beside the decode graphs'
logits (ModelRunner._profile_free_bytes: 4 x 64 rows of the vocabulary in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.outputs import TokenLogprobs

ROWS_PER_HEAD_CALL = 128


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
        logprobs = head(h, d).log_softmax(-1)
        out_lp.append(logprobs.gather(1, next_ids[lo:lo + ROWS_PER_HEAD_CALL, None])
                      .squeeze(1))
        values, ids = logprobs.topk(max(k, 1), dim=-1)
        out_vals.append(values)
        out_ids.append(ids)
    return PromptScores(torch.cat(out_lp), torch.cat(out_vals), torch.cat(out_ids))


def split_scores(scores: PromptScores, next_ids: list[int], counts: list[int],
                 ks: list[int | None]) -> list[list[TokenLogprobs]]:
    """Host copies of `scores` (rows in batch order) as each sequence's TokenLogprobs:
    `counts[i]` rows of sequence i, `ks[i]` alternatives each."""
    lps = scores.logprobs.tolist()
    vals = scores.top_logprobs.tolist()
    ids = scores.top_ids.tolist()
    out, at = [], 0
    for count, k in zip(counts, ks, strict=True):
        k = k or 0
        out.append([TokenLogprobs(next_ids[i], lps[i],
                                  tuple(zip(ids[i][:k], vals[i][:k], strict=True)))
                    for i in range(at, at + count)])
        at += count
    return out
