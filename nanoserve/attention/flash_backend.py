"""flash-attn backend (optional extra `nanoserve[flash]`): paged prefill and decode kernels read
the page table directly. Needs page_size to be a multiple of 256.

Untested: no GPU run of this project's tests has covered it yet, so `auto` never picks it and
selecting it by name logs a warning (attention/__init__.py); tests/test_gpu_engine.py's backend
parametrization is where it should join triton and torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanoserve.attention.backend import AttentionBackend, into
from nanoserve.context import AttentionMetadata, ForwardContext


@dataclass
class FlashPrefillMetadata(AttentionMetadata):
    cu_q: torch.Tensor  # on device, int32 [batch + 1]: query offsets
    cu_k: torch.Tensor  # on device, int32 [batch + 1]: KV offsets (prefix + query)
    max_q: int
    max_k: int


class FlashBackend(AttentionBackend):
    name = "flash"
    supports_graphs = True
    merges_cpu_share = False

    def configure(self, num_kv_heads: int, max_len: int) -> None:
        pass

    def prepare(self, ctx: ForwardContext) -> None:
        if ctx.is_prefill:
            kv_lens = [p + q for p, q in zip(ctx.prefix_lens, ctx.query_lens, strict=True)]
            dev = ctx.slot_mapping.device
            cu_q = torch.tensor([0, *torch.tensor(ctx.query_lens).cumsum(0).tolist()],
                                dtype=torch.int32).to(dev, non_blocking=True)
            cu_k = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()],
                                dtype=torch.int32).to(dev, non_blocking=True)
            ctx.attn_meta = FlashPrefillMetadata(cu_q, cu_k, max(ctx.query_lens), max(kv_lens))

    def build_prefill_plans(self, num_heads, num_kv_heads, head_dim, dtype, device, max_tokens,
                            progress):
        """flash-attn's prefill builds nothing per shape."""

    def prefill(self, q, k, v, layer, ctx: ForwardContext, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        m = ctx.attn_meta
        cu_q, cu_k, max_q, max_k = m.cu_q, m.cu_k, m.max_q, m.max_k
        o = flash_attn_varlen_func(q, layer.k_cache, layer.v_cache, cu_q, cu_k, max_q, max_k,
                                   softmax_scale=layer.scale, causal=True,
                                   block_table=ctx.page_tables)
        return into(out, o)

    def decode(self, q, layer, ctx: ForwardContext, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        o = flash_attn_with_kvcache(q.unsqueeze(1), layer.k_cache, layer.v_cache,
                                    cache_seqlens=ctx.context_lens, block_table=ctx.page_tables,
                                    softmax_scale=layer.scale, causal=True).squeeze(1)
        return into(out, o)
