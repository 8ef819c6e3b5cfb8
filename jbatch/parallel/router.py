"""Data parallelism: ``dp`` engine replicas behind one :class:`LLMEngine`-shaped front.

:class:`ReplicaRouter` is what the server's engine thread and :class:`jbatch.LLM` drive when
``dp > 1``: it has the engine's interface (``add_request``, ``step``, ``abort_request``,
``forget``, ``reset``, ``requests``, ``scheduler`` for the metrics), routes each new request to
the least-loaded replica and steps every replica that has work.

Routing (JetStream's least-loaded backlog): a request goes to the replica with the smallest
backlog — requests waiting for a slot plus requests holding one — ties broken by fewer waiting,
then round-robin. A request stays on its replica (its KV pages live there) until it finishes.

One host thread drives all replicas. ``LLMEngine.step`` dispatches a replica's device step and
returns while the devices work, so replicas on disjoint device sets run concurrently; the host
work (scheduling, detokenizing) of the replicas is serialised.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator, MutableMapping
from collections.abc import Sequence as Seq

from jbatch.engine.llm_engine import LLMEngine
from jbatch.engine.request import Request
from jbatch.outputs import RequestOutput
from jbatch.sampling_params import SamplingParams


class _Requests(MutableMapping):
    """``requests`` of all replicas as one mapping (deleting removes from the owner)."""

    def __init__(self, engines: list[LLMEngine]):
        self._engines = engines

    def _owner(self, rid: str) -> LLMEngine:
        for engine in self._engines:
            if rid in engine.requests:
                return engine
        raise KeyError(rid)

    def __getitem__(self, rid: str) -> Request:
        return self._owner(rid).requests[rid]

    def __setitem__(self, rid: str, seq: Request) -> None:
        raise TypeError("requests are added with add_request")

    def __delitem__(self, rid: str) -> None:
        del self._owner(rid).requests[rid]

    def __iter__(self) -> Iterator[str]:
        return itertools.chain.from_iterable(list(e.requests) for e in self._engines)

    def __len__(self) -> int:
        return sum(len(e.requests) for e in self._engines)


class _Allocators:
    """Page-pool gauges summed over replicas."""

    def __init__(self, engines: list[LLMEngine]):
        self._engines = engines

    def _sum(self, name: str) -> int:
        return sum(getattr(e.scheduler.allocator, name, 0) for e in self._engines)

    num_used = property(lambda self: self._sum("num_used"))
    num_pages = property(lambda self: self._sum("num_pages"))
    hits = property(lambda self: self._sum("hits"))
    queries = property(lambda self: self._sum("queries"))


class _Schedulers:
    """What the serving metrics read from ``engine.scheduler``, over all replicas."""

    def __init__(self, engines: list[LLMEngine]):
        self._engines = engines
        self.allocator = _Allocators(engines)

    @property
    def running(self) -> list[Request]:
        return [s for e in self._engines for s in e.scheduler.running.values()]

    @property
    def waiting(self) -> list[Request]:
        return [s for e in self._engines for s in e.scheduler.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(e.scheduler.num_preemptions for e in self._engines)


class ReplicaRouter:
    """Route requests over data-parallel engine replicas (see the module docstring)."""

    def __init__(self, engines: Seq[LLMEngine]):
        if not engines:
            raise ValueError("ReplicaRouter needs at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.model_cfg, self.cfg, self.tokenizer = first.model_cfg, first.cfg, first.tokenizer
        self.eos_ids = first.eos_ids
        self.requests = _Requests(self.engines)
        self.scheduler = _Schedulers(self.engines)
        self.routed = [0] * len(self.engines)  # requests sent to each replica
        self._ids = itertools.count()
        self._rr = itertools.count()

    @property
    def total_slots(self) -> int:
        """Slots of all replicas (the serving metrics' utilization denominator)."""
        return sum(e.cfg.max_slots for e in self.engines)

    @property
    def stats(self) -> collections.Counter:
        return sum((e.stats for e in self.engines), collections.Counter())

    def backlog(self, i: int) -> int:
        """Requests replica ``i`` holds or queues (waiting for a slot + running)."""
        sched = self.engines[i].scheduler
        return len(sched.waiting) + len(sched.running)

    def pick_replica(self) -> int:
        """The least-loaded replica: smallest backlog, then fewest waiting, then round-robin."""
        n, turn = len(self.engines), next(self._rr)
        order = [(turn + k) % n for k in range(n)]
        key = lambda i: (self.backlog(i), len(self.engines[i].scheduler.waiting))
        return min(order, key=key)

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        request_id = f"r{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        i = self.pick_replica()
        rid = self.engines[i].add_request(prompt, params, request_id, priority, arrival_time)
        self.routed[i] += 1
        return rid

    def replica_of(self, request_id: str) -> int | None:
        """Index of the replica holding ``request_id`` (None once it is forgotten)."""
        for i, engine in enumerate(self.engines):
            if request_id in engine.requests:
                return i
        return None

    def abort_request(self, request_id: str) -> None:
        i = self.replica_of(request_id)
        if i is not None:
            self.engines[i].abort_request(request_id)

    def forget(self, request_id: str) -> None:
        i = self.replica_of(request_id)
        if i is not None:
            self.engines[i].forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work (each dispatches before the next reads)."""
        outputs: list[RequestOutput] = []
        for engine in self.engines:
            if engine.has_unfinished_requests():
                outputs += engine.step()
        return outputs

    def reset(self, requeue_waiting: bool = True) -> list[str]:
        return [rid for e in self.engines for rid in e.reset(requeue_waiting)]

    def set_policies(self, **policies) -> None:
        for engine in self.engines:
            engine.set_policies(**policies)
        self.cfg = self.engines[0].cfg

    def drain(self) -> None:
        for engine in self.engines:
            engine.drain()

    def forget_finished(self) -> None:
        for engine in self.engines:
            engine.forget_finished()

    def status_counts(self) -> dict[str, int]:
        total = collections.Counter()
        for engine in self.engines:
            total.update(engine.status_counts())
        return total
