"""Prometheus metrics (names are an interface: dashboards and tests rely on them)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TOP_ADAPTERS = 20          # adapters with series of their own; the rest add up under adapter="other"
OTHER = "other"            # the label of adapters beyond the top and of unloaded ones


@dataclass
class AdapterCounts:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    load_seconds: float = 0.0
    device_hits: int = 0


class AdapterTraffic:
    """Per-adapter series with a bounded label set: at each scrape the TOP_ADAPTERS adapters with the
    most requests get series of their own and every other adapter adds into adapter="other". When an
    adapter enters or leaves the top, "other" moves by its counts (a rate over that scrape sees a
    reset); an adapter's own series always carries its whole history. An unloaded adapter's counts
    move into "other" for good (retire), so names loaded and unloaded at runtime leave no series."""

    def __init__(self, top: int = TOP_ADAPTERS):
        self.top = top
        self.counts: dict[str, AdapterCounts] = {}
        self.retired = AdapterCounts()

    def _of(self, adapter: str) -> AdapterCounts:
        c = self.counts.get(adapter)
        if c is None:
            c = self.counts[adapter] = AdapterCounts()
        return c

    def record(self, adapter: str, prompt_tokens: int, generated_tokens: int, *, retired: bool = False) -> None:
        """A finished request; retired: its adapter was unloaded meanwhile (counted under "other")."""
        c = self.retired if retired else self._of(adapter)
        c.requests += 1
        c.prompt_tokens += prompt_tokens
        c.generated_tokens += generated_tokens

    def record_load(self, adapter: str, seconds: float, *, retired: bool = False) -> None:
        (self.retired if retired else self._of(adapter)).load_seconds += seconds

    def set_device_hits(self, hits: dict[str, int]) -> None:
        for adapter, n in hits.items():
            self._of(adapter).device_hits = n

    def retire(self, adapter: str) -> None:
        """An unloaded adapter: its counts join "other"."""
        if (c := self.counts.pop(adapter, None)) is not None:
            _add_counts(self.retired, c)

    def collect(self):
        ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1].requests, kv[0]))
        rows = ranked[:self.top]
        if len(ranked) > self.top or self.retired != AdapterCounts():
            other = AdapterCounts()
            for _, c in [*ranked[self.top:], (OTHER, self.retired)]:
                _add_counts(other, c)
            rows.append((OTHER, other))
        requests = CounterMetricFamily("asyncserve_adapter_requests", "Finished requests per adapter",
                                       labels=["adapter"])
        tokens = CounterMetricFamily("asyncserve_adapter_tokens", "Prompt and generated tokens of finished "
                                     "requests per adapter", labels=["adapter", "kind"])
        load = CounterMetricFamily("asyncserve_adapter_load_time_seconds", "Time spent loading the adapter "
                                   "(disk -> host and host -> device)", labels=["adapter"])
        hits = CounterMetricFamily("asyncserve_adapter_device_hits", "Admissions that found the adapter "
                                   "already on the device", labels=["adapter"])
        for adapter, c in rows:
            requests.add_metric([adapter], c.requests)
            tokens.add_metric([adapter, "prompt"], c.prompt_tokens)
            tokens.add_metric([adapter, "generated"], c.generated_tokens)
            load.add_metric([adapter], c.load_seconds)
            hits.add_metric([adapter], c.device_hits)
        return [requests, tokens, load, hits]


def _add_counts(into: AdapterCounts, c: AdapterCounts) -> None:
    into.requests += c.requests
    into.prompt_tokens += c.prompt_tokens
    into.generated_tokens += c.generated_tokens
    into.load_seconds += c.load_seconds
    into.device_hits += c.device_hits


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # by model, which names adapters: shown whole with the per-adapter series, else summed over models
        self.requests = Counter("asyncserve_requests", "Finished requests", ["model", "status"], registry=None)
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
        self.adapters_loaded = Gauge("asyncserve_adapters_loaded", "Adapters per memory tier (inclusive: one on "
                                     "the device is also on host and disk; disk: every registered one)", ["tier"],
                                     registry=r)
        self.adapters_preloading = Gauge("asyncserve_adapters_preloading", "1 while --preload-adapters still reads "
                                         "registered adapters into the host tier, else 0", registry=r)
        self.adapter_loads = Counter("asyncserve_adapter_loads", "Adapters paged into the device pool", registry=r)
        self.adapter_load_seconds = Histogram("asyncserve_adapter_load_seconds", "Adapter load time, by the tier "
                                              "it came from: disk (into host memory) or host (into the device pool)",
                                              ["from"], buckets=_LOAD_BUCKETS, registry=r)
        # series that name adapters (a tenant's adapter names and traffic) live in a registry of their
        # own, rendered only for callers with the API key (or --metrics-public)
        self.adapter_registry = CollectorRegistry()
        self.adapter_traffic = AdapterTraffic()
        self.adapter_registry.register(self.adapter_traffic)
        self.requests_aborted = Counter("asyncserve_requests_aborted", "Requests the server answered with an error "
                                        "before running them, by reason: slo_unattainable (--slo-ttft)", ["reason"],
                                        registry=r)
        self.generated_tokens = Counter("asyncserve_generated_tokens", "Output tokens generated", registry=r)
        self.prefix_queried = Counter("asyncserve_prefix_cache_queried_tokens",
                                      "Prompt tokens of admissions that looked up the prefix cache", registry=r)
        self.prefix_hits = Counter("asyncserve_prefix_cache_hit_tokens", "Of those, tokens whose KV was cached",
                                   registry=r)
        self.prefix_cached_pages = Gauge("asyncserve_prefix_cache_pages",
                                         "Free pool pages still holding cached blocks (counted in kind=free)",
                                         registry=r)
        self.cpu_workers = Gauge("asyncserve_cpu_workers", "Live CPU LoRA worker processes (CPU assist)", registry=r)
        self.cpu_assist_tokens = Counter("asyncserve_cpu_assist_tokens", "Tokens whose LoRA the CPU workers "
                                         "computed while their adapter was not on the device", registry=r)
        self.cpu_worker_restarts = Counter("asyncserve_cpu_worker_restarts", "CPU LoRA workers replaced after "
                                           "dying or missing a job's deadline", registry=r)
        self._cpu_seen = (0, 0)
        self.spec_draft_tokens = Counter("asyncserve_spec_decode_draft_tokens", "Speculative decoding: tokens "
                                         "drafted by prompt lookup", registry=r)
        self.spec_accepted_tokens = Counter("asyncserve_spec_decode_accepted_tokens", "Speculative decoding: "
                                            "drafted tokens that matched the model's and were kept", registry=r)
        self._spec_seen = (0, 0)
        # cluster mode
        self.peers_alive = Gauge("asyncserve_peers_alive", "Peers heard from lately (cluster mode)", registry=r)
        self.requests_forwarded = Counter("asyncserve_requests_forwarded",
                                          "Sequences routed to a peer to run, by the peer's node id", ["to"],
                                          registry=r)
        self.migrations = Counter("asyncserve_migrations", "Requests moved between servers: request (for load), "
                                  "resubmit (its peer failed), adapter (loaded where a moved request went)",
                                  ["kind"], registry=r)
        self.peer_adapters = Counter("asyncserve_peer_adapters", "Adapters of forwarded requests: fetched (from "
                                     "the origin, here), adapter_mismatch (refused here: another copy), "
                                     "adapter_unavailable (refused here: none could be had), refused (a peer "
                                     "refused one of this node's)", ["event"], registry=r)
        # dLoRA's merged mode
        self.merged_adapter = Gauge("asyncserve_merged_adapter", "1 for the adapter merged into the base weights "
                                    "(no series while none is)", ["adapter"], registry=self.adapter_registry)
        self.merge_switches = Counter("asyncserve_merge_switches", "Changes of the adapter merged into the base "
                                      "weights (a merge, an unmerge, or both)", registry=r)
        self.merge_switch_seconds = Counter("asyncserve_merge_switch_seconds", "Time spent switching the merged "
                                            "adapter, by kind: merge or unmerge", ["kind"], registry=r)
        self.step_mode_seconds = Counter("asyncserve_step_mode_seconds", "Step time by mode: merged (one adapter "
                                         "in the base weights) or unmerged", ["mode"], registry=r)
        self._merge_seen = None
        self._adapter_loads_seen = 0
        self._prefix_seen = (0, 0)

    def observe_engine(self, engine) -> None:
        """Refresh the gauges and counters from the engine's load snapshot: on scrape (and once at start), not
        after each step, which would cost the event loop time between steps for values nobody reads yet."""
        self.observe_loads(engine)
        load = engine.load_snapshot()
        s = load.pool
        self.pool_pages.labels("free").set(s.free)
        self.pool_pages.labels("kv").set(s.kv)
        self.pool_pages.labels("adapter").set(s.adapter)
        self.adapters_loaded.labels("device").set(s.adapters_resident)
        self.adapters_loaded.labels("host").set(s.adapters_host)
        self.adapters_loaded.labels("disk").set(s.adapters_registered)
        self.adapters_preloading.set(int(engine.preloading))
        self.adapter_traffic.set_device_hits(engine.device_hits())
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.adapter_loads.inc(load.adapter_loads_total - self._adapter_loads_seen)
        self._adapter_loads_seen = load.adapter_loads_total
        self.prefix_cached_pages.set(s.cached)
        self.prefix_queried.inc(load.prefix_queried_tokens - self._prefix_seen[0])
        self.prefix_hits.inc(load.prefix_hit_tokens - self._prefix_seen[1])
        self._prefix_seen = (load.prefix_queried_tokens, load.prefix_hit_tokens)
        self.cpu_workers.set(load.cpu_workers)
        self.cpu_assist_tokens.inc(load.cpu_assist_tokens - self._cpu_seen[0])
        self.cpu_worker_restarts.inc(load.cpu_worker_restarts - self._cpu_seen[1])
        self._cpu_seen = (load.cpu_assist_tokens, load.cpu_worker_restarts)
        self.spec_draft_tokens.inc(load.spec_draft_tokens - self._spec_seen[0])
        self.spec_accepted_tokens.inc(load.spec_accepted_tokens - self._spec_seen[1])
        self._spec_seen = (load.spec_draft_tokens, load.spec_accepted_tokens)
        self._observe_merge(engine.merge_stats())

    def observe_loads(self, engine) -> None:
        """Record the adapter loads since the last call. After each step as well as on scrape: the
        engine keeps only the last 4,096, and a store of thousands of adapters can load more than
        that between two scrapes."""
        for tier, adapter, seconds in engine.take_load_times():
            self.adapter_load_seconds.labels(tier).observe(seconds)
            self.adapter_traffic.record_load(adapter, seconds, retired=not engine.has_adapter(adapter))

    def record_finish(self, model: str, adapter: str | None, registered: bool, status: str, prompt_tokens: int,
                      generated_tokens: int) -> None:
        """A finished request; one whose adapter is no longer registered counts under "other"."""
        self.requests.labels(model if registered else OTHER, status).inc()
        if adapter is not None:
            self.adapter_traffic.record(adapter, prompt_tokens, generated_tokens, retired=not registered)

    def retire_adapter(self, name: str) -> None:
        """An unloaded adapter: its series fold into "other", so runtime names leave none behind."""
        self.adapter_traffic.retire(name)
        done = [(s.labels["status"], s.value) for family in self.requests.collect() for s in family.samples
                if s.name.endswith("_total") and s.labels["model"] == name]
        for status, value in done:
            self.requests.remove(name, status)
            self.requests.labels(OTHER, status).inc(value)

    def _observe_merge(self, m) -> None:
        seen = self._merge_seen
        if seen is None or m.merged != seen.merged:
            if seen is not None and seen.merged is not None:
                self.merged_adapter.remove(seen.merged)
            if m.merged is not None:
                self.merged_adapter.labels(m.merged).set(1)
        self.merge_switches.inc(m.switches - (seen.switches if seen else 0))
        for kind, seconds in m.switch_seconds.items():
            self.merge_switch_seconds.labels(kind).inc(seconds - (seen.switch_seconds[kind] if seen else 0.0))
        for mode, seconds in m.step_seconds.items():
            self.step_mode_seconds.labels(mode).inc(seconds - (seen.step_seconds[mode] if seen else 0.0))
        self._merge_seen = m

    def render(self, per_adapter: bool = True) -> bytes:
        """The exposition text: the aggregate series, and with per_adapter those that name adapters."""
        if per_adapter:
            return generate_latest(_Union(self.registry, self.requests, self.adapter_registry))
        return generate_latest(_Union(self.registry, _ByStatus(self.requests)))


class _Union:
    """Collectors rendered as one registry."""

    def __init__(self, *collectors):
        self.collectors = collectors

    def collect(self):
        for c in self.collectors:
            yield from c.collect()


class _ByStatus:
    """asyncserve_requests summed over its model label (which names adapters)."""

    def __init__(self, requests: Counter):
        self.requests = requests

    def collect(self):
        totals: dict[str, float] = {}
        for family in self.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    status = sample.labels["status"]
                    totals[status] = totals.get(status, 0.0) + sample.value
        family = CounterMetricFamily("asyncserve_requests", "Finished requests (summed over models; the API key "
                                     "shows them by model)", labels=["status"])
        for status, value in sorted(totals.items()):
            family.add_metric([status], value)
        yield family
