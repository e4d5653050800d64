"""Decode CUDA graphs: per captured batch size, one graph per segment of the step executor (one
for the whole model without offload; head, each streamed layer and tail with it), all sharing
one memory pool, replayed through the executor's own `run`.

A step of n sequences replays the graphs of the smallest captured size >= n; the padding rows
read one token of KV and write their KV to the dummy page (and the dummy tail row), and their
logits are ignored.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from nanoserve.context import ForwardContext, forward_context
from nanoserve.engine.step_executor import StepExecutor, StepState
from nanoserve.engine.step_inputs import StepInputs
from nanoserve.kv.pages import DUMMY_PAGE
from offload import StepPlan


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphRunner:
    def __init__(self, executor: StepExecutor, backend, max_bs: int, max_pages: int,
                 page_size: int, device: torch.device, progress: bool = True) -> None:
        self.executor, self.backend = executor, backend
        self.sizes = capture_sizes(max_bs)
        self.max_bs = n = self.sizes[-1]
        model = executor.model
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # the graphs' fixed-address inputs and outputs
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), DUMMY_PAGE * page_size, **i64)
        self.context_lens = torch.ones(n, **i32)
        self.page_tables = torch.full((n, max_pages), DUMMY_PAGE, **i32)
        self.hidden = torch.zeros(2, n, model.config.hidden_size,  # (stream, pending delta)
                                  dtype=next(model.parameters()).dtype, device=device)
        self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)
        streamer = executor.streamer
        if streamer is not None:
            self.tail_pages = torch.full((n,), DUMMY_PAGE, **i64)
            self.tail_rows = torch.full((n,), streamer.dummy_row, **i64)
        self.graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], ForwardContext]] = {}
        pool = None
        for bs in tqdm(list(reversed(self.sizes)), desc="Capturing decode graphs",
                       disable=not progress):
            ctx = ForwardContext(False, self.slot_mapping[:bs], self.page_tables[:bs],
                                 context_lens=self.context_lens[:bs])
            backend.prepare_capture(ctx, bs)
            state = StepState(self.input_ids[:bs], self.positions[:bs],
                              hidden=(self.hidden[0, :bs], self.hidden[1, :bs]),
                              logits=self.logits[:bs])
            segments = executor.segments(state)
            plan = self._static_plan(bs)
            with forward_context(ctx):
                executor.run(segments, plan)  # warm-up: autotuning, lazy init, outside capture
                graphs = []
                for segment in segments:
                    if streamer is not None:
                        streamer.plan = plan  # segments read the plan's tail tensors
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        segment()
                    pool = graph.pool()
                    graphs.append(graph)
            self.graphs[bs] = (graphs, ctx)
        torch.cuda.synchronize()

    def _static_plan(self, bs: int) -> StepPlan | None:
        if self.executor.streamer is None:
            return None
        return StepPlan(tail_pages=self.tail_pages[:bs], tail_rows=self.tail_rows[:bs])

    def can_run(self, n: int) -> bool:
        return n <= self.max_bs

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """inputs: a decode step built with pad_to=padded_size(n); returns its logits."""
        bs = inputs.input_ids.shape[0]
        self.input_ids[:bs].copy_(inputs.input_ids)
        self.positions[:bs].copy_(inputs.positions)
        self.slot_mapping[:bs].copy_(inputs.slot_mapping)
        self.context_lens[:bs].copy_(inputs.context_lens)
        self.page_tables[:bs, :inputs.page_tables.shape[1]].copy_(inputs.page_tables)
        graphs, ctx = self.graphs[bs]
        self.backend.prepare_replay(ctx, bs)
        plan = inputs.offload
        if plan is not None:  # the step's tails into the graphs' fixed tensors; padding: dummy
            n = inputs.num_seqs
            self.tail_pages[:n].copy_(plan.tail_pages)
            self.tail_rows[:n].copy_(plan.tail_rows)
            self.tail_pages[n:bs].fill_(DUMMY_PAGE)
            self.tail_rows[n:bs].fill_(self.executor.streamer.dummy_row)
        self.executor.run([g.replay for g in graphs], plan)
        return self.logits[:bs]
