"""What a token's KV is: the one place for the KV dtype, page size, heads and the byte
arithmetic. The engine, the bench and the tests all count bytes through it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload import kv_shape


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # room for a quantized dtype and its scales (FP8 KV) is here

    @classmethod
    def for_model(cls, model_config, page_size: int, dtype: torch.dtype) -> KVSpec:
        return cls(model_config.num_layers, page_size, model_config.num_kv_heads,
                   model_config.head_dim, dtype)

    @property
    def layer_token_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def token_bytes(self, num_layers: int | None = None) -> int:
        return self.layer_token_bytes * (self.num_layers if num_layers is None else num_layers)

    def page_bytes(self, num_layers: int | None = None) -> int:
        """One page (page_size tokens) of `num_layers` layers (default: all)."""
        return self.page_size * self.token_bytes(num_layers)

    def shape(self, num_layers: int, num_pages: int) -> tuple[int, ...]:
        return kv_shape(num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def empty(self, num_layers: int, num_pages: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.shape(num_layers, num_pages), dtype=self.dtype, device=device)
