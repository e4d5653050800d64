"""The attention backend interface, and the pieces every backend shares."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from nanoserve.context import ForwardContext, get_context


class AttentionBackend(ABC):
    """Computes attention for one layer over its paged KV source (`layer.k_cache/v_cache`).

    Graph hooks: `prepare_capture` runs while capturing a decode graph of batch size `bs` and
    must leave all per-step state at fixed addresses; `prepare_replay` refreshes that state
    from the step's context before each replay.
    """

    name: str
    supports_graphs: bool = False

    def configure(self, num_kv_heads: int, max_len: int) -> None:
        """Model facts the backend sizes its metadata by; called once by the model runner."""
        return None

    def prepare(self, ctx: ForwardContext) -> None:
        """Backend metadata for an eager step (stored in ctx.attn_meta)."""
        return None

    def prepare_capture(self, ctx: ForwardContext, bs: int) -> None:
        self.prepare(ctx)

    def prepare_replay(self, ctx: ForwardContext, bs: int) -> None:
        """Default: backends whose metadata is only the context's own fixed tensors."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer) -> torch.Tensor:
        """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d]. Writes k, v into the cache first."""
        ctx = get_context()
        store_kv(k, v, layer.k_cache, layer.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.prefill(q, k, v, layer, ctx)
        return self.decode(q, layer, ctx)

    @abstractmethod
    def prefill(self, q, k, v, layer, ctx: ForwardContext) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, q, layer, ctx: ForwardContext) -> torch.Tensor: ...


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    h, d = k_cache.shape[-2:]
    k_cache.view(-1, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, h, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` tokens from the paged cache, as [length, kv_heads, d]."""
    n = (length + cache.shape[1] - 1) // cache.shape[1]
    return cache.index_select(0, pages[:n]).flatten(0, 1)[:length]


def sdpa_prefill(q, k, v, layer, ctx: ForwardContext) -> torch.Tensor:
    """Prefill through torch SDPA, one sequence at a time (prefill is compute-bound: the loop
    costs nothing). A chunk with a cached prefix attends to prefix + itself, causal from the
    bottom-right corner."""
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, plen) in enumerate(zip(ctx.query_lens, ctx.prefix_lens, strict=True)):
        qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)
        if plen == 0:
            ki = k[start:start + qlen].transpose(0, 1).unsqueeze(0)
            vi = v[start:start + qlen].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scale,
                                               enable_gqa=True)
        else:
            pages = ctx.page_tables[i]
            rep = layer.num_heads // layer.num_kv_heads
            ki = gather_kv(layer.k_cache, pages, plen + qlen).transpose(0, 1)
            vi = gather_kv(layer.v_cache, pages, plen + qlen).transpose(0, 1)
            ki = ki.repeat_interleave(rep, dim=0).unsqueeze(0)
            vi = vi.repeat_interleave(rep, dim=0).unsqueeze(0)
            mask = causal_lower_right(qlen, plen + qlen)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scale)
        out[start:start + qlen] = o.squeeze(0).transpose(0, 1)
        start += qlen
    return out


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        else:
            try:
                import flash_attn  # noqa: F401

                name = "flash"
            except ImportError:
                name = "triton"
    if name == "torch":
        from nanoserve.attention.torch_backend import TorchBackend

        return TorchBackend()
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "triton":
        from nanoserve.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flash":
        from nanoserve.attention.flash_backend import FlashBackend

        return FlashBackend()
    raise ValueError(f"unknown attention backend {name!r}")
