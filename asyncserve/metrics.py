"""Prometheus metrics (names are an interface: dashboards and tests rely on them)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("asyncserve_requests", "Finished requests", ["model", "status"], registry=r)
        self.ttft = Histogram("asyncserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("asyncserve_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_STEP_BUCKETS, registry=r)
        self.latency = Histogram("asyncserve_request_latency_seconds", "Request latency, arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("asyncserve_step_duration_seconds", "Model step duration",
                              buckets=_STEP_BUCKETS, registry=r)
        self.running = Gauge("asyncserve_running_requests", "Requests holding KV pages", registry=r)
        self.waiting = Gauge("asyncserve_waiting_requests", "Requests waiting for admission", registry=r)
        self.pool_pages = Gauge("asyncserve_pool_pages", "Unified pool pages by use", ["kind"], registry=r)
        self.adapters_loaded = Gauge("asyncserve_adapters_loaded", "Adapters per memory tier", ["tier"], registry=r)
        self.adapter_loads = Counter("asyncserve_adapter_loads", "Adapters paged into the device pool", registry=r)
        self.generated_tokens = Counter("asyncserve_generated_tokens", "Output tokens generated", registry=r)
        self.prefix_queried = Counter("asyncserve_prefix_cache_queried_tokens",
                                      "Prompt tokens of admissions that looked up the prefix cache", registry=r)
        self.prefix_hits = Counter("asyncserve_prefix_cache_hit_tokens", "Of those, tokens whose KV was cached",
                                   registry=r)
        self.prefix_cached_pages = Gauge("asyncserve_prefix_cache_pages",
                                         "Free pool pages still holding cached blocks (counted in kind=free)",
                                         registry=r)
        self._adapter_loads_seen = 0
        self._prefix_seen = (0, 0)

    def observe_engine(self, engine) -> None:
        """Refresh the gauges from the engine's load snapshot (called after each step and on scrape)."""
        load = engine.load_snapshot()
        s = load.pool
        self.pool_pages.labels("free").set(s.free)
        self.pool_pages.labels("kv").set(s.kv)
        self.pool_pages.labels("adapter").set(s.adapter)
        self.adapters_loaded.labels("device").set(s.adapters_resident)
        self.adapters_loaded.labels("host").set(s.adapters_registered)
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.adapter_loads.inc(load.adapter_loads_total - self._adapter_loads_seen)
        self._adapter_loads_seen = load.adapter_loads_total
        self.prefix_cached_pages.set(s.cached)
        self.prefix_queried.inc(load.prefix_queried_tokens - self._prefix_seen[0])
        self.prefix_hits.inc(load.prefix_hit_tokens - self._prefix_seen[1])
        self._prefix_seen = (load.prefix_queried_tokens, load.prefix_hit_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
