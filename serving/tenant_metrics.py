"""Per-tenant Prometheus series, with a cap on tenant label cardinality.

Exported (prefixed ``jbatch_tenant_``, label ``tenant``): counters ``prompt_tokens_total`` and
``output_tokens_total`` (tokens served to the tenant: prompt tokens computed, tokens
generated), gauges ``queue_depth`` (its requests waiting for a slot) and ``running_slots``.

Only the ``max_tenants`` tenants with the most weighted service (``TenantStats.service``) get
their own label; the rest are summed under ``tenant="other"`` — so a server with thousands of
users exports at most ``max_tenants + 1`` series per metric. The split is recomputed at each
scrape from the engine's latest snapshot: when a tenant enters the top N its tokens leave
``other`` (which Prometheus then reads as a counter reset of ``other``). The engine's figures
restart when its scheduler is rebuilt after a fault (a counter reset too).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jbatch.engine.tenants import TenantStats

OTHER = "other"
_SERIES = (
    ("prompt_tokens", CounterMetricFamily, "Prompt tokens computed for the tenant."),
    ("output_tokens", CounterMetricFamily, "Tokens generated for the tenant."),
    ("waiting", GaugeMetricFamily, "The tenant's requests waiting for a slot."),
    ("running", GaugeMetricFamily, "The tenant's requests holding a slot."),
)
_NAMES = {
    "prompt_tokens": "jbatch_tenant_prompt_tokens",
    "output_tokens": "jbatch_tenant_output_tokens",
    "waiting": "jbatch_tenant_queue_depth",
    "running": "jbatch_tenant_running_slots",
}


def capped(tenants: dict[str, TenantStats], max_tenants: int) -> dict[str, TenantStats]:
    """The top ``max_tenants`` tenants by weighted service, the rest summed as ``other``."""
    ranked = sorted(tenants.items(), key=lambda kv: (-kv[1].service, kv[0]))
    out = dict(ranked[:max_tenants])
    for _, stats in ranked[max_tenants:]:
        out[OTHER] = out[OTHER] + stats if OTHER in out else stats
    return out


class TenantCollector(Collector):
    """Reads the latest snapshot handed to :meth:`update` (by the engine thread) at scrape."""

    def __init__(self, max_tenants: int = 16):
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._tenants: dict[str, TenantStats] = {}

    def update(self, tenants: dict[str, TenantStats]) -> None:
        self._tenants = tenants  # one reference swap: scrapes see a whole snapshot

    def collect(self):
        tenants = capped(self._tenants, self.max_tenants)
        for field, family, doc in _SERIES:
            metric = family(_NAMES[field], doc, labels=["tenant"])
            for name, stats in tenants.items():
                metric.add_metric([name], getattr(stats, field))
            yield metric
