"""The engine's side of KV offload: per-step plans for the streamer, tail rows, layer hooks.

Prefill with offload is token-chunked, like resident prefill: each chunk loads its prefix of every
streamed layer (prefix_tokens * 4 KiB per layer for an 8-kv-head, d=128, bf16 model) and sends
its own KV home once. A layer-major prefill would read nothing back, but the re-read is hidden:
per layer and chunk, the prefix load takes prefix * 4 KiB / 55.6 GB/s while the chunk's attention
alone takes 4 * chunk * prefix * 4096 FLOP / ~633 TFLOP/s; at an 8192-token chunk the copy is
~35% of the attention time, so with prefetch it never sets the pace. It also keeps one code
path (the same scheduler, layers and kernels) and bounds GPU memory by the chunk.
"""

from __future__ import annotations

import torch

from nanoserve.engine.scheduler import Batch
from nanoserve.engine.sequence import Sequence
from offload import HostKVStore, LayerStreamer, ResidencyPlan, coalesce_runs
from offload.streamer import StepPlan


class OffloadHooks:
    """LayerHooks for the model's forward loop: streamed layers wait for their slot and swap
    tails before compute, release the slot and prefetch after."""

    def __init__(self, plan: ResidencyPlan, streamer: LayerStreamer, page_size: int,
                 max_seqs: int) -> None:
        self.plan, self.streamer, self.page_size = plan, streamer, page_size
        self.first_streamed = plan.resident_layers
        self.free_rows = list(range(max_seqs))
        self.rows: dict[int, int] = {}  # seq_id -> tail row

    @classmethod
    def build(cls, plan: ResidencyPlan, model_cfg, page_size: int, max_seqs: int, num_slots: int,
              dtype: torch.dtype, device: torch.device) -> OffloadHooks:
        host = HostKVStore(plan.streamed_layers, plan.num_pages, page_size,
                           model_cfg.num_kv_heads, model_cfg.head_dim, dtype,
                           pin=device.type == "cuda")
        return cls(plan, LayerStreamer(host, num_slots, max_seqs, device), page_size, max_seqs)

    def bind(self, attention_layers) -> None:
        """Streamed layers read their KV from their ring slot, for good (fixed addresses)."""
        for attn in attention_layers[self.first_streamed:]:
            attn.k_cache, attn.v_cache = self.streamer.slot_kv(
                attn.layer_id - self.first_streamed)

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    # --- per step -----------------------------------------------------------------------------
    def begin_step(self, batch: Batch) -> None:
        self.streamer.begin_step(self.step_plan(batch))

    def end_step(self) -> None:
        self.streamer.end_step()

    def step_plan(self, batch: Batch) -> StepPlan:
        ps = self.page_size
        dev = self.streamer.device
        plan = StepPlan()
        load, store = [], []
        if batch.is_prefill:
            init_pages, init_rows = [], []
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                load += s.pages[:(s.num_cached + ps - 1) // ps]
                end = s.num_cached + n
                store += s.pages[s.num_cached // ps:(end + ps - 1) // ps]
                if end == s.num_tokens:  # prompt complete: it decodes next, from a tail row
                    self.release(s)
                    row = self.rows[s.seq_id] = self.free_rows.pop()
                    if end % ps:
                        init_pages.append(s.pages[end // ps])
                        init_rows.append(row)
            if init_pages:
                plan.init_pages = torch.tensor(init_pages, device=dev)
                plan.init_rows = torch.tensor(init_rows, device=dev)
        else:
            tail_pages, tail_rows = [], []
            for s in batch.seqs:
                pos = s.num_tokens - 1  # the token this step writes
                load += s.pages[:pos // ps]
                tail_pages.append(s.pages[pos // ps])
                tail_rows.append(self.rows[s.seq_id])
                if (pos + 1) % ps == 0:
                    plan.flush_pages.append(s.pages[pos // ps])
                    plan.flush_rows.append(self.rows[s.seq_id])
            plan.tail_pages = torch.tensor(tail_pages, device=dev)
            plan.tail_rows = torch.tensor(tail_rows, device=dev)
        plan.load_runs = coalesce_runs(load)
        plan.store_runs = coalesce_runs(store)
        return plan

    # --- LayerHooks ---------------------------------------------------------------------------
    def before_layer(self, layer_id: int) -> None:
        if layer_id >= self.first_streamed:
            self.streamer.before_layer(layer_id - self.first_streamed)

    def after_layer(self, layer_id: int) -> None:
        if layer_id >= self.first_streamed:
            self.streamer.after_layer(layer_id - self.first_streamed)
