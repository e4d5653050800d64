"""The attention backend interface, and the pieces every backend shares."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

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
        """Backend metadata for an eager step (stored in ctx.attn_meta); a mixed step's parts
        are prepared one by one (ForwardContext.prepared_parts)."""
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
        if ctx.parts is not None:
            decode, prefill = ctx.parts
            n = decode.slot_mapping.shape[0]
            return torch.cat([self.decode(q[:n], layer, decode),
                              self.prefill(q[n:], k[n:], v[n:], layer, prefill)])
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
