"""Prometheus metrics of one server (own registry, so several servers can live in one process).

Exported (all prefixed ``jbatch_``):

* histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds`` (arrival at the server -> last token);
* gauges ``queue_depth`` (accepted requests not yet in a slot), ``running_slots``,
  ``slot_utilization`` (running / max_slots), ``kv_pages_used``, ``kv_pages_total``,
  ``prefix_cache_hit_rate`` (pages found / pages looked up; 0 while the engine has no prefix
  cache);
* counter ``slow_consumer_aborts_total`` (streams whose client stopped reading, aborted);
* counters ``preemptions_total`` and ``requests_total{status, finish_reason}`` — status ``ok``
  (finish_reason stop / length / abort), ``cancelled`` (client went away) or an error status
  (``invalid_argument``, ``resource_exhausted``, ``deadline_exceeded``, ``unavailable``,
  ``internal``, ``unauthenticated``, ``too_large``; finish_reason empty);
* speculative decoding: counters ``spec_proposed_tokens_total`` and
  ``spec_accepted_tokens_total``, gauges ``spec_acceptance_rate`` (accepted / proposed) and
  ``spec_mean_accepted_length`` (tokens per request per speculative step it had proposals in),
  both over the engine's lifetime;
* per tenant (``tenant_metrics.py``: top N tenants + ``other``): ``tenant_prompt_tokens_total``,
  ``tenant_output_tokens_total``, ``tenant_queue_depth``, ``tenant_running_slots``.

Histograms and counters are updated by whichever thread sees the event (prometheus-client is
thread-safe); gauges only by the engine thread, from ``observe_engine`` after each step.
"""

from __future__ import annotations

import prometheus_client as prom

from jbatch.engine.interface import EngineStats
from serving.tenant_metrics import TenantCollector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServingMetrics:
    """The metric objects plus the small amount of state needed to update them."""

    def __init__(self, registry: prom.CollectorRegistry | None = None, max_tenants: int = 16):
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.tenants = TenantCollector(max_tenants)
        r.register(self.tenants)
        self.ttft = prom.Histogram(
            "jbatch_time_to_first_token_seconds",
            "Arrival to first streamed token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = prom.Histogram(
            "jbatch_inter_token_latency_seconds",
            "Time between consecutive tokens of one request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = prom.Histogram(
            "jbatch_e2e_request_latency_seconds",
            "Arrival to last token of a finished request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = prom.Gauge(
            "jbatch_queue_depth", "Accepted requests not yet in a slot.", registry=r
        )
        self.running = prom.Gauge("jbatch_running_slots", "Slots holding a request.", registry=r)
        self.utilization = prom.Gauge(
            "jbatch_slot_utilization", "Running slots / max_slots.", registry=r
        )
        self.pages_used = prom.Gauge("jbatch_kv_pages_used", "KV pages owned.", registry=r)
        self.pages_total = prom.Gauge("jbatch_kv_pages_total", "KV pages in the pool.", registry=r)
        self.prefix_hit_rate = prom.Gauge(
            "jbatch_prefix_cache_hit_rate",
            "Prefix-cache pages found / looked up (0 without prefix caching).",
            registry=r,
        )
        self.preemptions = prom.Counter(
            "jbatch_preemptions", "Sequences preempted (by recompute).", registry=r
        )
        self.requests = prom.Counter(
            "jbatch_requests",
            "Requests by outcome.",
            ["status", "finish_reason"],
            registry=r,
        )
        self.slow_consumer_aborts = prom.Counter(
            "jbatch_slow_consumer_aborts",
            "Streams aborted because their client stopped reading (stream_stall_timeout).",
            registry=r,
        )
        self._last_preemptions = 0
        self.spec_counters = {
            name: prom.Counter(f"jbatch_{name}", help_, registry=r)
            for name, help_ in (
                ("spec_proposed_tokens", "Tokens proposed by speculative decoding."),
                ("spec_accepted_tokens", "Proposed tokens the target model accepted."),
            )
        }
        self._last_spec = dict.fromkeys(self.spec_counters, 0)
        self.spec_acceptance = prom.Gauge(
            "jbatch_spec_acceptance_rate", "Accepted / proposed speculative tokens.", registry=r
        )
        self.spec_length = prom.Gauge(
            "jbatch_spec_mean_accepted_length",
            "Tokens a request gets per speculative step it had proposals in.",
            registry=r,
        )

    def outcome(self, status: str, finish_reason: str | None = None) -> None:
        """Count one finished request: ``status`` ok / cancelled / an error label."""
        self.requests.labels(status=status, finish_reason=finish_reason or "").inc()

    def observe_engine(self, stats: EngineStats, num_waiting: int) -> None:
        """Refresh the gauges from an engine snapshot (engine thread only)."""
        self.queue_depth.set(num_waiting)
        self.running.set(stats.running)
        self.utilization.set(stats.running / stats.total_slots)
        self.pages_used.set(stats.pages_used)
        self.pages_total.set(stats.pages_total)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.tenants.update(stats.tenants)
        # The engine's count restarts when its scheduler is rebuilt after a fault.
        total = stats.preemptions
        if total < self._last_preemptions:
            self._last_preemptions = 0
        self.preemptions.inc(total - self._last_preemptions)
        self._last_preemptions = total
        for name, counter in self.spec_counters.items():
            now = getattr(stats, name)
            last = self._last_spec[name] if now >= self._last_spec[name] else 0
            counter.inc(now - last)
            self._last_spec[name] = now
        self.spec_acceptance.set(stats.spec_acceptance_rate)
        self.spec_length.set(stats.spec_mean_accepted_length)

    def exposition(self) -> bytes:
        """The text exposition format (what ``/metrics`` returns)."""
        return prom.generate_latest(self.registry)
