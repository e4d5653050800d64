"""The KV manager: the one owner of the KV cache.

It owns the spec, every tier's storage (the resident pool; with offload the pinned host store,
the GPU ring slots and the tails, through offload/), the pages of each sequence (reference
counted), each decoding sequence's tail row, capacity, and which tensors each attention layer
reads. The scheduler asks it for pages; the model runner asks it for storage.

All tiers share one page-id space: page p of a resident layer is in the resident pool at p, of
a streamed layer in the host store at p, and each ring slot mirrors the whole page range, so one
page table serves every layer and every kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.errors import InvalidParameter
from nanoserve.kv.pages import PageAllocator, pages_needed
from nanoserve.kv.prefix_cache import PrefixCache, chain_hashes
from nanoserve.kv.spec import KVSpec
from nanoserve.text import format_bytes, plural
from offload import HostKVStore, LayerStreamer, ResidencyPlan, plan_residency

GiB = 1 << 30


def default_host_budget_gib() -> float:
    """Half of the RAM available now (Linux), else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        return kib * 1024 / GiB / 2
    except (OSError, StopIteration):
        return 8.0


@dataclass(frozen=True)
class KVBudget:
    gpu_bytes: int
    host_bytes: int  # 0 without offload
    offload: bool
    max_seqs: int
    max_pages_per_seq: int
    num_slots: int  # ring slots for streamed layers
    resident_layers: int | None = None  # force the split


