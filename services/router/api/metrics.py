"""Prometheus metrics with vLLM-style names: engine gauges read at scrape time, latencies observed per request."""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from services.router.contracts import EngineProtocol, SwitchTotals
from services.router.metrics_merge import family_samples

PREFIX = "reconfig:"
METRICS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LABELS = ("model_name",)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
SWITCH_STATES = ("SUCCEEDED", "ROLLED_BACK", "FAILED")  # exported from zero, so rate() works before the first switch


class EngineStatsCollector(Collector):
    """Gauges and counters read from `engine.stats()` on every scrape, so they are never stale."""

    def __init__(self, engine: EngineProtocol, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        labels = [self._model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        usage = stats.num_kv_blocks_used / stats.num_kv_blocks_total if stats.num_kv_blocks_total else 0.0
        yield gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", usage)
        yield gauge("num_kv_blocks_total", "KV blocks the workers hold.", stats.num_kv_blocks_total)
        per_rank = GaugeMetricFamily(PREFIX + "kv_blocks_used_per_dp_rank",
                                     "KV blocks in use on each data-parallel attention rank (EP layouts only: one "
                                     "pool per rank).", labels=(*LABELS, "dp_rank"))
        for dp_rank, used in enumerate(stats.num_kv_blocks_used_per_dp_rank):
            per_rank.add_metric([*labels, str(dp_rank)], used)
        yield per_rank
        yield counter("prompt_tokens", "Prefilled prompt tokens.", stats.num_prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", stats.num_generation_tokens)
        yield counter("num_preemptions", "Requests preempted (re-prefilled later).", stats.num_preemptions)
        yield counter("decodes_ahead", "Decodes sent before the step sampling their input returned (async "
                      "scheduling: single-stage layouts).", stats.num_decodes_ahead)
        topology = GaugeMetricFamily(
            PREFIX + "topology_info", "The live parallel layout (value is always 1).", labels=(*LABELS, "topology")
        )
        topology.add_metric([*labels, stats.topology], 1.0)
        yield topology
        yield gauge("is_frozen", "1 while a reconfiguration has scheduling paused.", float(stats.is_frozen))
        yield gauge("router_stalled", "1 while a failed worker step has the engine waiting for a recovery.",
                    float(bool(stats.stalled)))
        yield from switch_metrics(self._engine.switch_totals(), self._model_name)
        yield from expert_metrics(getattr(self._engine, "experts", None), self._model_name)
        if (collect := getattr(self._engine, "collect_metrics", None)) is not None:  # the front router's own
            yield from collect(labels, LABELS)


def switch_metrics(switches: SwitchTotals, model_name: str) -> Iterator[Metric]:
    """Layout switches: downtime overall and by phase (summaries), bytes and preemptions, outcomes by state."""
    labels = [model_name]
    phases = SummaryMetricFamily(PREFIX + "switch_phase_seconds", "Time spent in each phase of layout switches.",
                                 labels=(*LABELS, "phase"))
    for phase in sorted(switches.phase_seconds):
        phases.add_metric([model_name, phase], switches.phase_counts[phase], switches.phase_seconds[phase])
    yield phases
    total = SummaryMetricFamily(PREFIX + "switch_seconds",
                                "Layout switches from start to end, every phase: staging and KV pre-copy while "
                                "serving, then the freeze.", labels=LABELS)
    total.add_metric(labels, switches.num_total, sum(switches.phase_seconds.values()))
    yield total
    cutover = SummaryMetricFamily(PREFIX + "switch_cutover_seconds",
                                  "Downtime of layout switches: from the first request the freeze held back (the "
                                  "steps in flight ran on until then) to the resume.", labels=LABELS)
    cutover.add_metric(labels, switches.num_total, switches.downtime_seconds)
    yield cutover
    staging = SummaryMetricFamily(PREFIX + "switch_staging_seconds",
                                  "Layout switches before the freeze, while serving: target shards built (STAGING) and "
                                  "KV pre-copied (PRECOPY).",
                                  labels=LABELS)
    staging.add_metric(labels, switches.num_staged, switches.staging_seconds)
    yield staging
    last = GaugeMetricFamily(PREFIX + "last_switch_seconds", "Downtime of the latest layout switch (0: none yet).",
                             labels=LABELS)
    last.add_metric(labels, switches.last.downtime_seconds if switches.last else 0.0)
    yield last
    for name, documentation, value in (
        ("kv_migrated_bytes", "KV-cache bytes moved by layout switches inside their freeze.", switches.kv_bytes_moved),
        ("kv_precopied_bytes", "KV-cache bytes layout switches copied while serving, before their freeze.",
         switches.kv_bytes_precopied),
        ("weight_loaded_bytes", "Weight bytes loaded from the weight store by layout switches.",
         switches.weight_bytes_loaded),
        ("switch_preempted_requests", "Requests preempted by layout switches (re-prefilled later).",
         switches.num_requests_preempted),
    ):
        family = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
        family.add_metric(labels, value)
        yield family
    outcomes = CounterMetricFamily(PREFIX + "switches", "Layout switches by how they ended.",
                                   labels=(*LABELS, "state"))
    for state in dict.fromkeys((*SWITCH_STATES, *sorted(switches.num_switches))):
        outcomes.add_metric([model_name, state], switches.num_switches.get(state, 0))
    yield outcomes


def expert_metrics(experts, model_name: str) -> Iterator[Metric]:
    """EPLB (MoE, EP layouts only): cached values, no worker is asked on a scrape. The balancedness is the measured
    one of the last ExpertStatus (`reconfigctl status` in an EP layout, `reconfigctl eplb status`), which every
    rebalance, manual or automatic (--eplb), also takes first."""
    if experts is None or not experts.is_expert_parallel:
        return
    labels = [model_name]
    balance = GaugeMetricFamily(PREFIX + "eplb_balancedness", "Mean / max expert load over the EP ranks, all sparse "
                                "layers, as last measured (1: even).", labels=LABELS)
    balance.add_metric(labels, experts.last_balancedness)
    yield balance
    rebalances = CounterMetricFamily(PREFIX + "eplb_rebalances", "EPLB rebalances committed.", labels=LABELS)
    rebalances.add_metric(labels, experts.num_rebalances)
    yield rebalances
    epoch = GaugeMetricFamily(PREFIX + "eplb_epoch", "Epoch of the live expert map (0: the initial one).",
                              labels=LABELS)
    epoch.add_metric(labels, experts.epoch)
    yield epoch


class Buckets(Collector):
    """A Prometheus histogram of one series that takes a value many times in one call: the inter-token latency is
    observed for every streamed token, and prometheus_client's Histogram takes a lock and a bisection per token.
    Used from the event loop's thread only."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...], model_name: str) -> None:
        self.name, self.documentation, self.bounds, self.model_name = name, documentation, bounds, model_name
        self.counts = [0] * (len(bounds) + 1)  # per bucket (value <= bound), the last for +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=LABELS)
        cumulative = list(itertools.accumulate(self.counts))
        family.add_metric([self.model_name], [*((str(bound), count) for bound, count in zip(self.bounds, cumulative)),
                                              ("+Inf", cumulative[-1])], self.sum)
        yield family


class RequestTimer:
    """Observes one request's time to first token, inter-token latencies and end-to-end latency."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last_token_time: float | None = None

    def on_tokens(self, num_new_tokens: int) -> None:
        """Record that `num_new_tokens` arrived now (a delta may carry several: their gap is shared)."""
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        if self._last_token_time is None:
            self._metrics.time_to_first_token.observe(now - self._start)
            num_new_tokens -= 1
        else:
            self._metrics.inter_token_latency.observe((now - self._last_token_time) / num_new_tokens, num_new_tokens)
            num_new_tokens = 0
        if num_new_tokens:  # tokens after the first in the first delta came with it
            self._metrics.inter_token_latency.observe(0.0, num_new_tokens)
        self._last_token_time = now

    def finish(self, finish_reason: str) -> None:
        """Record the end of the request."""
        self._metrics.e2e_request_latency.observe(time.perf_counter() - self._start)
        self._metrics.request_finished.labels(self._metrics.model_name, finish_reason).inc()
        self._metrics.num_observed += 1


class ApiMetrics:
    """The API's Prometheus series: the engine's (read at scrape time) and this process's request latencies, each
    in a registry of its own (one per app, so several apps never share series). An API server process reports its
    latencies to the engine, which adds up every server's (services.router.metrics_merge)."""

    def __init__(self, engine: EngineProtocol, model_name: str) -> None:
        disable_created_metrics()  # process-wide: no `*_created` series (vLLM does the same)
        self.model_name = model_name
        self.engine_registry = CollectorRegistry(auto_describe=False)
        self.engine_registry.register(EngineStatsCollector(engine, model_name))
        self.registry = CollectorRegistry(auto_describe=False)  # the requests this process served
        self.num_observed = 0  # requests finished here (an API server reports its samples when it changed)
        self.time_to_first_token = Buckets(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                                           TTFT_BUCKETS, model_name)
        self.inter_token_latency = Buckets(PREFIX + "inter_token_latency_seconds", "Time between tokens.",
                                           ITL_BUCKETS, model_name)
        self.e2e_request_latency = Buckets(PREFIX + "e2e_request_latency_seconds", "End-to-end latency.",
                                           E2E_BUCKETS, model_name)
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency):
            self.registry.register(histogram)
        self.request_finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", (*LABELS, "finished_reason"),
            registry=self.registry,
        )

    def request_timer(self) -> RequestTimer:
        """A timer for one request, started now."""
        return RequestTimer(self)

    def samples(self) -> list:
        """This process's request series, as an API server reports them to the engine."""
        return family_samples(self.registry)

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.engine_registry) + generate_latest(self.registry), METRICS_CONTENT_TYPE


def render_engine_metrics(engine: EngineProtocol, model_name: str) -> bytes:
    """The engine's series alone (the engine process adds its API servers' latencies to them)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(engine, model_name))
    return generate_latest(registry)
