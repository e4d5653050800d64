"""What a token's KV is: the one place for the KV dtype (and its scales), page size, heads and
the byte arithmetic. The engine, the bench and the tests all count bytes through it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kv.fp8_format import FP8
from offload import PageLayout


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the stored values; FP8 (e4m3) carries a scale per token and kv head

    @classmethod
    def for_model(cls, model_config, page_size: int, dtype: torch.dtype) -> KVSpec:
        return cls(model_config.num_layers, page_size, model_config.num_kv_heads,
                   model_config.head_dim, dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.page_size, self.num_kv_heads, self.head_dim, self.dtype,
                          scaled=self.quantized)

    @property
    def layer_token_bytes(self) -> int:
        """K and V of one token in one layer, scales included."""
        return 2 * self.layout.row_bytes // self.page_size

    def token_bytes(self, num_layers: int | None = None) -> int:
        return self.layer_token_bytes * (self.num_layers if num_layers is None else num_layers)

    def page_bytes(self, num_layers: int | None = None) -> int:
        """One page (page_size tokens) of `num_layers` layers (default: all), scales included."""
        return 2 * self.layout.row_bytes * (self.num_layers if num_layers is None else num_layers)

    def shape(self, num_layers: int, num_pages: int) -> tuple[int, ...]:
        return self.layout.shape(num_layers, num_pages)

    def empty(self, num_layers: int, num_pages: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.shape(num_layers, num_pages), dtype=self.layout.storage_dtype,
                           device=device)

    def views(self, layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None, torch.Tensor | None]:
        """One layer's storage [2, page, row] -> K and V values [page, page_size, kv_heads,
        head_dim] and their scales [page, page_size, kv_heads] (None unless quantized)."""
        k, v = self.layout.values(layer_kv)
        scales = self.layout.scales(layer_kv)
        k_scale, v_scale = (None, None) if scales is None else scales
        return k, v, k_scale, v_scale

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if self.quantized:
            name = "fp8 e4m3 with a float32 scale per token and kv head"
        return f"{name}, {self.token_bytes():,} bytes per token"
