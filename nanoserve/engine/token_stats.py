"""Per-sequence token statistics that the penalties read, kept on the device.

For each sequence that uses a penalty, one row holds how often each token occurs in its output
and whether it occurs anywhere (prompt or output). Each step brings the row up to date with the
tokens the sequence gained since it was last seen (usually one), so the host work per step does
not grow with the context. A row depends only on the sequence's token ids, so it stays valid
across preemption; it is released when the sequence finishes. Row 0 is never assigned and stays
zero: batch rows without penalties point at it.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenStats:
    def __init__(self, vocab: int, capacity: int, device: torch.device) -> None:
        self.vocab, self.capacity, self.device = vocab, capacity, device
        self.counts: torch.Tensor | None = None  # f32 [capacity + 1, vocab], allocated on use
        self.seen: torch.Tensor | None = None  # bool [capacity + 1, vocab]
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.accounted: dict[int, int] = {}  # seq_id -> tokens already in its row
        self.free = list(range(capacity, 0, -1))

    def release(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.accounted.pop(seq_id)
            self.free.append(row)

    def rows_for(self, seqs, pin: bool = False) -> torch.Tensor:
        """Each sequence's row (0 for those without penalties), up to date with its tokens.
        `seqs`: objects with seq_id, params, token_ids, num_prompt_tokens."""
        if self.counts is None:  # both or neither, should the second allocation fail
            counts = torch.zeros(self.capacity + 1, self.vocab, device=self.device)
            seen = torch.zeros(self.capacity + 1, self.vocab, dtype=torch.bool,
                               device=self.device)
            self.counts, self.seen = counts, seen
        batch_ids = {s.seq_id for s in seqs}
        rows, fresh, new_rows, new_tokens, new_is_output = [], [], [], [], []
        for s in seqs:
            if not s.params.has_penalties:
                rows.append(0)
                continue
            row = self.rows.get(s.seq_id)
            if row is None:
                row = self._take_row(batch_ids)
                self.rows[s.seq_id], self.accounted[s.seq_id] = row, 0
                fresh.append(row)
            start, end = self.accounted[s.seq_id], len(s.token_ids)
            if end > start:
                new_rows.append(np.full(end - start, row))
                new_tokens.append(np.asarray(s.token_ids[start:], dtype=np.int64))
                new_is_output.append(np.arange(start, end) >= s.num_prompt_tokens)
            self.accounted[s.seq_id] = end
            rows.append(row)
        if fresh:
            index = self._put(np.asarray(fresh), pin)
            self.counts.index_fill_(0, index, 0.0)
            self.seen.index_fill_(0, index, False)
        if new_tokens:
            r = self._put(np.concatenate(new_rows), pin)
            t = self._put(np.concatenate(new_tokens), pin)
            is_output = self._put(np.concatenate(new_is_output).astype(np.float32), pin)
            self.seen.index_put_((r, t), torch.ones_like(is_output, dtype=torch.bool))
            self.counts.index_put_((r, t), is_output, accumulate=True)
        return self._put(np.asarray(rows, dtype=np.int64), pin)

    def _take_row(self, keep: set[int]) -> int:
        if not self.free:  # evict a sequence outside this batch; it is rebuilt if it returns
            victim = next(sid for sid in self.rows if sid not in keep)
            self.release(victim)
        return self.free.pop()

    def _put(self, array: np.ndarray, pin: bool) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        return (t.pin_memory() if pin else t).to(self.device, non_blocking=True)
