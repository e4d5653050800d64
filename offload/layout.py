"""The one KV layout of every tier (resident pool, host store, ring slots, tails):
[layer, 2 (K, V), page, page row].

A page row holds one page of one layer's K (or V): its values, [page_size, kv_heads, head_dim],
and for a scaled (quantized) dtype one float32 scale per token and kv head, [page_size,
kv_heads], right after them. Scales live in the row of the values they scale, so a run of
consecutive page ids moves values and scales in one copy per K and V, and every tier, copy and
tail swap handles a scaled cache exactly like an unscaled one. Attention reads a layer's
values [page, page_size, kv_heads, head_dim] and scales [page, page_size, kv_heads] as views
through their strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32
ROW_ALIGN = 16  # bytes: page rows and the scales in them start 16-byte aligned (vector loads)


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class PageLayout:
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the values
    scaled: bool = False  # a float32 scale per token and kv head follows the values

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element type of the tensors that hold the rows: raw bytes when values and scales
        share a row."""
        return torch.uint8 if self.scaled else self.dtype

    @property
    def values_bytes(self) -> int:
        return self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def scales_bytes(self) -> int:
        return self.page_size * self.num_kv_heads * SCALE_DTYPE.itemsize if self.scaled else 0

    @property
    def row_bytes(self) -> int:
        """One page of one layer's K (or V), scales included."""
        if not self.scaled:
            return self.values_bytes
        return _align(_align(self.values_bytes) + self.scales_bytes)

    def shape(self, num_layers: int, num_pages: int) -> tuple[int, ...]:
        return (num_layers, 2, num_pages, self.row_bytes // self.storage_dtype.itemsize)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., page, row] -> the values [..., page, page_size, kv_heads, head_dim]."""
        if self.scaled:
            rows = rows[..., :self.values_bytes].view(self.dtype)
        return rows.unflatten(-1, (self.page_size, self.num_kv_heads, self.head_dim))

    @property
    def scales_start(self) -> int:
        """Byte offset of the scales in a row (0 when unscaled)."""
        return _align(self.values_bytes) if self.scaled else 0

    def scales(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [..., page, row] -> the scales [..., page, page_size, kv_heads]; None when
        unscaled."""
        if not self.scaled:
            return None
        start = self.scales_start
        return rows[..., start:start + self.scales_bytes].view(SCALE_DTYPE) \
            .unflatten(-1, (self.page_size, self.num_kv_heads))
