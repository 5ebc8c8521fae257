"""The request latencies of several API server processes as one set of Prometheus series: each server reports the
cumulative samples of its own histograms and counters (ApiMetrics.samples), the engine keeps the latest report of
each and adds them up when /metrics is scraped (any server answers for all)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

# One family as it travels: (name, documentation, type, ((sample name, sorted labels, value), ...)).
FamilySamples = tuple[str, str, str, tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]]


def family_samples(registry: CollectorRegistry) -> list[FamilySamples]:
    """The samples of every family of `registry`, in a form that pickles."""
    return [(family.name, family.documentation, family.type,
             tuple((s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples))
            for family in registry.collect()]


class MergedRequestMetrics(Collector):
    """The latest samples each API server reported, summed per series (cumulative counts add up)."""

    def __init__(self) -> None:
        self._reports: dict[int, list[FamilySamples]] = {}

    def update(self, server: int, families: list[FamilySamples]) -> None:
        self._reports[server] = families  # a server that died keeps its last report: counters never go back

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, tuple[str, str, dict[tuple[str, tuple], float]]] = {}
        for families in self._reports.values():
            for name, documentation, kind, samples in families:
                _, _, values = merged.setdefault(name, (documentation, kind, {}))
                for sample_name, labels, value in samples:
                    values[(sample_name, labels)] = values.get((sample_name, labels), 0.0) + value
        for name, (documentation, kind, values) in merged.items():
            family = Metric(name, documentation, kind)
            for (sample_name, labels), value in values.items():
                family.add_sample(sample_name, dict(labels), value)
            yield family

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)
