"""The router's Prometheus metrics, in a registry of its own (one per app, no global state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: `pdlab_router_breaker_state`'s values.
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("pdlab_router_requests", "Generation requests routed, by path taken",
                                ["endpoint", "path"], registry=r)
        self.decisions = Counter("pdlab_router_decisions", "Routing decisions, by path taken and why (the "
                                 "x-pdlab-reason header)", ["path", "reason"], registry=r)
        self.choices = Counter("pdlab_router_choices", "Replica choices, by pool, strategy and replica",
                               ["pool", "strategy", "replica"], registry=r)
        self.rejected = Counter("pdlab_router_rejected", "Requests refused before any upstream call",
                                ["reason"], registry=r)
        self.upstream_errors = Counter("pdlab_router_upstream_errors", "Upstream failures, by leg and kind",
                                       ["stage", "kind"], registry=r)
        self.retries = Counter("pdlab_router_retries", "Upstream calls tried again (before the answer's first byte "
                               "reached the client), by leg and what failed", ["stage", "kind"], registry=r)
        self.fallbacks = Counter("pdlab_router_fallbacks", "Disaggregated requests served directly on a decode "
                                 "instance because the prefill pool was down or erroring", ["reason"], registry=r)
        self.breaker_state = Gauge("pdlab_router_breaker_state", "Each replica's circuit breaker: 0 closed, "
                                   "1 half-open, 2 open", ["pool", "replica"], registry=r)
        self.breaker_opened = Counter("pdlab_router_breaker_opened", "Times a replica's circuit breaker opened",
                                      ["pool", "replica"], registry=r)
        self.kv_transfer_params = Counter("pdlab_router_kv_transfer_params", "Prefill responses, by whether they "
                                          "carried kv_transfer_params", ["present"], registry=r)
        self.ttft = Histogram("pdlab_router_ttft_seconds", "Router-side time to first byte of the answer "
                              "(streaming: first SSE chunk), from request arrival", ["path"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("pdlab_router_prefill_seconds", "Duration of the prefill leg",
                                         buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("pdlab_router_prompt_tokens", "Prompt tokens as counted by the router",
                                       buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768), registry=r)
        self.client_disconnects = Counter("pdlab_router_client_disconnects", "Requests the client left before the "
                                          "end (the upstream request was closed, so vLLM aborts it)", registry=r)
        self.in_flight = Gauge("pdlab_router_in_flight", "Generation requests in flight at the router", registry=r)
        self.threshold = Gauge("pdlab_router_threshold_tokens", "The routing threshold in force", registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: label lookups are on every request's path."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def count(self, metric: Any, *labels: str) -> None:
        self.child(metric, *labels).inc()

    def chose(self, pool: Any, url: str) -> None:
        """Count a replica choice of `pool` (a pdlab.router.pool.Pool)."""
        self.child(self.choices, pool.role, pool.strategy_name, url).inc()
