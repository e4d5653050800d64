"""Pure-torch attention: runs anywhere (the CPU engine in CI), the reference for the others."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.attention.backend import AttentionBackend
from nanoserve.attention.cpu_decode import attend_with_lse
from nanoserve.attention.prefill import gather_kv, merge_partials, paged_prefill
from nanoserve.context import ForwardContext


class TorchBackend(AttentionBackend):
    name = "torch"

    def prefill(self, q, k, v, layer, ctx: ForwardContext, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        return paged_prefill(q, k, v, layer, ctx, out)

    def decode(self, q, layer, ctx: ForwardContext, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        lens = ctx.context_lens.tolist()
        for i, n in enumerate(lens):
            pages = ctx.page_tables[i]
            ki = gather_kv(layer.k_cache, pages, n, layer.k_scale, q.dtype).transpose(0, 1) \
                .unsqueeze(0)
            vi = gather_kv(layer.v_cache, pages, n, layer.v_scale, q.dtype).transpose(0, 1) \
                .unsqueeze(0)
            qi = q[i:i + 1].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=layer.scale, enable_gqa=True)
            out[i] = o[0, :, 0]
        return out

    def decode_partial(self, q, layer, ctx: ForwardContext, starts: torch.Tensor):
        """float32 output and LSE over each row's tokens [start, length)."""
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], -torch.inf, device=q.device)
        for i, (s, n) in enumerate(zip(starts.tolist(), ctx.context_lens.tolist(), strict=True)):
            pages = ctx.page_tables[i]
            k = gather_kv(layer.k_cache, pages, n, layer.k_scale, torch.float32)[s:]
            v = gather_kv(layer.v_cache, pages, n, layer.v_scale, torch.float32)[s:]
            o[i], lse[i] = attend_with_lse(q[i].float(), k, v, layer.scale)
        return o, lse

    def merge_decode(self, partial, o, lse, q):
        return merge_partials(partial[0], partial[1], o, lse).to(q.dtype)
