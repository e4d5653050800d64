"""Moves streamed layers' KV between the host store and the GPU ring, on a copy stream.

Ring: `num_slots` GPU slots, each [2, num_pages, page row] (offload/layout.py: a row holds a
page's values and, for a quantized KV dtype, their scales), mirroring the whole page-id range so
that page tables need no remapping. Streamed layer j always uses slot j % num_slots (so a
captured per-layer graph has fixed addresses).

Tails: each running sequence's last, partly filled page of every streamed layer lives on the GPU
(`tails[j, :, row]`), written by decode steps; it goes to the host in one copy per layer when the
page fills. Row `max_seqs` is a dummy for padded graph rows.

Ordering invariants (all through events and the copy stream's queue order, no host
synchronization, so they hold for a step launched before the last one's tokens are read):
- A slot is overwritten by a load only after the compute that read it finished (compute_done).
- Compute reads a slot only after its load finished (load_done).
- Device->host copies of a slot are issued on the copy stream after compute_done, so the next
  load into that slot (same stream, later) cannot overtake them, and a later load of those host
  pages (same stream) sees them complete.
- A tail flush is enqueued before the next step's loads; compute waits on those loads before it
  rewrites the tail, so the tail is never overwritten while it is being flushed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from offload.host_store import HostKVStore


@dataclass
class StepPlan:
    """What one step moves. Pages are page ids; rows are tail rows."""

    load_runs: list[tuple[int, int]] = field(default_factory=list)  # host -> slot, every layer
    store_runs: list[tuple[int, int]] = field(default_factory=list)  # slot -> host (prefill)
    tail_pages: torch.Tensor | None = None  # on device: decode tail page per sequence
    tail_rows: torch.Tensor | None = None  # on device
    init_pages: torch.Tensor | None = None  # on device: prefill-completed sequences' last page
    init_rows: torch.Tensor | None = None
    flush_pages: list[int] = field(default_factory=list)  # tails that fill in this step
    flush_rows: torch.Tensor | None = None  # on device: their tail rows
    # decode with a CPU share (nanoserve/attention/cpu_share.py): each row's leading tokens
    # the CPU attends from the host store (whole pages; load_runs skip them), None: no row
    # has any; the page tables they are read through; each row's first token on the GPU
    cpu_tokens: np.ndarray | None = None  # host, int32 [rows]
    cpu_table: np.ndarray | None = None  # host, int32 [rows, width]
    gpu_starts: torch.Tensor | None = None  # on device, int32 [rows]


class LayerStreamer:
    def __init__(self, host: HostKVStore, num_slots: int, max_seqs: int, device: torch.device):
        d = host.data
        self.host = host
        self.num_streamed = host.num_layers
        self.num_slots = min(num_slots, max(1, self.num_streamed))
        self.device = device
        self.slots = torch.zeros((self.num_slots, *d.shape[1:]), dtype=d.dtype, device=device)
        self.tails = torch.zeros((self.num_streamed, 2, max_seqs + 1, *d.shape[3:]),
                                 dtype=d.dtype, device=device)
        self.dummy_row = max_seqs
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            # Timing events, though nothing reads their times: with events created without
            # timing, offloaded decode at 4K took 12.02 ms a step against 11.46 ms (H200,
            # every layer streamed; tools/link_timeline.py --variants untimed-sync,none). A
            # timing event recorded on the compute stream beside each layer does as much.
            self.load_done = [torch.cuda.Event(enable_timing=True) for _ in range(self.num_slots)]
            self.compute_done = [torch.cuda.Event(enable_timing=True)
                                 for _ in range(self.num_slots)]
        self.plan = StepPlan()
        self.bytes_loaded = 0  # host->device bytes of the last step

    @property
    def gpu_bytes(self) -> int:
        return (self.slots.numel() + self.tails.numel()) * self.slots.element_size()

    def slot(self, j: int) -> torch.Tensor:
        """The ring slot streamed layer j reads, [2, pages, page row]."""
        return self.slots[j % self.num_slots]

    def on_copy_stream(self):
        """Work issued inside runs on the copy stream (CUDA), in order with the loads."""
        return torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()

    def begin_step(self, plan: StepPlan) -> None:
        self.plan = plan
        page_bytes = self.slots[0, :, 0].numel() * self.slots.element_size()  # K and V rows
        self.bytes_loaded = self.num_streamed * page_bytes * sum(b - a for a, b in plan.load_runs)
        for j in range(min(self.num_slots, self.num_streamed)):
            self._load(j)

    def _load(self, j: int) -> None:
        """Enqueued even with nothing to load: load_done then also covers every earlier
        device->host copy out of this slot, which the next compute must not overwrite."""
        s = j % self.num_slots
        with self.on_copy_stream():
            if self.cuda:
                self.copy_stream.wait_event(self.compute_done[s])
            self.host.load(j, self.plan.load_runs, self.slots[s])
            if self.cuda:
                self.load_done[s].record(self.copy_stream)

    def wait_loaded(self, j: int) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.load_done[j % self.num_slots])

    def tail_in(self, j: int) -> None:
        """Decode: the sequences' tail pages into the slot (device-to-device)."""
        p = self.plan
        if p.tail_pages is not None:
            slot = self.slots[j % self.num_slots]
            slot.index_copy_(1, p.tail_pages, self.tails[j].index_select(1, p.tail_rows))

    def tail_out(self, j: int) -> None:
        """Decode: the tail pages, now holding the new token, back to the tails. Prefill: the
        last page of each completed prompt becomes that sequence's tail."""
        p = self.plan
        slot = self.slots[j % self.num_slots]
        if p.tail_pages is not None:
            self.tails[j].index_copy_(1, p.tail_rows, slot.index_select(1, p.tail_pages))
        if p.init_pages is not None:
            self.tails[j].index_copy_(1, p.init_rows, slot.index_select(1, p.init_pages))

    def finish_layer(self, j: int) -> None:
        """Compute on slot j is issued: mark it, send prefill KV home, prefetch layer j+slots."""
        s = j % self.num_slots
        if self.cuda:
            self.compute_done[s].record()
        if self.plan.store_runs:
            with self.on_copy_stream():
                if self.cuda:
                    self.copy_stream.wait_event(self.compute_done[s])
                self.host.store(j, self.plan.store_runs, self.slots[s])
        if j + self.num_slots < self.num_streamed:
            self._load(j + self.num_slots)

    def end_step(self) -> None:
        """Tails that filled in this step go to their host pages (one copy per layer each)."""
        p = self.plan
        if not p.flush_pages:
            return
        rows = p.flush_rows
        compute = torch.cuda.current_stream() if self.cuda else None
        with self.on_copy_stream():
            if self.cuda:
                self.copy_stream.wait_stream(compute)
                rows.record_stream(self.copy_stream)  # read here after its owner lets go
            for j in range(self.num_streamed):
                self.host.store_pages(j, p.flush_pages, self.tails[j].index_select(1, rows))
