"""Decode CUDA graphs: per captured batch size, one graph per segment of the step executor (one
for the whole model without offload; head, each streamed layer and tail with it), all sharing
one memory pool, replayed through the executor's own `run`.

A step of n sequences replays the graphs of the smallest captured size >= n; the padding rows
read one token of KV and write their KV to the dummy page (and the dummy tail row), and their
logits are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from nanoserve.attention.cpu_share import CpuShare
from nanoserve.context import ForwardContext, forward_context
from nanoserve.engine.step_executor import StepExecutor, StepState
from nanoserve.engine.step_inputs import StepInputs
from nanoserve.kv.pages import DUMMY_PAGE
from offload import StepPlan


class GraphChain:
    """One segment captured as CUDA graphs, cut where the CPU's attention share meets the
    stream (attention/cpu_share.py): a streamed layer with a CPU share replays as graph, mark,
    graph, host work, graph; any other segment as one graph."""

    def __init__(self, pool, stream: torch.cuda.Stream) -> None:
        """stream: the capture stream, one for every chain of a pool (the caching allocator
        reuses a freed block only on the stream that freed it)."""
        self.pool, self.stream = pool, stream
        self.steps: list[Callable[[], None]] = []

    def capture(self, segment: Callable[[], None], share: CpuShare | None
                ) -> Callable[[], None]:
        """Captures `segment`, with `share`'s host syncs as cuts; returns its replay."""
        eager = share.sync if share is not None else None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._begin()
            if share is not None:
                share.sync = _CuttingSync(self, eager.event)
            try:
                segment()
            finally:
                if share is not None:
                    share.sync = eager
            self._end()
        torch.cuda.current_stream().wait_stream(self.stream)
        steps = self.steps
        if len(steps) == 1:
            return steps[0]
        return lambda: [step() for step in steps]

    def _begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def _end(self) -> None:
        self.graph.capture_end()
        self.pool = self.graph.pool()
        self.steps.append(self.graph.replay)

    def cut(self, then: Callable[[], None]) -> None:
        """Ends the graph so far; at replay, `then` runs after it, before the next graph."""
        self._end()
        self.steps.append(then)
        self._begin()


class _CuttingSync:
    """CpuShare's sync while a segment is captured: the mark and the host's work become cuts
    (EagerSync's, replayed between the graphs)."""

    def __init__(self, chain: GraphChain, event: torch.cuda.Event) -> None:
        self.chain, self.event = chain, event

    def mark(self) -> None:
        self.chain.cut(self.event.record)

    def after_mark(self, work: Callable[[], None], wait: Callable[[], bool]) -> None:
        event = self.event

        def host() -> None:
            if wait():
                event.synchronize()
            work()
        self.chain.cut(host)


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
        self.graphs: dict[int, tuple[list[Callable[[], None]], ForwardContext]] = {}
        pool, capture_stream = None, torch.cuda.Stream()
        for bs in tqdm(list(reversed(self.sizes)), desc="Capturing decode graphs",
                       disable=not progress):
            ctx = ForwardContext(False, self.slot_mapping[:bs], self.page_tables[:bs],
                                 context_lens=self.context_lens[:bs],
                                 cpu_share=executor.cpu_share)
            backend.prepare_capture(ctx, bs)
            state = StepState(self.input_ids[:bs], self.positions[:bs],
                              hidden=(self.hidden[0, :bs], self.hidden[1, :bs]),
                              logits=self.logits[:bs])
            segments = executor.segments(state)
            plan = self._static_plan(bs)
            with forward_context(ctx):
                executor.run(segments, plan, bs)  # warm-up: autotuning, lazy init, not captured
                replays = []
                for segment in segments:
                    if streamer is not None:
                        streamer.plan = plan  # segments read the plan's tail tensors
                    chain = GraphChain(pool, capture_stream)
                    replays.append(chain.capture(segment, executor.cpu_share))
                    pool = chain.pool
            self.graphs[bs] = (replays, ctx)
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
        self.executor.run(graphs, plan, bs)
        return self.logits[:bs]
