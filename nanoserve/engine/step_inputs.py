"""One step's inputs, built once from the scheduled batch.

Every per-sequence fact (where its new tokens go, whether it samples, its tail row) is computed
in one pass; every device tensor, the offload plan's included, comes from one pinned staging
buffer through one non-blocking copy. Nothing here synchronizes the host with the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.context import ForwardContext
from nanoserve.engine.prompt_logprobs import PromptScores
from nanoserve.engine.scheduler import Batch
from nanoserve.kv.pages import DUMMY_PAGE
from offload import CpuSplit, StepPlan, coalesce_runs


@dataclass
class StepInputs:
    is_prefill: bool
    num_seqs: int  # real sequences; rows past them (decode) are padding
    num_decode: int  # a mixed step's leading decode rows (prefill path); 0 otherwise
    samples: list[bool]  # on cpu, per sequence: this step yields its next token
    # on device
    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    slot_mapping: torch.Tensor  # int64 [tokens]: flat KV slot of each new token
    page_tables: torch.Tensor  # int32 [rows, width]
    context_lens: torch.Tensor | None = None  # int32 [rows], decode (a mixed step's decode rows)
    sample_rows: torch.Tensor | None = None  # int64: hidden rows to take logits of (prefill)
    # prompt scoring (prefill): hidden rows whose next prompt token gets its logprob, those ids
    score_rows: torch.Tensor | None = None  # int64 [scored]
    score_ids: torch.Tensor | None = None  # int64 [scored]
    # on cpu
    query_lens: list[int] = field(default_factory=list)  # prefill
    prefix_lens: list[int] = field(default_factory=list)  # prefill
    offload: StepPlan | None = None  # what the streamer moves in this step
    score_k: int = 0  # top alternatives per scored row
    prompt_scores: PromptScores | None = None  # out: set by the eager forward when rows score

    def context(self) -> ForwardContext:
        ctx = ForwardContext(self.is_prefill, self.slot_mapping, self.page_tables,
                             query_lens=self.query_lens, prefix_lens=self.prefix_lens,
                             context_lens=self.context_lens)
        if self.is_prefill and self.num_decode:
            n = self.num_decode  # one token per decode row: tokens and sequences line up
            ctx.parts = (
                ForwardContext(False, self.slot_mapping[:n], self.page_tables[:n],
                               context_lens=self.context_lens),
                ForwardContext(True, self.slot_mapping[n:], self.page_tables[n:],
                               query_lens=self.query_lens[n:], prefix_lens=self.prefix_lens[n:]))
        return ctx


@dataclass
class InFlightTokens:
    """A launched step's sampled tokens, on the device, before the host reads them."""
    tokens: torch.Tensor  # int64 [sampling rows]
    rows: dict[int, int]  # seq_id -> its row in tokens


# Triton specializes a kernel on whether each pointer is 16-byte aligned, as a graph's own
# buffers are: tensors on 8-byte boundaries compiled a second variant of the decode kernel
# inside the first mixed step (1.1 s each, in a request's time to first token)
ALIGN = 16


def upload(arrays: dict[str, np.ndarray], device: torch.device, pin: bool
           ) -> dict[str, torch.Tensor]:
    """Host arrays -> device tensors: one staging buffer (pinned on CUDA), one non-blocking
    copy, then typed views. Each array starts on an ALIGN-byte boundary."""
    offsets, total = {}, 0
    for name, a in arrays.items():
        offsets[name] = total
        total += -(-a.nbytes // ALIGN) * ALIGN
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=pin)
    raw = host.numpy()
    for name, a in arrays.items():
        raw[offsets[name]:offsets[name] + a.nbytes] = np.ascontiguousarray(a).view(np.uint8) \
            .reshape(-1)
    dev = host.to(device, non_blocking=True)
    return {name: dev[offsets[name]:offsets[name] + a.nbytes]
            .view(torch.from_numpy(a[:0]).dtype).view(a.shape) for name, a in arrays.items()}


def distinct_runs(pages: list[int]) -> list[tuple[int, int]]:
    """Runs of the distinct pages: a page shared by several sequences (a cached prefix) crosses
    PCIe once per step, not once per sequence."""
    return coalesce_runs(sorted(set(pages)))


