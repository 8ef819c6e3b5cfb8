"""PageAllocator: the free list of KV pool pages (host side, plain Python)."""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Not enough free pages; the scheduler waits or preempts."""


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages, all or nothing."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._owned:
                raise RuntimeError(f"page {p} freed but not owned (double free?)")
            self._owned.remove(p)
            self._free.append(p)

    def check(self) -> None:
        """Invariant: every page is exactly once either free or owned."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & self._owned, f"pages both free and owned: {sorted(free & self._owned)}"
        assert len(free) + len(self._owned) == self.num_pages, "pages lost"
