"""Whole-model decode CUDA graphs, one per captured batch size, sharing one memory pool.

A step of n sequences replays the graph of the smallest captured size >= n; the padding rows
read one token of KV and write their KV to the dummy page, and their logits are ignored.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from nanoserve.context import ForwardContext, set_context
from nanoserve.kv.pages import DUMMY_PAGE


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphRunner:
    def __init__(self, model, backend, max_bs: int, max_pages: int, page_size: int,
                 device: torch.device, progress: bool = True) -> None:
        self.model, self.backend = model, backend
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_bs,), DUMMY_PAGE * page_size,
                                       dtype=torch.int64, device=device)
        self.context_lens = torch.ones(self.max_bs, **i32)
        self.page_tables = torch.full((self.max_bs, max_pages), DUMMY_PAGE, **i32)
        self.logits = torch.empty(self.max_bs, model.config.vocab_size, dtype=torch.float32,
                                  device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ForwardContext]] = {}
        pool = None
        for bs in tqdm(list(reversed(self.sizes)), desc="Capturing decode graphs",
                       disable=not progress):
            ctx = ForwardContext(False, self.slot_mapping[:bs], self.page_tables[:bs],
                                 context_lens=self.context_lens[:bs])
            backend.prepare_capture(ctx, bs)
            set_context(ctx)
            self._forward(bs)  # warm-up: autotuning and lazy init happen outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, ctx)
            set_context(None)
        torch.cuda.synchronize()

    def _forward(self, bs: int) -> None:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        self.logits[:bs].copy_(self.model.compute_logits(hidden))

    def can_run(self, n: int) -> bool:
        return n <= self.max_bs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            context_lens: torch.Tensor, page_tables: torch.Tensor) -> torch.Tensor:
        """Inputs are pinned CPU tensors already padded to a captured size."""
        bs = input_ids.shape[0]
        graph, ctx = self.graphs[bs]
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(slot_mapping, non_blocking=True)
        self.context_lens[:bs].copy_(context_lens, non_blocking=True)
        self.page_tables[:bs, :page_tables.shape[1]].copy_(page_tables, non_blocking=True)
        self.backend.prepare_replay(ctx, bs)
        graph.replay()
        return self.logits[:bs]

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)
