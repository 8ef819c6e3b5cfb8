"""PageAllocator: KV pool pages with reference counts and a prefix cache (host side, plain Python).

Every page is in exactly one of three places:
* **free** — no content worth keeping;
* **owned** — referenced by one or more running sequences (``refcount > 0``);
* **cached** — unreferenced but holding a full page of known tokens, kept in LRU order and
  reused by a later request with the same prefix, or evicted when fresh pages run out.

A full page is named by a hash chain over its tokens and all tokens before it (``page_hash``), so
equal hashes mean equal KV. Only full pages are ever shared, and sequences only append to pages
of their own, so page tables are append-only: no copy-on-write is needed.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """Not enough free pages; the scheduler waits or preempts."""


def chain_hash(parent: bytes, page_tokens: Sequence[int]) -> bytes:
    """Name of a full page: BLAKE2b (128 bits) over its parent page's name and its tokens."""
    data = parent + array.array("q", page_tokens).tobytes()  # int64 each, native order
    return hashlib.blake2b(data, digest_size=16).digest()


class PageAllocator:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_pages))
        self._refs: dict[int, int] = {}  # owned page -> refcount
        self._cached: OrderedDict[int, None] = OrderedDict()  # evictable pages, LRU first
        self._hash_of: dict[int, bytes] = {}  # page -> hash (owned or cached)
        self._page_of: dict[bytes, int] = {}  # hash -> page
        self.hits = 0  # prefix-cache lookups that found a page
        self.queries = 0  # pages looked up

    @property
    def num_free(self) -> int:
        """Pages available to ``allocate`` (free plus evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh pages, all or nothing (free pages first, then evict LRU cached)."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Take a reference on the longest cached run of pages matching ``hashes``."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        self.queries += len(hashes)
        self.hits += len(pages)
        for page in pages:
            if page in self._cached:
                del self._cached[page]
                self._refs[page] = 1
            else:
                self._refs[page] += 1
        return pages

    def share(self, pages: Sequence[int]) -> list[int]:
        """Take one more reference on each owned page (a sibling's prompt pages, n > 1)."""
        for page in pages:
            if page not in self._refs:
                raise RuntimeError(f"page {page} shared but not owned")
            self._refs[page] += 1
        return list(pages)

    def register(self, page: int, h: bytes) -> None:
        """Record that owned ``page`` holds the full page named ``h`` (first writer wins)."""
        if self.enable_prefix_caching and h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference per page; unreferenced hashed pages stay cached (most recent last)."""
        for page in pages:
            refs = self._refs.get(page)
            if refs is None:
                raise RuntimeError(f"page {page} freed but not owned (double free?)")
            if refs > 1:
                self._refs[page] = refs - 1
                continue
            del self._refs[page]
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def check(self, owners: Sequence[Sequence[int]] = ()) -> None:
        """Invariants: each page is in exactly one place; refcounts equal the number of page
        lists (``owners``) holding the page; the hash maps are mutually consistent."""
        free, cached, owned = set(self._free), set(self._cached), set(self._refs)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not (free & cached or free & owned or cached & owned), "a page is in two places"
        assert len(free) + len(cached) + len(owned) == self.num_pages, "pages lost"
        assert all(r > 0 for r in self._refs.values())
        if owners:
            counts: dict[int, int] = {}
            for pages in owners:
                for p in pages:
                    counts[p] = counts.get(p, 0) + 1
            assert counts == self._refs, "refcounts disagree with the page tables"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash maps disagree"
        assert cached <= set(self._hash_of), "a cached page has no hash"
