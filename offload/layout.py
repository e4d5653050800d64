"""The one KV layout of every tier (resident pool, host store, ring slots, tails):
[layer, 2 (K, V), page, page_size, kv_heads, head_dim]. One layer's K pages are contiguous, so a
run of consecutive page ids moves in one copy per K and V; attention reads a layer's
[page, page_size, kv_heads, head_dim] view through its strides."""

from __future__ import annotations


def kv_shape(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
             head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
