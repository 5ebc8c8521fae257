"""Trace-driven discrete-event simulator of multi-instance KV placement policies."""

from services.simulator.engine import (
    Events, InstanceProfile, SimulationConfig, SimulationResult, build_events, simulate,
)
from services.simulator.trace import Workload, load_trace, poisson_workload

__all__ = [
    "Events", "InstanceProfile", "SimulationConfig", "SimulationResult", "Workload", "build_events",
    "load_trace", "poisson_workload", "simulate",
]