def plan_kv(spec: KVSpec, budget: KVBudget) -> ResidencyPlan:
    """How many pages, and which layers stay resident, within the budgets."""
    layers, layer_page = spec.num_layers, spec.page_bytes(1)
    # more pages than every sequence at full length can use are never needed
    wanted = budget.max_seqs * budget.max_pages_per_seq + 1
    if not budget.offload:
        pages = min(wanted, budget.gpu_bytes // spec.page_bytes())
        if pages < 2:  # page 0 is the dummy page: one usable page at the very least
            raise ValueError(
                f"GPU KV budget {budget.gpu_bytes / GiB:.4g} GiB holds no KV page: one page of "
                f"{spec.page_size} tokens takes {spec.page_bytes():,} bytes and at least 2 are "
                f"needed ({2 * spec.page_bytes() / GiB:.4g} GiB); raise the budget, lower "
                f"--page-size, or use --enable-offload")
        return ResidencyPlan(layers, layers, pages, layer_page)
    tail_bytes = (budget.max_seqs + 1) * layer_page
    return plan_residency(layers, layer_page, wanted, budget.gpu_bytes, budget.host_bytes,
                          budget.num_slots, tail_bytes, budget.resident_layers)


def bind_kv(attention_layers, spec: KVSpec, layer_kvs, first: int = 0) -> None:
    """Layers first, first+1, ... read their KV (values and, for FP8, scales) from
    layer_kvs[0], layer_kvs[1], ... (each [2, pages, row], the spec's layout)."""
    for i, layer_kv in enumerate(layer_kvs):
        attn = attention_layers[first + i]
        attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale = spec.views(layer_kv)


class KVManager:
    def __init__(self, spec: KVSpec, budget: KVBudget, device: torch.device,
                 prefix_caching: bool = False) -> None:
        self.spec, self.budget, self.device = spec, budget, device
        self.plan = plan_kv(spec, budget)
        self.cache = PrefixCache() if prefix_caching else None
        self.pages = PageAllocator(self.plan.num_pages, cache=self.cache)
        self.resident = spec.empty(self.plan.resident_layers, self.plan.num_pages, device)
        self.streamer: LayerStreamer | None = None
        if self.plan.offloading:
            host = HostKVStore(spec.shape(self.plan.streamed_layers, self.plan.num_pages),
                               spec.layout.storage_dtype, pin=device.type == "cuda")
            self.streamer = LayerStreamer(host, budget.num_slots, budget.max_seqs, device)
        self._free_tail_rows = list(range(budget.max_seqs))
        self._tail_rows: dict[int, int] = {}  # seq_id -> tail row (streamed layers)

    # --- capacity ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.pages.capacity

    @property
    def num_free(self) -> int:
        return self.pages.num_free

    @property
    def num_used(self) -> int:
        return self.pages.capacity - self.pages.num_free

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Refuses a prompt that could never run, however empty the cache."""
        need = pages_needed(num_prompt_tokens + 1, self.spec.page_size)
        if need > self.capacity:
            raise InvalidParameter(
                "prompt", f"prompt of {num_prompt_tokens} tokens needs {need} KV pages of "
                f"{self.spec.page_size} tokens; {self.describe_budgets()} holds "
                f"{self.capacity}", "kv_capacity_exceeded")

    def describe_budgets(self) -> str:
        """The budgets that bound the pages, as a user sets them."""
        if not self.budget.offload:
            return f"the GPU KV budget ({self.budget.gpu_bytes / GiB:.4g} GiB)"
        return (f"the GPU KV budget ({self.budget.gpu_bytes / GiB:.4g} GiB) with the host KV "
                f"budget ({self.budget.host_bytes / GiB:.4g} GiB, --host-kv-budget)")

    def shortfall(self, max_model_len: int) -> str | None:
        """Why one sequence of max_model_len tokens cannot fit, or None."""
        held = self.capacity * self.spec.page_size - 1  # a prompt's next token takes a slot
        if held >= max_model_len:
            return None
        fix = ("raise --host-kv-budget or --gpu-memory-utilization" if self.budget.offload
               else "raise --gpu-memory-utilization, or --enable-offload to keep KV in host "
               "memory")
        return (f"the KV cache holds {plural(held, 'token')}, fewer than max_model_len "
                f"({max_model_len}): {self.describe_budgets()} bound it; longer prompts will "
                f"be refused ({fix})")

    # --- sequences -----------------------------------------------------------------------------
    def room(self, seq) -> int:
        """Tokens `seq` could hold: its pages and every free page."""
        return (len(seq.pages) + self.num_free) * self.spec.page_size

    def grow(self, seq, num_tokens: int) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens; False (nothing allocated) when
        there are not enough free pages."""
        need = pages_needed(num_tokens, self.spec.page_size) - len(seq.pages)
        if need > self.num_free:
            return False
        if need > 0:
            seq.pages = seq.pages + self.pages.allocate(need)
        return True

    def free(self, seq) -> None:
        """Drops `seq`'s pages (cached ones stay reusable until evicted) and its tail row.
        Last page first: a cached prefix is evicted from its end, so what remains of it stays
        reachable (a lookup stops at the first missing page)."""
        self.pages.free(seq.pages[::-1])
        seq.pages = []
        seq.num_pages_cached = 0
        row = self._tail_rows.pop(seq.seq_id, None)
        if row is not None:
            self._free_tail_rows.append(row)

    # --- prefix caching -------------------------------------------------------------------------
    def page_keys(self, seq, num_pages: int) -> list[bytes]:
        """Cache keys of `seq`'s first `num_pages` full pages (computed once, then kept)."""
        keys, ps = seq.page_keys, self.spec.page_size
        if len(keys) < num_pages:
            keys += chain_hashes(seq.token_ids[:num_pages * ps], ps, len(keys),
                                 keys[-1] if keys else b"")
        return keys[:num_pages]

    def reuse_prefix(self, seq) -> None:
        """Before a sequence computes anything itself, it takes the longest run of cached pages
        its tokens start with (all but the last: a step computes at least one token, for its
        logits), extending what it took when it last waited."""
        if self.cache is None:
            return
        ps = self.spec.page_size
        have = len(seq.pages)
        keys = self.page_keys(seq, (seq.num_tokens - 1) // ps)
        more = self.cache.lookup(keys[have:])  # keys chain: each one names its whole prefix
        self.pages.share(more)
        seq.pages = seq.pages + more
        seq.num_pages_cached = len(seq.pages)
        seq.num_cached = len(seq.pages) * ps

    def count_reuse(self, seq) -> None:
        """`seq` is admitted: what it reused is what its request reports."""
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_cached
            if self.cache is not None:
                self.cache.queried_tokens += seq.num_prompt_tokens
                self.cache.hit_tokens += seq.num_cached

    def next_page_key(self, seq) -> bytes | None:
        """The key of the page `seq` computes next, if its prompt fills that page."""
        if self.cache is None:
            return None
        i = seq.num_cached // self.spec.page_size
        if (i + 1) * self.spec.page_size > seq.num_tokens - 1:
            return None
        return self.page_keys(seq, i + 1)[i]

    def cache_full_pages(self, seq) -> None:
        """Caches the pages `seq` has filled with computed KV since it was last asked."""
        if self.cache is None:
            return
        full = seq.num_cached // self.spec.page_size
        for i, key in enumerate(self.page_keys(seq, full)[seq.num_pages_cached:full],
                                seq.num_pages_cached):
            self.cache.add(key, seq.pages[i])
        seq.num_pages_cached = max(seq.num_pages_cached, full)

    @property
    def tail_rows_in_use(self) -> int:
        return len(self._tail_rows)

    def tail_row(self, seq) -> int:
        """The row of the GPU tails that holds `seq`'s last, partly filled page while it
        decodes with streamed layers; assigned on first use."""
        row = self._tail_rows.get(seq.seq_id)
        if row is None:
            row = self._tail_rows[seq.seq_id] = self._free_tail_rows.pop()
        return row

    # --- storage -------------------------------------------------------------------------------
    def bind(self, attention_layers) -> None:
        """Resident layers read the resident pool; streamed layers their ring slot, for good
        (fixed addresses, so per-layer graphs stay valid)."""
        bind_kv(attention_layers, self.spec, self.resident)
        if self.streamer is not None:
            slots = [self.streamer.slot(j) for j in range(self.plan.streamed_layers)]
            bind_kv(attention_layers, self.spec, slots, self.plan.resident_layers)
            for j in range(self.plan.streamed_layers):
                attention_layers[self.plan.resident_layers + j].host_layer = j

    def used_bytes(self) -> dict[str, int]:
        """KV bytes in use, by tier (one page id holds a token range of every layer); the
        device tier is the resident pool, on whatever device the engine runs."""
        page = self.spec.page_bytes(1) * self.num_used
        return {"device": page * self.plan.resident_layers,
                "host": page * self.plan.streamed_layers}

    def describe(self) -> str:
        tokens = self.capacity * self.spec.page_size
        text = (f"KV cache ({self.spec.describe()}): {plural(self.capacity, 'page')} of "
                f"{plural(self.spec.page_size, 'token')} = {plural(tokens, 'token')}; "
                f"{self.describe_split()}")
        if self.streamer is not None:
            s = self.streamer
            pool = self.resident.numel() * self.resident.element_size()
            text += (f"\n  host store {format_bytes(s.host.nbytes)} "
                     f"{'pinned ' if self.device.type == 'cuda' else ''}"
                     f"(budget {self.budget.host_bytes / GiB:.1f} GiB); on the device "
                     f"({self.budget.gpu_bytes / GiB:.4g} GiB budget): ring of "
                     f"{plural(s.num_slots, 'slot')} + tails {format_bytes(s.gpu_bytes)}, "
                     f"resident pool {format_bytes(pool)}")
        return text

    def describe_split(self) -> str:
        """Which layers stay on the device and what a decode step streams at full capacity."""
        plan = self.plan
        if not plan.offloading:
            return (f"all {plural(plan.num_layers, 'layer')} resident: KV fits the device, "
                    f"nothing streams")
        full = self.capacity
        return (f"{plan.resident_layers} of {plural(plan.num_layers, 'layer')} resident, "
                f"{plan.streamed_layers} streamed, {format_bytes(plan.streamed_bytes(full))} "
                f"per decode step at full capacity ({plural(full, 'page')})")
