"""Whole-model decode CUDA graphs, one per captured batch size, sharing one memory pool.

A step of n sequences replays the graph of the smallest captured size >= n; the padding rows
read one token of KV and write their KV to the dummy page, and their logits are ignored.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from nanoserve.context import ForwardContext, forward_context
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
            with forward_context(ctx):
                self._forward(bs)  # warm-up: autotuning and lazy init happen outside capture
                graph, pool = self._capture(bs, pool)
            self.graphs[bs] = (graph, ctx)
        torch.cuda.synchronize()

    def _capture(self, bs: int, pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._forward(bs)
        return graph, graph.pool()

    def _forward(self, bs: int) -> None:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        self.logits[:bs].copy_(self.model.compute_logits(hidden))

    def can_run(self, n: int) -> bool:
        return n <= self.max_bs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            context_lens: torch.Tensor, page_tables: torch.Tensor) -> torch.Tensor:
        """Inputs are pinned CPU tensors already padded to a captured size."""
        bs = self._load_inputs(input_ids, positions, slot_mapping, context_lens, page_tables)
        self.graphs[bs][0].replay()
        return self.logits[:bs]

    def _load_inputs(self, input_ids, positions, slot_mapping, context_lens, page_tables) -> int:
        """Copies a step's inputs into the fixed-address buffers; returns the padded size."""
        bs = input_ids.shape[0]
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(slot_mapping, non_blocking=True)
        self.context_lens[:bs].copy_(context_lens, non_blocking=True)
        self.page_tables[:bs, :page_tables.shape[1]].copy_(page_tables, non_blocking=True)
        self.backend.prepare_replay(self.graphs[bs][1], bs)
        return bs

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)


class OffloadDecodeGraphRunner(DecodeGraphRunner):
    """Decode graphs when some layers stream: per batch size, one graph for the embedding and
    the resident layers, one per streamed layer (its tail swap-in, forward, swap-out, with its
    ring slot bound at fixed addresses), one for the final norm and logits. Between replays the
    host only orders streams through events: wait for layer j's load, replay, mark compute done
    and start the next prefetch. Nothing synchronizes the host."""

    def __init__(self, model, backend, hooks, max_bs: int, max_pages: int, page_size: int,
                 device: torch.device, progress: bool = True) -> None:
        self.hooks = hooks
        self.streamer = hooks.streamer
        self.first_streamed = hooks.first_streamed
        self.tail_pages = torch.full((capture_sizes(max_bs)[-1],), DUMMY_PAGE, dtype=torch.int64,
                                     device=device)
        self.tail_rows = torch.full_like(self.tail_pages, self.streamer.dummy_row)
        self.hidden = torch.zeros(capture_sizes(max_bs)[-1], model.config.hidden_size,
                                  dtype=next(model.parameters()).dtype, device=device)
        super().__init__(model, backend, max_bs, max_pages, page_size, device, progress)

    def _segments(self, bs: int):
        """The step as a list of graph-capturable pieces: head, each streamed layer, tail."""
        layers = self.model.model.layers
        pos, h = self.positions[:bs], self.hidden[:bs]

        def head():
            x = self.model.model.embed_tokens(self.input_ids[:bs])
            for layer in layers[:self.first_streamed]:
                x = layer(pos, x)
            h.copy_(x)

        def streamed(j):
            def run():
                self.streamer.tail_in(j)
                h.copy_(layers[self.first_streamed + j](pos, h))
                self.streamer.tail_out(j)
            return run

        def tail():
            self.logits[:bs].copy_(self.model.compute_logits(self.model.model.norm(h)))

        return [head] + [streamed(j) for j in range(self.streamer.num_streamed)] + [tail]

    def _forward(self, bs: int) -> None:  # warm-up, eager
        self._bind_static_plan(bs)
        for seg in self._segments(bs):
            seg()

    def _bind_static_plan(self, bs: int) -> None:
        from offload.streamer import StepPlan

        self.streamer.plan = StepPlan(tail_pages=self.tail_pages[:bs],
                                      tail_rows=self.tail_rows[:bs])

    def _capture(self, bs: int, pool):
        self._bind_static_plan(bs)
        graphs = []
        for seg in self._segments(bs):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                seg()
            pool = g.pool()
            graphs.append(g)
        return graphs, pool

    def run_offloaded(self, inputs, plan) -> torch.Tensor:
        """inputs: pinned, padded (ids, pos, slots, lens, table); plan: the step's StepPlan."""
        bs = self._load_inputs(*inputs)
        graphs = self.graphs[bs][0]
        n = plan.tail_pages.shape[0]
        self.tail_pages[:n].copy_(plan.tail_pages, non_blocking=True)
        self.tail_rows[:n].copy_(plan.tail_rows, non_blocking=True)
        self.tail_pages[n:bs].fill_(DUMMY_PAGE)
        self.tail_rows[n:bs].fill_(self.streamer.dummy_row)
        self.streamer.begin_step(plan)
        graphs[0].replay()
        for j, g in enumerate(graphs[1:-1]):
            self.streamer.wait_loaded(j)
            g.replay()
            self.streamer.finish_layer(j)
        graphs[-1].replay()
        self.streamer.end_step()
        return self.logits[:bs]
