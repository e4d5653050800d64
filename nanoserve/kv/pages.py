"""KV pages: ids into every tier's storage, handed out and reference-counted."""

from __future__ import annotations

from collections import deque

DUMMY_PAGE = 0  # never allocated: padded rows of a captured decode graph write their KV here


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """A free list of page ids with reference counts. Invariant: a page is free exactly when its
    count is 0; a page held by several sequences (a shared prefix) has one count per holder."""

    def __init__(self, num_pages: int, reserved: int = 1) -> None:
        if num_pages <= reserved:
            raise ValueError(f"need more than {reserved} KV pages, got {num_pages}")
        self.num_pages = num_pages
        self.reserved = reserved
        self._free: deque[int] = deque(range(reserved, num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - self.reserved

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} is free: it cannot be shared"
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} freed twice"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refs(self, page: int) -> int:
        return self._refs[page]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size
