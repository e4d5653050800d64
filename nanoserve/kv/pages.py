"""KV pages: ids into every tier's storage, handed out and reference-counted."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from nanoserve.text import plural

if TYPE_CHECKING:
    from nanoserve.kv.prefix_cache import PrefixCache

DUMMY_PAGE = 0  # never allocated: padded rows of a captured decode graph write their KV here


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """A free list of page ids with reference counts. Invariant: a page is free or evictable
    exactly when its count is 0; a page held by several sequences (a shared prefix) has one
    count per holder. With a prefix cache, a page whose count drops to 0 while it is cached
    becomes evictable instead of free: it keeps its KV for a later request until allocation
    runs out of free pages, least recently used first. A page in use is never evicted."""

    def __init__(self, num_pages: int, reserved: int = 1,
                 cache: PrefixCache | None = None) -> None:
        if num_pages <= reserved:
            raise ValueError(f"need more than {reserved} KV pages, got {num_pages}")
        self.num_pages = num_pages
        self.reserved = reserved
        self.cache = cache
        self._free: deque[int] = deque(range(reserved, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def capacity(self) -> int:
        return self.num_pages - self.reserved

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {plural(n, 'KV page')}, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self.cache.forget(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder of each page (a cached page with no holder is in use again)."""
        for p in pages:
            if self._refs[p] == 0:
                assert p in self._evictable, f"page {p} is free: it cannot be shared"
                del self._evictable[p]
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} freed twice"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self.cache is not None and p in self.cache:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def refs(self, page: int) -> int:
        return self._refs[page]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size
