"""Data parallelism: ``dp`` engine replicas behind one engine interface.

:class:`ReplicaRouter` implements :class:`jbatch.engine.interface.EngineClient` — what the
server's engine thread and :class:`jbatch.LLM` drive when ``dp > 1``: it routes each new request
to the least-loaded replica, steps every replica that has work and sums their ``stats()``.

Routing (JetStream's least-loaded backlog): a request goes to the replica with the smallest
backlog — requests waiting for a slot plus requests holding one — ties broken by fewer waiting,
then round-robin. A request stays on its replica (its KV pages live there) until it finishes.

One host thread drives all replicas. ``LLMEngine.step`` dispatches a replica's device step and
returns while the devices work, so replicas on disjoint device sets run concurrently; the host
work (scheduling, detokenizing) of the replicas is serialised. A replica whose step fails
recovers alone: only its own requests fail (``StepFailed`` carries the other replicas' outputs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from jbatch.engine.interface import EngineStats, StepFailed
from jbatch.engine.llm_engine import LLMEngine
from jbatch.outputs import OutputKind, RequestOutput
from jbatch.sampling_params import SamplingParams


class ReplicaRouter:
    """Route requests over data-parallel engine replicas (see the module docstring)."""

    def __init__(self, engines: Seq[LLMEngine]):
        if not engines:
            raise ValueError("ReplicaRouter needs at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.model_cfg, self.cfg, self.tokenizer = first.model_cfg, first.cfg, first.tokenizer
        self.eos_ids = first.eos_ids
        self.routed = [0] * len(self.engines)  # requests sent to each replica
        self._owner: dict[str, int] = {}  # request id -> replica, until forgotten
        self._ids = itertools.count()
        self._rr = itertools.count()

    def stats(self) -> EngineStats:
        """All replicas' snapshots, summed."""
        return EngineStats.total([e.stats() for e in self.engines])

    def backlog(self, i: int) -> int:
        """Requests replica ``i`` holds or queues (waiting for a slot + running)."""
        stats = self.engines[i].stats()
        return stats.waiting + stats.running

    def pick_replica(self) -> int:
        """The least-loaded replica: smallest backlog, then fewest waiting, then round-robin."""
        n, turn = len(self.engines), next(self._rr)
        order = [(turn + k) % n for k in range(n)]
        load = [(s.waiting + s.running, s.waiting) for s in (e.stats() for e in self.engines)]
        return min(order, key=load.__getitem__)

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        tenant: str | None = None,
    ) -> str:
        request_id = f"r{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        i = self.pick_replica()
        rid = self.engines[i].add_request(
            prompt, params, request_id, priority, arrival_time, output_kind, tenant
        )
        self._owner[rid] = i
        self.routed[i] += 1
        return rid

    def replica_of(self, request_id: str) -> int | None:
        """Index of the replica holding ``request_id`` (None once it is forgotten)."""
        return self._owner.get(request_id)

    def abort_request(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.engines[i].abort_request(request_id)

    def forget(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None and self.engines[i].forget(request_id):
            del self._owner[request_id]

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work (each dispatches before the next reads). A
        replica that fails has recovered alone; the call then raises ``StepFailed`` with its
        failed requests and every other replica's outputs."""
        outputs: list[RequestOutput] = []
        failures: list[StepFailed] = []
        for engine in self.engines:
            if engine.has_unfinished_requests():
                try:
                    outputs += engine.step()
                except StepFailed as e:
                    failures.append(e)
                    outputs += e.outputs
        if failures:
            failed = [rid for e in failures for rid in e.failed]
            raise StepFailed(failed, outputs, failures[0].cause) from failures[0]
        return outputs

    def reset(self, requeue_waiting: bool = True) -> list[str]:
        dropped = [rid for e in self.engines for rid in e.reset(requeue_waiting)]
        for rid in dropped:
            self._owner.pop(rid, None)
        return dropped

    def set_policies(self, **policies) -> None:
        for engine in self.engines:
            engine.set_policies(**policies)
        self.cfg = self.engines[0].cfg
