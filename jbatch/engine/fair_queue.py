"""FairQueue: the waiting queue of the ``fair`` scheduling policy (a virtual token counter).

Each tenant has its own :class:`WaitingQueue` (priority with aging, then arrival — the order of
the ``priority`` policy, within the tenant). Across tenants the next request comes from the
*backlogged* tenant (one with a waiting request) whose best request has the best priority
**band** (its ``priority`` number: lower first), and within a band from the tenant with the
smallest virtual token counter (``tenants.TenantLedger``; ties: the tenant seen first). So
priorities are strict across tenants and fairness holds among tenants of the same band; aging
applies within a tenant only.

A tenant that becomes backlogged (its first waiting request after an idle spell) has its counter
lifted to the smallest counter of the backlogged tenants: idle time earns no burst credit. When
no tenant is backlogged, nobody is being denied service, so the past is forgiven: it is lifted
to the largest counter of all (a tenant that had the machine to itself is not made to wait
later for the service it got while nobody else wanted any).

Two heaps over backlogged tenants — (band, counter) for admission and (counter) for the lift —
keep keys lazily: counters only grow, so an entry's key is a lower bound of its tenant's key.
A charge costs nothing; when the top entry turns out stale it is re-pushed with the current key
(or dropped when its tenant has left the backlog) and the next top is looked at, so the top,
once current, is the true minimum. A new entry is pushed only when a tenant joins the backlog
or its band improves. One admission costs O(log tenants) plus one re-push per tenant charged
since the last look.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import Counter
from collections.abc import Iterator

from jbatch.engine.request import Request
from jbatch.engine.tenants import TenantLedger
from jbatch.engine.waiting_queue import WaitingQueue


class FairQueue:
    def __init__(self, aging_steps: int, ledger: TenantLedger):
        self.aging_steps, self.ledger = aging_steps, ledger
        self._queues: dict[str, WaitingQueue] = {}  # backlogged tenants only
        self._bands: dict[str, Counter] = {}  # tenant -> priority -> waiting requests
        self._order: dict[str, int] = {}  # tie-break: the order tenants were first seen
        self._admit_heap: list[tuple] = []  # (band, counter, order, tenant)
        self._min_heap: list[tuple] = []  # (counter, order, tenant)
        self._len = 0

    # ---- the heaps -----------------------------------------------------------------------------
    def _key(self, tenant: str) -> tuple[int, float]:
        return min(self._bands[tenant]), self.ledger.counter.get(tenant, 0.0)

    def _push(self, tenant: str) -> None:
        band, counter = self._key(tenant)
        order = self._order[tenant]
        heapq.heappush(self._admit_heap, (band, counter, order, tenant))
        heapq.heappush(self._min_heap, (counter, order, tenant))
        if len(self._admit_heap) > 64 + 4 * len(self._queues):
            self._compact()

    def _compact(self) -> None:
        """One current entry per backlogged tenant in each heap."""
        keys = {t: (self._key(t), self._order[t]) for t in self._queues}
        self._admit_heap = [(*key, order, t) for t, (key, order) in keys.items()]
        self._min_heap = [(key[1], order, t) for t, (key, order) in keys.items()]
        heapq.heapify(self._admit_heap)
        heapq.heapify(self._min_heap)

    def _top(self, heap: list[tuple], current) -> tuple | None:
        """The top entry once it is current: stale ones are dropped (tenant no longer
        backlogged) or re-pushed with ``current(tenant)``, their tenant's key now."""
        while heap:
            entry = heap[0]
            tenant = entry[-1]
            if tenant not in self._queues:
                heapq.heappop(heap)
                continue
            fresh = current(tenant)
            if fresh == entry:
                return entry
            heapq.heapreplace(heap, fresh)
        return None

    def _admit_entry(self, tenant: str) -> tuple:
        return (*self._key(tenant), self._order[tenant], tenant)

    def _min_entry(self, tenant: str) -> tuple:
        return self.ledger.counter.get(tenant, 0.0), self._order[tenant], tenant

    def min_counter(self) -> float | None:
        """The smallest counter of the backlogged tenants (None: nobody is backlogged)."""
        top = self._top(self._min_heap, self._min_entry)
        return None if top is None else top[0]

    # ---- the queue (same interface as WaitingQueue) --------------------------------------------
    def push(self, seq: Request) -> None:
        tenant = seq.tenant
        queue = self._queues.get(tenant)
        if queue is None:  # back from idle: no credit for the time away
            floor = self.min_counter()
            self.ledger.lift(tenant, self.ledger.max_counter if floor is None else floor)
            queue = self._queues[tenant] = WaitingQueue(self.aging_steps)
            self._bands[tenant] = Counter()
            self._order.setdefault(tenant, len(self._order))
        bands = self._bands[tenant]
        improves = not bands or seq.priority < min(bands)
        queue.push(seq)
        bands[seq.priority] += 1
        self._len += 1
        self.ledger.count_waiting(tenant, 1)
        if improves:  # a smaller key than its entries hold: they are no lower bound any more
            self._push(tenant)

    def remove(self, seq: Request) -> None:
        tenant = seq.tenant
        queue = self._queues.get(tenant)
        if queue is None or seq not in queue:
            raise ValueError(f"request {seq.request_id!r} is not waiting")
        queue.remove(seq)
        band = self._bands[tenant]
        band[seq.priority] -= 1
        if not band[seq.priority]:
            del band[seq.priority]
        self._len -= 1
        self.ledger.count_waiting(tenant, -1)
        if not queue:  # leaves the backlog; its heap entries are dropped when they surface
            del self._queues[tenant], self._bands[tenant]

    def in_order(self) -> Iterator[Request]:
        """Yield waiting sequences in admission order, re-deciding after each one (an admitted
        sequence's first chunk moves its tenant's counter). The caller may ``remove`` what it
        admits; close the iterator (``contextlib.closing``) when done."""
        tenants: dict[str, Iterator[Request]] = {}
        parked = []  # entries of tenants with nothing more to offer in this pass
        with contextlib.ExitStack() as stack:
            try:
                while (entry := self._top(self._admit_heap, self._admit_entry)) is not None:
                    tenant = entry[-1]
                    it = tenants.get(tenant)
                    if it is None:
                        it = tenants[tenant] = self._queues[tenant].in_order()
                        stack.enter_context(contextlib.closing(it))
                    seq = next(it, None)
                    if seq is None:
                        parked.append(heapq.heappop(self._admit_heap))
                        continue
                    yield seq
            finally:
                for entry in parked:
                    if entry[-1] in self._queues:
                        heapq.heappush(self._admit_heap, entry)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return bool(self._len)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting sequence, tenant by tenant (bookkeeping, not per step)."""
        return iter([seq for queue in self._queues.values() for seq in queue])

    def __contains__(self, seq: Request) -> bool:
        queue = self._queues.get(seq.tenant)
        return queue is not None and seq in queue
