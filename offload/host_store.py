"""Pinned host memory holding the KV of every streamed layer: the source of truth for them.

In the shared layout (offload/layout.py) a run of consecutive page ids moves in one copy per K
and V, scales included (>= 1 MiB for real models: 256-token pages are 512 KiB of K for an
8-kv-head, d=128, bf16 layer, 264 KiB in FP8 with its scales), never one copy per page.
"""

from __future__ import annotations

import torch


def coalesce_runs(pages: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive page ids, in the order given."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class HostKVStore:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        """shape: PageLayout.shape(streamed layers, pages): [layer, 2, page, page row]."""
        self.data = torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.num_layers, self.num_pages = shape[0], shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def load(self, layer: int, runs: list[tuple[int, int]], slot: torch.Tensor) -> None:
        """Host pages -> the same page ids of a GPU slot [2, pages, ...]. Async on the current
        stream when the host memory is pinned."""
        src = self.data[layer]
        for a, b in runs:
            slot[0, a:b].copy_(src[0, a:b], non_blocking=True)
            slot[1, a:b].copy_(src[1, a:b], non_blocking=True)

    def store(self, layer: int, runs: list[tuple[int, int]], slot: torch.Tensor) -> None:
        """GPU slot pages -> host, async on the current stream when pinned."""
        dst = self.data[layer]
        for a, b in runs:
            dst[0, a:b].copy_(slot[0, a:b], non_blocking=True)
            dst[1, a:b].copy_(slot[1, a:b], non_blocking=True)

    def store_pages(self, layer: int, pages: list[int], src: torch.Tensor) -> None:
        """src: [2, len(pages), ...] (tail pages of running sequences) -> host pages."""
        dst = self.data[layer]
        for i, p in enumerate(pages):
            dst[0, p].copy_(src[0, i], non_blocking=True)
            dst[1, p].copy_(src[1, i], non_blocking=True)