@dataclass
class HostStep:
    """A step's inputs on the host, before upload: plain arrays and lists, picklable, so that
    under tensor parallelism rank 0 builds a step once and every rank uploads the same one."""
    is_prefill: bool
    num_seqs: int
    num_decode: int
    samples: list[bool]
    arrays: dict[str, np.ndarray]
    query_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    streamed: bool = False  # layers stream: the arrays carry an offload plan
    load_runs: list[tuple[int, int]] = field(default_factory=list)
    store_runs: list[tuple[int, int]] = field(default_factory=list)
    flush_pages: list[int] = field(default_factory=list)
    cpu_tokens: np.ndarray | None = None  # decode: the CPU's leading tokens per row, if any
    score_counts: list[int] = field(default_factory=list)  # prefill: rows scored per sequence
    score_k: int = 0
    # async scheduling under TP: rank 0 sends this (launched) step's sampled ids to every rank
    shares_tokens: bool = False
    uses_in_flight: bool = False  # some rows take the previous launched step's ids

    def to_device(self, device: torch.device, pin: bool,
                  in_flight: InFlightTokens | None = None) -> StepInputs:
        """in_flight: the tokens of the step launched before this one, not yet read back; a
        decode row whose sequence waits for one takes it as its input id on the device."""
        t = upload(self.arrays, device, pin)
        if in_flight is not None:
            src = t["from_step"]
            t["ids"] = torch.where(src >= 0, in_flight.tokens[src.clamp(min=0)], t["ids"])
        plan = None
        if self.streamed and self.is_prefill:
            plan = StepPlan(load_runs=self.load_runs, store_runs=self.store_runs)
            if len(self.arrays["init_pages"]):
                plan.init_pages, plan.init_rows = t["init_pages"], t["init_rows"]
        elif self.streamed:
            plan = StepPlan(load_runs=self.load_runs, tail_pages=t["tail_pages"],
                            tail_rows=t["tail_rows"], flush_pages=self.flush_pages,
                            flush_rows=t["flush_rows"])
            if self.cpu_tokens is not None:
                plan.cpu_tokens, plan.cpu_table = self.cpu_tokens, self.arrays["table"]
                plan.gpu_starts = t["gpu_starts"]
        return StepInputs(self.is_prefill, self.num_seqs, self.num_decode, self.samples,
                          t["ids"], t["pos"], t["slots"], t["table"], context_lens=t["lens"],
                          sample_rows=t["rows"] if self.is_prefill else None,
                          query_lens=self.query_lens, prefix_lens=self.prefix_lens,
                          offload=plan, score_k=self.score_k,
                          **self._score_tensors(t))

    def _score_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not sum(self.score_counts):
            return {}
        return {"score_rows": t["score_rows"], "score_ids": t["score_ids"]}


