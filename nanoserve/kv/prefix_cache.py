"""Prefix caching: full pages of computed KV, keyed by their tokens and every token before them.

A page's key is a hash chain: sha256(previous page's key + this page's token ids), so equal keys
mean equal prefixes (a cryptographic hash: a client cannot make two prompts collide). A new
request reuses the longest run of cached pages its prompt starts with. Only full pages are
cached, so a page shared by several sequences is never written again. A cached page that no
sequence holds stays in memory until its pages are needed, least recently used first (the
allocator's job). One page id holds a token range of every layer, on every tier, so a cached
page of streamed layers is reused straight from the host store.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chain_hashes(token_ids: list[int], page_size: int, start_page: int = 0,
                 parent: bytes = b"") -> list[bytes]:
    """Keys of the full pages start_page, start_page + 1, ... of `token_ids`; `parent` is the
    key of page start_page - 1."""
    keys = []
    for p in range(start_page, len(token_ids) // page_size):
        page = np.asarray(token_ids[p * page_size:(p + 1) * page_size], dtype=np.int64)
        parent = hashlib.sha256(parent + page.tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of which served from the cache

    def __contains__(self, page: int) -> bool:
        return page in self._key_of

    def __len__(self) -> int:
        return len(self._key_of)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `keys`."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def add(self, key: bytes, page: int) -> None:
        """Caches `page` under `key`, unless the key or the page is cached already."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

    def forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
