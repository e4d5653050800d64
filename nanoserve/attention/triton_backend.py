"""Default CUDA backend: prefill through cuDNN (FA2 varlen for batches of short prompts; see
attention/prefill.py), decode through the Triton split-KV kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention.backend import AttentionBackend
from nanoserve.attention.prefill import paged_prefill, use_varlen, varlen_prefill
from nanoserve.attention.triton_decode import num_splits_for, paged_decode_attention
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

    def prefill(self, q, k, v, layer, ctx: ForwardContext) -> torch.Tensor:
        m = ctx.attn_meta
        if isinstance(m, VarlenPrefillMetadata) and q.dtype in (torch.bfloat16, torch.float16):
            return varlen_prefill(q, k, v, m.cu_seqlens, m.max_len, layer.scale)
        return paged_prefill(q, k, v, layer, ctx)

    def decode(self, q, layer, ctx: ForwardContext) -> torch.Tensor:
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, ctx.page_tables,
                                      ctx.context_lens, layer.scale, ctx.attn_meta.num_splits,
                                      k_scale=layer.k_scale, v_scale=layer.v_scale)