class StepInputBuilder:
    def __init__(self, page_size: int, device: torch.device,
                 tail_row: Callable[[object], int] | None = None,
                 cpu_split: CpuSplit | None = None, layer_page_bytes: int = 0) -> None:
        """tail_row: the KV manager's tail row of a sequence, when layers stream. cpu_split:
        how much of each decode row's host KV the CPU attends (layer_page_bytes: K+V of one
        page of one layer, what it weighs the step by)."""
        self.page_size, self.device, self.tail_row = page_size, device, tail_row
        self.cpu_split, self.layer_page_bytes = cpu_split, layer_page_bytes
        self.pin = device.type == "cuda"

    def _slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def _page_table(self, page_lists: list[list[int]], rows: int) -> np.ndarray:
        width = max(1, max(len(p) for p in page_lists))
        table = np.full((rows, width), DUMMY_PAGE, dtype=np.int32)
        for i, p in enumerate(page_lists):
            table[i, :len(p)] = p
        return table

    def build(self, batch: Batch, pad_to: int | None = None,
              in_flight: InFlightTokens | None = None) -> StepInputs:
        """The step's inputs on the device: `plan`, then its upload."""
        rows = in_flight.rows if in_flight is not None else None
        return self.plan(batch, pad_to, rows).to_device(self.device, self.pin, in_flight)

    def plan(self, batch: Batch, pad_to: int | None = None,
             in_flight_rows: dict[int, int] | None = None) -> HostStep:
        """pad_to: decode rows to pad to (a captured graph's size). in_flight_rows: seq_id ->
        row of the launched step's tokens, for the sequences that wait for one."""
        if batch.is_prefill:
            return self._prefill(batch)
        step = self._decode(batch, pad_to or len(batch.seqs), in_flight_rows or {})
        step.uses_in_flight = bool((step.arrays["from_step"] >= 0).any())
        return step

    def _prefill(self, batch: Batch) -> HostStep:
        ps = self.page_size
        ids, pos, slots, rows, samples = [], [], [], [], []
        load, store, init_pages, init_rows = [], [], [], []
        score_rows, score_ids, score_counts = [], [], []
        num_tokens = 0
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = s.num_cached, s.num_cached + n
            # prompt tokens not scored yet whose predecessor is in this chunk (after a
            # preemption the recomputed ones are scored once only)
            lo, hi = (max(start, s.num_prompt_scored - 1), min(end, s.num_prompt_tokens - 1)) \
                if s.prompt_logprobs is not None else (0, 0)
            score_counts.append(max(0, hi - lo))
            if hi > lo:
                score_rows.append(np.arange(lo, hi, dtype=np.int64) - start + num_tokens)
                score_ids.append(np.asarray(s.token_ids[lo + 1:hi + 1], dtype=np.int64))
            p = np.arange(start, end, dtype=np.int64)
            ids.append(np.asarray(s.token_ids[start:end], dtype=np.int64))
            pos.append(p)
            slots.append(np.asarray(s.pages, dtype=np.int64)[p // ps] * ps + p % ps)
            num_tokens += n
            samples.append(end == s.num_tokens)
            if samples[-1]:
                rows.append(num_tokens - 1)
            if self.tail_row is not None:
                load += s.pages[:-(-start // ps)]
                store += s.pages[start // ps:-(-end // ps)]
                if samples[-1] and end % ps:  # it decodes next: its last page becomes a tail
                    init_pages.append(s.pages[end // ps])
                    init_rows.append(self.tail_row(s))
        if batch.num_decode and self.tail_row is not None:
            raise ValueError("mixed steps need resident KV (a streamed sequence decodes from its "
                             "tail row)")
        decode_lens = [s.num_tokens for s in batch.seqs[:batch.num_decode]]
        arrays = {"ids": np.concatenate(ids), "pos": np.concatenate(pos),
                  "slots": np.concatenate(slots), "rows": np.array(rows, np.int64),
                  "table": self._page_table([s.pages for s in batch.seqs], len(batch.seqs)),
                  "lens": np.array(decode_lens, np.int32),
                  "init_pages": np.array(init_pages, np.int64),
                  "init_rows": np.array(init_rows, np.int64)}
        if score_rows:
            arrays["score_rows"] = np.concatenate(score_rows)
            arrays["score_ids"] = np.concatenate(score_ids)
        streamed = self.tail_row is not None
        score_k = max((s.params.prompt_logprobs for s, c in zip(batch.seqs, score_counts,
                                                                strict=True) if c), default=0)
        return HostStep(True, len(batch.seqs), batch.num_decode, samples, arrays,
                        list(batch.num_new_tokens), [s.num_cached for s in batch.seqs],
                        streamed, distinct_runs(load) if streamed else [],
                        coalesce_runs(store) if streamed else [],
                        score_counts=score_counts, score_k=score_k)

    def _decode(self, batch: Batch, rows: int, in_flight_rows: dict[int, int]) -> HostStep:
        ps, n = self.page_size, len(batch.seqs)
        ids = np.zeros(rows, np.int64)
        pos = np.zeros(rows, np.int64)
        slots = np.full(rows, DUMMY_PAGE * ps, np.int64)
        lens = np.ones(rows, np.int32)
        from_step = np.full(rows, -1, np.int64)  # row of the in-flight tokens, or -1: ids[i]
        load, tail_pages, tail_rows, flush_pages, flush_rows = [], [], [], [], []
        cpu_pages = self._cpu_pages(batch) if self.tail_row is not None else [0] * n
        for i, s in enumerate(batch.seqs):
            p = s.num_tokens - 1 + s.num_pending  # the token this step writes
            if s.num_pending:
                from_step[i] = in_flight_rows[s.seq_id]
            else:
                ids[i] = s.token_ids[-1]
            pos[i], slots[i], lens[i] = p, self._slot(s.pages, p), p + 1
            if self.tail_row is not None:
                load += s.pages[cpu_pages[i]:p // ps]  # the CPU reads the first ones itself
                tail_pages.append(s.pages[p // ps])
                tail_rows.append(self.tail_row(s))
                if (p + 1) % ps == 0:  # the tail fills: it goes home after the step
                    flush_pages.append(tail_pages[-1])
                    flush_rows.append(tail_rows[-1])
        arrays = {"ids": ids, "from_step": from_step, "pos": pos, "slots": slots, "lens": lens,
                  "table": self._page_table([s.pages for s in batch.seqs], rows),
                  "tail_pages": np.array(tail_pages, np.int64),
                  "tail_rows": np.array(tail_rows, np.int64),
                  "flush_rows": np.array(flush_rows, np.int64)}
        cpu_tokens = None
        if any(cpu_pages):
            cpu_tokens = np.array(cpu_pages, np.int32) * ps
            arrays["gpu_starts"] = cpu_tokens
        streamed = self.tail_row is not None
        return HostStep(False, n, 0, [True] * n, arrays, streamed=streamed,
                        load_runs=distinct_runs(load) if streamed else [],
                        flush_pages=flush_pages, cpu_tokens=cpu_tokens)

    def _cpu_pages(self, batch: Batch) -> list[int]:
        """Each decode row's leading pages the CPU attends: a share of its full pages (all in
        the host store: only the tail, the page the step writes, is on the GPU)."""
        if self.cpu_split is None:
            return [0] * len(batch.seqs)
        full = [(s.num_tokens - 1 + s.num_pending) // self.page_size for s in batch.seqs]
        distinct = len({p for s, n in zip(batch.seqs, full, strict=True) for p in s.pages[:n]})
        f = self.cpu_split.fraction(distinct * self.layer_page_bytes,
                                    sum(full) * self.layer_page_bytes)
        return [self.cpu_split.pages(f, n) for n in full]
