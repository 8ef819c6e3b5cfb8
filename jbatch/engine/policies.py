"""Scheduling policies (``EngineConfig.scheduling_policy``): who is admitted, who is evicted.

* ``priority`` (the default): lower ``priority`` first, aging every ``aging_steps``, FCFS within
  a priority; preemption evicts the lowest priority, then the most recently admitted.
* ``fcfs``: arrival order only (priorities ignored); preemption evicts the most recently
  admitted.
* ``fair``: fair share between tenants by virtual token counters (``fair_queue.py``): priority
  bands first, the least-served tenant within a band; preemption evicts the lowest priority,
  then the tenant with the largest counter, then the most recently admitted.
"""

from __future__ import annotations

from jbatch.engine.config import EngineConfig
from jbatch.engine.fair_queue import FairQueue
from jbatch.engine.request import Request
from jbatch.engine.tenants import TenantLedger
from jbatch.engine.waiting_queue import WaitingQueue


def waiting_queue(cfg: EngineConfig, ledger: TenantLedger) -> WaitingQueue | FairQueue:
    if cfg.scheduling_policy == "fair":
        return FairQueue(cfg.aging_steps, ledger)
    by_priority = cfg.scheduling_policy == "priority"
    return WaitingQueue(cfg.aging_steps if by_priority else 0, by_priority, ledger)


class VictimOrder:
    """The preemption order: ``key`` is largest for the first victim. Running sequences are
    scheduled in ascending key order, so the key must not change during a step: the counters it
    reads are a snapshot taken by ``begin_step`` (charges during the step do not move it)."""

    def __init__(self, policy: str, ledger: TenantLedger):
        self.policy, self.ledger = policy, ledger
        self._counters: dict[str, float] = {}

    def begin_step(self, running: list[Request]) -> None:
        if self.policy == "fair":
            counter = self.ledger.counter
            self._counters = {s.tenant: counter.get(s.tenant, 0.0) for s in running}

    def key(self, seq: Request) -> tuple:
        if self.policy == "fcfs":
            return (seq.admitted_at,)
        if self.policy == "fair":
            return seq.priority, self._counters.get(seq.tenant, 0.0), seq.admitted_at
        return seq.priority, seq.admitted_at
