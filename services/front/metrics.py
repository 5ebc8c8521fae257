"""The front router's Prometheus metrics: instances served and in use, moves by outcome, KV moved, KV per
instance, instances the front started and stopped by itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.front.instances import Instance
from services.front.rates import FrontTotals
from services.front.route import Route

if TYPE_CHECKING:
    from services.front.autoscale import Autoscaler


class MeasuredFront(Protocol):
    """What the metrics read of the front (services.front.engine.FrontEngine, which calls front_metrics): declared
    here so that this module needs nothing of the engine's."""

    instances: list[Instance]
    totals: FrontTotals
    autoscaler: Autoscaler | None

    def in_use(self) -> list[Instance]: ...

    def requests_on(self, instance: Instance) -> list[Route]: ...


def front_metrics(front: MeasuredFront, labels: list[str], label_names: tuple[str, ...]) -> Iterator:
    """Read from the engine on every scrape."""
    gauge = GaugeMetricFamily("reconfig:front_instances_in_use", "Instances holding requests now.",
                              labels=label_names)
    gauge.add_metric(labels, len(front.in_use()))
    yield gauge
    served = GaugeMetricFamily("reconfig:front_instances", "Instances the front router serves (in use, standby or "
                               "drained).", labels=label_names)
    served.add_metric(labels, len(front.instances))
    yield served
    if front.autoscaler is not None:
        scaled = CounterMetricFamily("reconfig:front_instances_autoscaled", "Instances the front router started or "
                                     "stopped by itself.", labels=(*label_names, "action"))
        scaled.add_metric([*labels, "start"], front.autoscaler.started)
        scaled.add_metric([*labels, "stop"], front.autoscaler.stopped)
        yield scaled
    moves = CounterMetricFamily("reconfig:front_migrations", "Live request moves between instances, by outcome.",
                                labels=(*label_names, "outcome"))
    for outcome, count in front.totals.moves.items():
        moves.add_metric([*labels, outcome], count)
    yield moves
    drops = CounterMetricFamily("reconfig:front_migrations_dropped", "The policy's moves not started, by why: "
                                "moving, busy (max concurrent moves), no_room, disabled.",
                                labels=(*label_names, "reason"))
    for reason, count in sorted(front.totals.drops.items()):
        drops.add_metric([*labels, reason], count)
    yield drops
    waited = CounterMetricFamily("reconfig:front_migrations_waited_for_room", "Moves that waited for the moves out "
                                 "of their target to commit first (its room was still held by them).",
                                 labels=label_names)
    waited.add_metric(labels, front.totals.waited_for_room)
    yield waited
    moved = CounterMetricFamily("reconfig:front_migration_kv_bytes", "KV bytes moved between instances.",
                                labels=label_names)
    moved.add_metric(labels, front.totals.kv_bytes_moved)
    yield moved
    reprefilled = CounterMetricFamily("reconfig:front_migrations_reprefilled", "Moves that carried no KV: the "
                                      "target re-prefilled the request (chosen, or its KV unreachable).",
                                      labels=label_names)
    reprefilled.add_metric(labels, front.totals.reprefilled)
    yield reprefilled
    usage = GaugeMetricFamily("reconfig:front_instance_kv_tokens", "KV tokens the policy places on each "
                              "instance.", labels=(*label_names, "instance"))
    for instance in front.instances:
        tokens = sum(route.kv_tokens for route in front.requests_on(instance))
        usage.add_metric([*labels, instance.name], tokens)
    yield usage
