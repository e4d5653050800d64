"""Default CUDA backend: q/k norm, rotary embedding and the KV store in one Triton kernel,
prefill through cuDNN (FA2 varlen for batches of short prompts; see attention/prefill.py),
decode through the Triton split-KV kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve import fused
from nanoserve.attention.backend import AttentionBackend, into
from nanoserve.attention.prefill import paged_prefill, use_varlen, varlen_prefill
from nanoserve.attention.triton_decode import (
    decode_partials,
    merge_partials,
    num_splits_for,
    paged_decode_attention,
    warm_decode,
)
from nanoserve.attention.triton_rope_store import rope_and_store
from nanoserve.context import AttentionMetadata, ForwardContext


@dataclass
class TritonDecodeMetadata(AttentionMetadata):
    num_splits: int  # KV splits per (sequence, kv head): a function of the batch size only


@dataclass
class VarlenPrefillMetadata(AttentionMetadata):
    cu_seqlens: torch.Tensor  # on device, int32 [batch + 1]: each prompt's offset in the step
    max_len: int


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_graphs = True

    def __init__(self) -> None:
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.max_len = 1 << 20
        self.num_kv_heads = 8

    def configure(self, num_kv_heads: int, max_len: int) -> None:
        self.num_kv_heads, self.max_len = num_kv_heads, max_len

    def prepare(self, ctx: ForwardContext) -> None:
        if ctx.is_prefill:
            if use_varlen(ctx):
                offsets = torch.tensor([0, *ctx.query_lens], dtype=torch.int32).cumsum(0)
                ctx.attn_meta = VarlenPrefillMetadata(
                    offsets.to(torch.int32).to(ctx.slot_mapping.device, non_blocking=True),
                    max(ctx.query_lens))
        else:
            bs = ctx.context_lens.shape[0]
            ctx.attn_meta = TritonDecodeMetadata(
                num_splits_for(bs, self.num_kv_heads, self.max_len, self.num_sms))

    def rotate_and_store(self, positions, q, k, v, layer, slot_mapping):
        """One kernel (attention/triton_rope_store.py) where the cache holds the model's dtype
        (bf16 or fp16) or FP8 with its scales, unless fusion is off (the unfused path is its
        reference)."""
        fp8 = layer.k_scale is not None
        if not fused.is_enabled() or q.dtype not in (torch.bfloat16, torch.float16) or \
                (layer.k_cache.dtype != q.dtype and not fp8):
            return super().rotate_and_store(positions, q, k, v, layer, slot_mapping)
        norm = layer.qk_norm
        return rope_and_store(
            q, k, v, layer.rotary[0].cos_sin, positions,
            None if norm is None else (norm[0].weight, norm[1].weight, norm[0].eps),
            layer.k_cache, layer.v_cache, slot_mapping, layer.k_scale, layer.v_scale)

    def prefill(self, q, k, v, layer, ctx: ForwardContext, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        m = ctx.attn_meta
        if isinstance(m, VarlenPrefillMetadata) and q.dtype in (torch.bfloat16, torch.float16):
            o = varlen_prefill(q, k, v, m.cu_seqlens, m.max_len, layer.scale)
            return into(out, o)
        return paged_prefill(q, k, v, layer, ctx, out)

    def build_decode_kernels(self, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, device):
        warm_decode(num_heads, num_kv_heads, head_dim, dtype, kv_dtype, device)

    def decode(self, q, layer, ctx: ForwardContext, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, ctx.page_tables,
                                      ctx.context_lens, layer.scale, ctx.attn_meta.num_splits,
                                      out=out, k_scale=layer.k_scale, v_scale=layer.v_scale)

    def decode_partial(self, q, layer, ctx: ForwardContext, starts: torch.Tensor):
        return decode_partials(q, layer.k_cache, layer.v_cache, ctx.page_tables,
                               ctx.context_lens, layer.scale, ctx.attn_meta.num_splits, starts,
                               k_scale=layer.k_scale, v_scale=layer.v_scale)

    def merge_decode(self, partial, o, lse, q):
        return merge_partials(partial, torch.empty_like(q), (o, lse))
