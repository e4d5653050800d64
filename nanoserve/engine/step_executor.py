"""The forward of one step, defined once, as segments.

Without offload a step is one segment: embed, every layer, head. With streamed layers it is a
head segment (embed and the resident layers), one segment per streamed layer (its tail page in,
the layer, its tail page out) and a tail segment (norm and logits). Between segments the host
only orders streams through events: wait for a layer's load before its segment, mark its
compute done and start the next prefetch after. The same segments run eagerly (prefill, eager
decode), are captured into per-size decode graphs, and are replayed, all through `run`.

Prefill with offload is token-chunked, like resident prefill: each chunk loads its prefix of
every streamed layer (prefix_tokens * 4 KiB per layer for an 8-kv-head, d=128, bf16 model) and
sends its own KV home once. A layer-major prefill would read nothing back, but the re-read is
hidden: per layer and chunk, the prefix load takes prefix * 4 KiB / 55.6 GB/s while the chunk's
attention alone takes 4 * chunk * prefix * 4096 FLOP / ~633 TFLOP/s; at an 8192-token chunk the
copy is ~35% of the attention time, so with prefetch it never sets the pace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.attention.cpu_share import CpuShare
from nanoserve.engine.prompt_logprobs import PromptScores, score_rows
from offload import LayerStreamer, StepPlan

Segment = Callable[[], None]


class StepState:
    """A step's tensors as the segments pass them on: the residual stream (`hidden`) and the
    last layer's MLP output not yet added to it (`delta`), then the logits (and, for prompt
    rows being scored, their PromptScores). The buffers given are the fixed ones a captured
    graph writes into; None (eager) lets each segment allocate."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 sample_rows: torch.Tensor | None = None,
                 hidden: tuple[torch.Tensor, torch.Tensor] | None = None,
                 logits: torch.Tensor | None = None,
                 score: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
        """score: hidden rows to score, the prompt token after each, top-k (prefill)."""
        self.input_ids, self.positions, self.sample_rows = input_ids, positions, sample_rows
        self.score = score
        self.scores: PromptScores | None = None
        self._hidden_bufs, self._logits_buf = hidden, logits
        self.hidden, self.delta = hidden if hidden is not None else (None, None)
        self.logits = logits

    def put_hidden(self, x: torch.Tensor, delta: torch.Tensor | None) -> None:
        """delta None: nothing pending (no layer ran yet: every layer is streamed)."""
        if self._hidden_bufs is None:
            self.hidden, self.delta = x, delta
            return
        self.hidden = self._hidden_bufs[0].copy_(x)
        self.delta = None if delta is None else self._hidden_bufs[1].copy_(delta)

    def put_logits(self, x: torch.Tensor) -> None:
        self.logits = x if self._logits_buf is None else self._logits_buf.copy_(x)


class StepExecutor:
    def __init__(self, model, streamer: LayerStreamer | None, first_streamed: int,
                 cpu_share: CpuShare | None = None) -> None:
        """cpu_share: the CPU's share of streamed layers' decode attention, when on."""
        self.model, self.streamer, self.first_streamed = model, streamer, first_streamed
        self.cpu_share = cpu_share

    def segments(self, state: StepState) -> list[Segment]:
        layers = self.model.layers
        first = self.first_streamed if self.streamer is not None else len(layers)

        def head() -> None:
            x, delta = self.model.embed(state.input_ids), None
            for layer in layers[:first]:
                x, delta = layer(state.positions, x, delta)
            state.put_hidden(x, delta)
            if self.streamer is None:
                logits_of_hidden()

        def streamed(j: int) -> Segment:
            def run() -> None:
                self.streamer.tail_in(j)
                state.put_hidden(*layers[first + j](state.positions, state.hidden, state.delta))
                self.streamer.tail_out(j)
            return run

        def logits_of_hidden() -> None:
            h, delta = state.hidden, state.delta
            if state.score is not None:
                state.scores = score_rows(self.model.head, h, delta, *state.score)
            if state.sample_rows is not None:
                h, delta = h.index_select(0, state.sample_rows), \
                    delta.index_select(0, state.sample_rows)
            state.put_logits(self.model.head(h, delta))

        if self.streamer is None:
            return [head]
        return [head] + [streamed(j) for j in range(self.streamer.num_streamed)] + \
            [logits_of_hidden]

    def run(self, segments: list[Segment], plan: StepPlan | None,
            share_rows: int | None = None) -> None:
        """Runs (or replays) a step's segments in order, with the streamer's ordering around
        each streamed layer. share_rows: the rows a decode step's layers attend with the CPU's
        share (a graph's padded batch); None: its layers do not use the share."""
        if self.streamer is None:
            segments[0]()
            return
        s = self.streamer
        if self.cpu_share is not None and share_rows is not None and \
                plan.tail_pages is not None:  # decode
            self.cpu_share.begin_step(plan.cpu_tokens, plan.cpu_table, plan.gpu_starts,
                                      share_rows)
        s.begin_step(plan)
        segments[0]()
        for j, segment in enumerate(segments[1:-1]):
            s.wait_loaded(j)
            segment()
            s.finish_layer(j)
        segments[-1]()
        s.end_step()
