"""The autopilot's Prometheus metrics, read from the Autopilot when scraped (no second copy of its state), served by
the controller on its metrics port (`/metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "reconfig:"


class AutopilotMetrics:
    """Counters the scrape cannot recompute: decisions by action, switches started by outcome."""

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {}
        self.switches: dict[str, int] = {}

    def observe(self, tick) -> None:
        self.decisions[tick.decision.action] = self.decisions.get(tick.decision.action, 0) + 1
        if tick.operation_id:
            outcome = tick.outcome.split(":", 1)[0] or "unknown"
            self.switches[outcome] = self.switches.get(outcome, 0) + 1


class AutopilotCollector:
    def __init__(self, autopilot) -> None:
        self.autopilot = autopilot

    def collect(self):
        pilot = self.autopilot
        mode = GaugeMetricFamily(PREFIX + "autopilot_mode", "The autopilot's mode (1 for the one in force).",
                                 labels=("mode",))
        for name in ("off", "advise", "auto"):
            mode.add_metric((name,), 1.0 if pilot.mode == name else 0.0)
        yield mode
        counts = pilot.metrics or AutopilotMetrics()
        decisions = CounterMetricFamily(PREFIX + "autopilot_decisions", "Policy decisions by action.",
                                        labels=("action",))
        for action in ("keep", "switch"):
            decisions.add_metric((action,), counts.decisions.get(action, 0))
        yield decisions
        switches = CounterMetricFamily(PREFIX + "autopilot_switches", "Switches the autopilot started, by outcome.",
                                       labels=("outcome",))
        for outcome, n in sorted(counts.switches.items()):
            switches.add_metric((outcome,), n)
        yield switches
        last = pilot.last
        recommended = GaugeMetricFamily(PREFIX + "autopilot_recommended_layout_info",
                                        "The layout the policy wants now (value always 1).", labels=("layout",))
        if last is not None:
            recommended.add_metric((last.decision.target,), 1.0)
        yield recommended
        load = GaugeMetricFamily(PREFIX + "autopilot_load", "Requests in flight the policy saw at its last tick.")
        load.add_metric((), float(last.observation.load) if last else 0.0)
        yield load
        forecast = GaugeMetricFamily(PREFIX + "autopilot_forecast_load",
                                     "Requests in flight forecast by the time a switch would end (0: no forecast).")
        forecast.add_metric((), float(last.observation.forecast_load or 0.0) if last else 0.0)
        yield forecast
        thresholds = GaugeMetricFamily(PREFIX + "autopilot_threshold_load",
                                       "The load that would trigger a switch to each layout (measured crossover).",
                                       labels=("layout",))
        if last is not None:
            for layout, value in sorted(last.decision.thresholds.items()):
                if value != float("inf"):
                    thresholds.add_metric((layout,), value)
        yield thresholds


def start_metrics_server(autopilot, host: str, port: int):
    """Serve /metrics in a daemon thread; returns (server, thread) (prometheus_client's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AutopilotCollector(autopilot))
    autopilot.metrics = autopilot.metrics or AutopilotMetrics()
    return start_http_server(port, addr=host, registry=registry)
