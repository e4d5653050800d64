"""The paged KV cache: one pool of pages per layer, and the allocator that hands pages out."""

from __future__ import annotations

from collections import deque

import torch

DUMMY_PAGE = 0  # never allocated: padded rows of a captured decode graph write their KV here


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """A free list of page ids. Invariant: every page is either free or owned by one request."""

    def __init__(self, num_pages: int, reserved: int = 1) -> None:
        if num_pages <= reserved:
            raise ValueError(f"need more than {reserved} KV pages, got {num_pages}")
        self.num_pages = num_pages
        self.reserved = reserved
        self._free: deque[int] = deque(range(reserved, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - self.reserved

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


class KVCache:
    """K and V of every layer: [num_layers, 2, num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.data = torch.zeros(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    def k(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize
