"""Tenants: who a request belongs to, their weights, and the service each has received.

Every request carries a tenant id (``DEFAULT_TENANT`` when none is given). The scheduler charges
a :class:`TenantLedger` as service happens — prompt tokens when a chunk is *computed* (prefix-cache
hits are free, a recomputed prefill after a preemption is paid again), one output token per
sample — whatever the scheduling policy, so per-tenant figures are always reported. The ``fair``
policy (``fair_queue.py``) also orders admissions by the ledger's virtual token counters:

    counter[t] += (W_IN * prompt_tokens + W_OUT * output_tokens) / weight[t]

(the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024). Weights default to 1; ``EngineConfig.tenant_weights`` (``--tenant-weights FILE``: a JSON
object tenant -> weight) sets others.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping

DEFAULT_TENANT = "default"
MAX_TENANT_LEN = 128
W_IN = 1.0  # cost of one computed prompt token
W_OUT = 2.0  # cost of one generated token (a decode step is costlier per token than prefill)


def check_tenant(tenant: object, field: str = "tenant") -> str:
    """A valid tenant id (None -> ``DEFAULT_TENANT``); ValueError naming ``field`` otherwise.
    Valid: 1..128 printable ASCII characters, no spaces."""
    if tenant is None:
        return DEFAULT_TENANT
    ok = (
        isinstance(tenant, str)
        and 0 < len(tenant) <= MAX_TENANT_LEN
        and all("!" <= ch <= "~" for ch in tenant)
    )
    if not ok:
        raise ValueError(
            f"{field} must be 1..{MAX_TENANT_LEN} printable ASCII characters without spaces, "
            f"got {tenant!r}"
        )
    return tenant


def check_weights(weights: Mapping | Iterable) -> tuple[tuple[str, float], ...]:
    """Tenant weights as a sorted tuple of (tenant, weight > 0) pairs (hashable, for the frozen
    EngineConfig); accepts a mapping or pairs. ValueError naming the bad entry."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    out = {}
    for entry in items:
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            raise ValueError(f"tenant_weights entries must be (tenant, weight), got {entry!r}")
        name, weight = entry
        name = check_tenant(name, "tenant_weights key")
        bad = isinstance(weight, bool) or not isinstance(weight, int | float)
        if bad or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"tenant_weights[{name!r}] must be a number > 0, got {weight!r}")
        out[name] = float(weight)
    return tuple(sorted(out.items()))


def load_tenant_weights(path: str) -> tuple[tuple[str, float], ...]:
    """Read ``--tenant-weights FILE``: a JSON object ``{"tenant": weight, ...}``."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tenant_weights file {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"tenant_weights file {path!r} must hold a JSON object tenant -> weight")
    return check_weights(data)


@dataclasses.dataclass(frozen=True)
class TenantStats:
    """One tenant's figures in :class:`EngineStats` (summed over replicas)."""

    prompt_tokens: int = 0  # prompt tokens computed for it
    output_tokens: int = 0  # tokens generated for it
    waiting: int = 0  # its requests waiting for a slot
    running: int = 0  # its requests holding a slot
    virtual_tokens: float = 0.0  # its virtual token counter (weighted service, plus lifts)

    @property
    def service(self) -> float:
        """Weighted tokens served: ``W_IN * prompt_tokens + W_OUT * output_tokens``."""
        return W_IN * self.prompt_tokens + W_OUT * self.output_tokens

    def __add__(self, other: TenantStats) -> TenantStats:
        return TenantStats(
            self.prompt_tokens + other.prompt_tokens,
            self.output_tokens + other.output_tokens,
            self.waiting + other.waiting,
            self.running + other.running,
            max(self.virtual_tokens, other.virtual_tokens),
        )


class TenantLedger:
    """Per-tenant service and virtual token counters of one scheduler (counters only grow).
    ``_changed``: the tenants whose figures moved since the last :meth:`snapshot`, which
    rebuilds only those (O(changed), not O(tenants))."""

    def __init__(self, weights: Iterable[tuple[str, float]] = ()):
        self.weights = dict(weights)
        self.counter: dict[str, float] = {}
        self.max_counter = 0.0  # the largest counter of any tenant
        self.prompt_tokens: dict[str, int] = {}
        self.output_tokens: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        self._changed: set[str] = set()
        self._slots: dict[str, int] = {}  # running requests per tenant, as of the last snapshot
        self._stats: dict[str, TenantStats] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, prompt: int = 0, output: int = 0) -> None:
        self.prompt_tokens[tenant] = self.prompt_tokens.get(tenant, 0) + prompt
        self.output_tokens[tenant] = self.output_tokens.get(tenant, 0) + output
        cost = (W_IN * prompt + W_OUT * output) / self.weight(tenant)
        self.counter[tenant] = value = self.counter.get(tenant, 0.0) + cost
        self.max_counter = max(self.max_counter, value)
        self._changed.add(tenant)

    def lift(self, tenant: str, floor: float) -> None:
        """No credit for idle time: raise ``tenant``'s counter to at least ``floor``."""
        if self.counter.get(tenant, 0.0) < floor:
            self.counter[tenant] = floor
            self._changed.add(tenant)

    def count_waiting(self, tenant: str, delta: int) -> None:
        self.waiting[tenant] = self.waiting.get(tenant, 0) + delta
        self._changed.add(tenant)

    def snapshot(self, running: Iterable[str]) -> dict[str, TenantStats]:
        """Every tenant seen so far; ``running``: the tenant of each running request."""
        slots: dict[str, int] = {}
        for tenant in running:
            slots[tenant] = slots.get(tenant, 0) + 1
        changed = self._changed | {t for t in slots.keys() | self._slots.keys()
                                   if slots.get(t) != self._slots.get(t)}  # fmt: skip
        self._slots, self._changed = slots, set()
        for t in changed:
            self._stats[t] = TenantStats(
                self.prompt_tokens.get(t, 0),
                self.output_tokens.get(t, 0),
                self.waiting.get(t, 0),
                slots.get(t, 0),
                self.counter.get(t, 0.0),
            )
        return dict(self._stats)
