"""WaitingQueue: sequences waiting for a slot, served in effective-priority order.

A waiting sequence's effective priority is ``priority - waited / aging_steps`` (lower runs
first; ``aging_steps = 0``: no aging). Every waiting sequence ages at the same rate, so the order
between two of them never changes while they wait, and a heap keyed on the time-invariant
``priority * aging_steps + waiting_since`` (then arrival order: FCFS) serves them in the right
order. Admission looks at the head only, so a step costs O(admitted · log n), not a sort of the
whole queue — a 10 000-request backlog schedules as fast as an empty one.

Removal (abort, admission) is lazy: the heap entry is marked dead and skipped when popped.
``by_priority=False`` (the ``fcfs`` policy) ignores priorities: arrival order only. A ``ledger``
(``tenants.TenantLedger``) is told each tenant's number of waiting requests.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from jbatch.engine.request import Request
from jbatch.engine.tenants import TenantLedger


class WaitingQueue:
    def __init__(
        self, aging_steps: int, by_priority: bool = True, ledger: TenantLedger | None = None
    ):
        self.aging_steps = aging_steps
        self.by_priority, self.ledger = by_priority, ledger
        self._heap: list[list] = []  # [key, arrival_order, seq, alive]
        self._entries: dict[int, list] = {}  # id(seq) -> its live heap entry

    def _key(self, seq: Request) -> int:
        if not self.by_priority:
            return 0
        if self.aging_steps:
            return seq.priority * self.aging_steps + seq.waiting_since
        return seq.priority

    def push(self, seq: Request) -> None:
        if id(seq) in self._entries:
            raise ValueError(f"request {seq.request_id!r} is already waiting")
        entry = [self._key(seq), seq.arrival_order, seq, True]
        self._entries[id(seq)] = entry
        heapq.heappush(self._heap, entry)
        if self.ledger is not None:
            self.ledger.count_waiting(seq.tenant, 1)

    def remove(self, seq: Request) -> None:
        entry = self._entries.pop(id(seq), None)
        if entry is None:
            raise ValueError(f"request {seq.request_id!r} is not waiting")
        entry[3] = False
        if self.ledger is not None:
            self.ledger.count_waiting(seq.tenant, -1)
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._entries):
            self._heap = [e for e in self._heap if e[3]]  # drop dead entries
            heapq.heapify(self._heap)

    def in_order(self) -> Iterator[Request]:
        """Yield waiting sequences best first; the caller may ``remove`` what it admits. Close
        the iterator (``contextlib.closing``) when done: skipped sequences go back then."""
        popped = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if entry[3]:
                    popped.append(entry)
                    yield entry[2]
        finally:
            for entry in popped:
                if entry[3]:
                    heapq.heappush(self._heap, entry)

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict:
        """Pickled without the ``id``-keyed index (ids change on unpickling: rebuilt)."""
        return {k: v for k, v in vars(self).items() if k != "_entries"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._entries = {id(e[2]): e for e in self._heap if e[3]}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting sequence, best first (a sort: for bookkeeping, not per step)."""
        return iter([e[2] for e in sorted(self._entries.values())])

    def __contains__(self, seq: Request) -> bool:
        return id(seq) in self._entries
