"""Turns a scheduled batch into tensors, runs the model (eager or a decode graph), samples."""

from __future__ import annotations

import torch

from nanoserve.attention.backend import select_backend
from nanoserve.config import EngineConfig
from nanoserve.context import ForwardContext, forward_context
from nanoserve.engine.graph_runner import DecodeGraphRunner, OffloadDecodeGraphRunner
from nanoserve.engine.offload_hooks import OffloadHooks
from nanoserve.engine.sampler import build_sampling_tensors, sample
from nanoserve.engine.scheduler import Batch
from nanoserve.engine.token_stats import TokenStats
from nanoserve.kv.pages import DUMMY_PAGE, KVCache, bytes_per_page, pages_needed
from nanoserve.models.decoder import CausalLM
from offload import ResidencyPlan, plan_residency

GiB = 1 << 30


def default_host_budget_gib() -> float:
    """Half of the RAM available now (Linux), else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        return kib * 1024 / GiB / 2
    except (OSError, StopIteration):
        return 8.0


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model: CausalLM, max_model_len: int,
                 progress: bool = True) -> None:
        self.cfg, self.model = cfg, model
        self.mcfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.page_size = cfg.page_size
        self.max_model_len = max_model_len
        self.max_pages_per_seq = pages_needed(max_model_len, cfg.page_size)
        self.backend = select_backend(cfg.attention_backend, self.device)
        self.backend.configure(self.mcfg.num_kv_heads, max_model_len)
        for attn in model.attention_layers:
            attn.backend = self.backend
        self.pin = self.device.type == "cuda"
        self.token_stats = TokenStats(self.mcfg.vocab_size, cfg.max_num_seqs, self.device)

        self.page_bytes = bytes_per_page(self.mcfg.num_layers, cfg.page_size,
                                         self.mcfg.num_kv_heads, self.mcfg.head_dim, self.dtype)
        self.gpu_budget_bytes = self._gpu_budget_bytes()
        self.host_budget_bytes = 0
        self.plan = self._plan()
        self.num_pages = self.plan.num_pages
        self.kv = KVCache(self.plan.resident_layers, self.num_pages, cfg.page_size,
                          self.mcfg.num_kv_heads, self.mcfg.head_dim, self.dtype, self.device)
        self.offload: OffloadHooks | None = None
        if self.plan.offloading:
            self.offload = OffloadHooks.build(self.plan, self.mcfg, cfg.page_size,
                                              cfg.max_num_seqs, cfg.num_kv_buffers, self.dtype,
                                              self.device)
            self.offload.bind(model.attention_layers)
        self.bind_resident_kv()
        self.graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and not cfg.enforce_eager and self.backend.supports_graphs:
            max_bs = min(cfg.max_graph_batch_size, cfg.max_num_seqs)
            args = (self.backend, max_bs, self.max_pages_per_seq, cfg.page_size, self.device,
                    progress)
            if self.offload is None:
                self.graphs = DecodeGraphRunner(model, *args)
            else:
                self.graphs = OffloadDecodeGraphRunner(model, self.backend, self.offload,
                                                       *args[1:])

    def release(self, seq_id: int) -> None:
        """A sequence finished: drop its per-sequence sampling state."""
        self.token_stats.release(seq_id)

    def bind_resident_kv(self) -> None:
        for i, attn in enumerate(self.model.attention_layers[:self.kv.data.shape[0]]):
            attn.k_cache, attn.v_cache = self.kv.k(i), self.kv.v(i)

    # --- sizing -------------------------------------------------------------------------------
    def _gpu_budget_bytes(self) -> int:
        if self.cfg.gpu_kv_budget_gib is not None:
            return int(self.cfg.gpu_kv_budget_gib * GiB)
        if self.device.type == "cuda":
            return self._profile_free_bytes()
        return GiB  # CPU: enough for tests and the embedded model

    def _plan(self) -> ResidencyPlan:
        layers = self.mcfg.num_layers
        layer_page_bytes = self.page_bytes // layers
        # more pages than every sequence at full length can use are never needed
        wanted = self.cfg.max_num_seqs * self.max_pages_per_seq + 1
        if not self.cfg.enable_offload:
            pages = min(wanted, self.gpu_budget_bytes // self.page_bytes)
            if pages < 2:  # page 0 is the dummy page: one usable page at the very least
                raise ValueError(
                    f"GPU KV budget {self.gpu_budget_bytes / 2**30:.4g} GiB holds no KV page: "
                    f"one page of {self.page_size} tokens takes {self.page_bytes:,} bytes and "
                    f"at least 2 are needed ({2 * self.page_bytes / 2**30:.4g} GiB); raise the "
                    f"budget, lower --page-size, or use --enable-offload")
            return ResidencyPlan(layers, layers, pages, layer_page_bytes)
        self.host_budget_bytes = int((self.cfg.host_kv_budget_gib or default_host_budget_gib())
                                     * GiB)
        tail_bytes = (self.cfg.max_num_seqs + 1) * layer_page_bytes
        return plan_residency(layers, layer_page_bytes, wanted, self.gpu_budget_bytes,
                              self.host_budget_bytes, self.cfg.num_kv_buffers, tail_bytes,
                              self.cfg.resident_layers)

    def _profile_free_bytes(self) -> int:
        """KV bytes left after the model and a prefill of the largest chunk (its activations)."""
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        self.kv = KVCache(self.mcfg.num_layers, pages_needed(n, self.page_size) + 1,
                          self.page_size, self.mcfg.num_kv_heads, self.mcfg.head_dim, self.dtype,
                          self.device)
        self.bind_resident_kv()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pages = list(range(1, self.kv.num_pages))
        ctx = self._prefill_context([pages], [0], [n])
        self.backend.prepare(ctx)
        with forward_context(ctx):
            self.model.compute_logits(self.model(ids, torch.arange(n, device=self.device))[-1:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        others = total - free - torch.cuda.memory_reserved()  # other processes, CUDA context
        graph_reserve = GiB // 2 + 4 * self.cfg.max_graph_batch_size * self.mcfg.vocab_size * 4
        return int(total * self.cfg.gpu_memory_utilization - others - peak - graph_reserve)

    # --- inputs -------------------------------------------------------------------------------
    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory() if self.pin else t

    def _page_table(self, page_lists: list[list[int]], width: int) -> torch.Tensor:
        rows = [p + [DUMMY_PAGE] * (width - len(p)) for p in page_lists]
        return self._tensor(rows, torch.int32)

    def _slots(self, pages: list[int], start: int, n: int) -> list[int]:
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, start + n)]

    def _prefill_context(self, page_lists, prefix_lens, query_lens) -> ForwardContext:
        slots = []
        for pages, plen, qlen in zip(page_lists, prefix_lens, query_lens, strict=True):
            slots += self._slots(pages, plen, qlen)
        width = max(len(p) for p in page_lists)
        dev = self.device
        return ForwardContext(
            is_prefill=True,
            slot_mapping=self._tensor(slots).to(dev, non_blocking=True),
            page_tables=self._page_table(page_lists, width).to(dev, non_blocking=True),
            query_lens=list(query_lens), prefix_lens=list(prefix_lens))

    # --- steps --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int | None]:
        """Sampled token per sequence; None for a prompt chunk that does not end its prompt."""
        ends = [not batch.is_prefill or s.num_cached + n == s.num_tokens
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        logits = self._run_prefill(batch) if batch.is_prefill else self._run_decode(batch)
        seqs = [s for s, e in zip(batch.seqs, ends, strict=True) if e]
        if not seqs:
            return [None] * len(ends)
        # logits come from the model's dtype: a half-precision model's are exact in it
        key_dtype = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else None
        out = sample(logits, build_sampling_tensors(seqs, self.mcfg.vocab_size, self.device,
                                                    self.pin, self.token_stats), key_dtype)
        tokens = iter(out.token_ids)
        logprobs = iter(out.logprobs or [None] * len(seqs))
        batch.logprobs = [next(logprobs) if e else None for e in ends]
        return [next(tokens) if e else None for e in ends]

    def _run_prefill(self, batch: Batch) -> torch.Tensor:
        """Logits of the last token of each sequence whose prompt ends in this step."""
        ids, pos, last_rows = [], [], []
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            ids += s.token_ids[s.num_cached:s.num_cached + n]
            pos += range(s.num_cached, s.num_cached + n)
            if s.num_cached + n == s.num_tokens:
                last_rows.append(len(ids) - 1)
        ctx = self._prefill_context([s.pages for s in batch.seqs],
                                    [s.num_cached for s in batch.seqs], batch.num_new_tokens)
        dev = self.device
        self.backend.prepare(ctx)
        with forward_context(ctx):
            hidden = self._forward(batch, self._tensor(ids).to(dev, non_blocking=True),
                                   self._tensor(pos).to(dev, non_blocking=True))
        rows = self._tensor(last_rows).to(dev, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _decode_inputs(self, batch: Batch, padded: int):
        seqs = batch.seqs
        pad = padded - len(seqs)
        ids = [s.token_ids[-1] for s in seqs] + [0] * pad
        pos = [s.num_tokens - 1 for s in seqs] + [0] * pad
        slots = [self._slots(s.pages, s.num_tokens - 1, 1)[0] for s in seqs]
        slots += [DUMMY_PAGE * self.page_size] * pad
        lens = [s.num_tokens for s in seqs] + [1] * pad
        width = max(len(s.pages) for s in seqs)
        table = self._page_table([s.pages for s in seqs] + [[]] * pad, width)
        return (self._tensor(ids), self._tensor(pos), self._tensor(slots),
                self._tensor(lens, torch.int32), table)

    def _run_decode(self, batch: Batch) -> torch.Tensor:
        n = len(batch.seqs)
        if self.graphs is not None and self.graphs.can_run(n):
            inputs = self._decode_inputs(batch, self.graphs.padded_size(n))
            if self.offload is not None:
                plan = self.offload.step_plan(batch)
                return self.graphs.run_offloaded(inputs, plan)[:n]
            return self.graphs.run(*inputs)[:n]
        ids, pos, slots, lens, table = (t.to(self.device, non_blocking=True)
                                        for t in self._decode_inputs(batch, n))
        ctx = ForwardContext(False, slots, table, context_lens=lens)
        self.backend.prepare(ctx)
        with forward_context(ctx):
            hidden = self._forward(batch, ids, pos)
        return self.model.compute_logits(hidden)

    def _forward(self, batch: Batch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.offload is None:
            return self.model(ids, pos)
        self.offload.begin_step(batch)
        hidden = self.model(ids, pos, hooks=self.offload)
        self.offload.end_step()
        return hidden
