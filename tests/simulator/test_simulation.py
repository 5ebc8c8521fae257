"""The discrete-event engine: event generation, conservation, determinism, batching, the CLI."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import pytest

from services.placement import POLICY_NAMES
from services.simulator import cli
from services.simulator.engine import (
    ALLOCATE, DEPART, UPDATE, InstanceProfile, SimulationConfig, build_events, simulate,
)
from services.simulator.trace import Workload, poisson_workload

PROFILE = InstanceProfile(kv_capacity_tokens=4096, decode_tokens_per_s=50.0, prefill_tokens_per_s=2000.0,
                          block_size=16)


@pytest.fixture(scope="module")
def events():
    return build_events(poisson_workload(6.0, 600, 300, 120, seed=3), PROFILE)


def test_each_request_allocates_grows_block_by_block_then_departs():
    workload = Workload(np.array([0.0, 0.5, 1.0]), np.array([20, 16, 4000]), np.array([30, 1, 200]), "three")
    events = build_events(workload, PROFILE)
    assert events.num_rejected == 1  # 4,200 tokens exceed C = 4,096
    per_request = defaultdict(list)
    for t, kind, request, tokens in zip(events.time_s, events.kind, events.request, events.kv_tokens):
        per_request[request].append((t, kind, tokens))
    # 20 prompt tokens: 2 blocks at once; tokens 33 and 49 (generated tokens 13 and 29) open blocks 3
    # and 4, 13/50 and 29/50 s after a 0.01 s prefill; the 30th generated token ends the request.
    assert [(kind, tokens) for _, kind, tokens in per_request[0]] == [
        (ALLOCATE, 32), (UPDATE, 48), (UPDATE, 64), (DEPART, 0)]
    assert [t for t, _, _ in per_request[0]] == pytest.approx([0.0, 0.01 + 13 / 50, 0.01 + 29 / 50, 0.01 + 30 / 50])
    assert [(kind, tokens) for _, kind, tokens in per_request[1]] == [(ALLOCATE, 16), (DEPART, 0)]
    assert 2 not in per_request
    assert events.time_s == sorted(events.time_s)


def test_each_request_can_decode_at_its_own_measured_pace():
    """RequestTiming (a replay of measured requests): request 0 starts decoding at 0.2 s at 10 tokens/s, request 1
    would start before its arrival (it starts at its arrival), request 2 is rejected as before."""
    from services.simulator.events import RequestTiming

    workload = Workload(np.array([0.0, 0.5, 1.0]), np.array([20, 16, 4000]), np.array([30, 1, 200]), "three")
    timing = RequestTiming(np.array([0.2, 0.1, 1.0]), np.array([10.0, 5.0, 1.0]))
    events = build_events(workload, PROFILE, timing)
    per_request = defaultdict(list)
    for t, kind, request, tokens in zip(events.time_s, events.kind, events.request, events.kv_tokens):
        per_request[request].append((t, kind, tokens))
    assert [t for t, _, _ in per_request[0]] == pytest.approx([0.0, 0.2 + 13 / 10, 0.2 + 29 / 10, 0.2 + 30 / 10])
    assert [t for t, _, _ in per_request[1]] == pytest.approx([0.5, 0.5 + 1 / 5])
    assert events.num_rejected == 1 and events.time_s == sorted(events.time_s)
    with pytest.raises(ValueError, match="2 request timings for 3 requests"):
        build_events(workload, PROFILE, RequestTiming(np.array([0.0, 0.0]), np.array([1.0, 1.0])))
    with pytest.raises(ValueError, match="rate > 0"):
        RequestTiming(np.array([0.0]), np.array([0.0]))


def test_events_for_every_request_come_in_order(events):
    seen = {}
    for kind, request, tokens in zip(events.kind, events.request, events.kv_tokens):
        if kind == ALLOCATE:
            assert request not in seen
            seen[request] = tokens
        elif kind == UPDATE:
            assert tokens == seen[request] + PROFILE.block_size <= PROFILE.kv_capacity_tokens
            seen[request] = tokens
        else:
            assert seen.pop(request) > 0
    assert not seen
    assert events.num_admitted + events.num_rejected == 600


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_request_is_allocated_then_departs_and_all_instances_go_idle(events, name):
    result = simulate(name, events, SimulationConfig(profile=PROFILE))
    assert result.num_allocated == result.num_departed == events.num_admitted
    assert result.final_instances == 0 and result.num_unplaced == 0
    assert result.timeline[0][1] == 0 and result.timeline[-1][1] == 0
    assert 0 < result.mean_instances_lower_bound <= result.mean_instances <= result.peak_instances
    assert 0 < result.memory_utilization <= 1
    assert result.max_items_per_operation <= 10
    assert sum(result.migrations_by_reason.values()) == result.migrations


@pytest.mark.parametrize("name", ["mell", "lb"])
def test_a_run_is_deterministic(events, name):
    config = SimulationConfig(profile=PROFILE)
    first, second = simulate(name, events, config), simulate(name, events, config)
    assert (first.timeline, first.migrations, first.migrated_bytes) == (
        second.timeline, second.migrations, second.migrated_bytes)


def test_batched_windows_conserve_requests(events):
    result = simulate("mell", events, SimulationConfig(profile=PROFILE, batch_interval_s=0.25))
    assert result.num_allocated == result.num_departed
    assert result.num_allocated + result.num_unplaced == events.num_admitted
    assert result.final_instances == 0


def test_mell_needs_fewer_instances_than_the_baselines(events):
    config = SimulationConfig(profile=PROFILE)
    results = {name: simulate(name, events, config) for name in POLICY_NAMES}
    for name in ("bf", "wf", "lb"):
        assert results["mell"].mean_instances < results[name].mean_instances, name
    assert results["wf"].migrations_by_reason.keys() <= {"overflow"}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_prints_json_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "instances.png"
    args = _parse(["--poisson-rate", "4", "--num-requests", "200", "--kv-capacity", "4096", "--json",
                   "--plot", str(plot)])
    assert cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == set(POLICY_NAMES)
    assert cli.run(_parse(["--poisson-rate", "4", "--num-requests", "200", "--kv-capacity", "4096", "--json",
                           "--update-ms", "50"])) == 0
    periodic = json.loads(capsys.readouterr().out)
    assert periodic["policies"]["mell"]["final_instances"] == 0
    assert periodic["policies"]["mell"]["migrations"] != report["policies"]["mell"]["migrations"]
    assert report["policies"]["mell"]["final_instances"] == 0
    assert set(report["mell_fewer_instances_pct"]) == {"bf", "wf", "lb"}
    assert plot.stat().st_size > 10_000


def test_cli_table_for_one_policy_over_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:00:{i:02d}.5,{100 + 37 * i},{20 + i}\n" for i in range(40)))
    assert cli.run(_parse(["--trace", str(trace), "--policy", "bf", "--kv-capacity", "2048"])) == 0
    out = capsys.readouterr().out
    assert "trace.csv" in out and "\nbf " in out and "mell" not in out
    assert cli.run(_parse(["--trace", str(tmp_path / "missing.csv")])) == 2


def test_slow_links_make_the_migration_choice_re_prefill(events):
    slow = InstanceProfile(kv_capacity_tokens=4096, decode_tokens_per_s=50.0, prefill_tokens_per_s=2000.0,
                           link_bytes_per_s=100 * PROFILE.kv_bytes_per_token)  # 100 tokens of KV a second
    fast = simulate("mell", events, SimulationConfig(profile=PROFILE))
    result = simulate("mell", events, SimulationConfig(profile=slow))
    assert fast.migrations > 0 and fast.reprefill_tokens == 0
    assert result.reprefill_tokens > 0
    assert result.migrations == fast.migrations  # the choice changes how moves are made, not which


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_an_instance_cap_makes_requests_wait_and_every_one_still_departs(events, name):
    """With max_instances below what the load needs, no more instances are ever in use; requests that found no
    room wait (retried oldest first at departures) and run later by their wait; none is lost."""
    from services.placement.types import KVSchedulerConfig

    free = simulate(name, events, SimulationConfig(profile=PROFILE))
    assert free.peak_instances > 2 and free.num_waited == 0
    capped = simulate(name, events, SimulationConfig(
        profile=PROFILE, scheduler=KVSchedulerConfig(capacity=PROFILE.kv_capacity_tokens, max_instances=2)))
    assert capped.peak_instances <= 2
    assert capped.num_allocated == capped.num_departed == events.num_admitted and capped.final_instances == 0
    assert capped.num_waited > 0 and capped.mean_wait_s > 0 and capped.duration_s >= free.duration_s
    assert capped.mean_instances <= 2


def test_an_instance_cap_is_simulated_event_by_event():
    from services.placement.types import KVSchedulerConfig

    events = build_events(poisson_workload(2.0, 20, 100, 50, seed=1), PROFILE)
    with pytest.raises(ValueError, match="batch_interval_s"):
        simulate("mell", events, SimulationConfig(profile=PROFILE, batch_interval_s=0.25, scheduler=KVSchedulerConfig(
            capacity=PROFILE.kv_capacity_tokens, max_instances=2)))


def _front_tick_migrations(name: str, events, period: float) -> int:
    """The front router's loop, written out: arrivals and departures reach the policy when they happen, growth and
    the moves decided meanwhile at each period's end (one `grow` step draining them, coalesced)."""
    from services.placement import make_policy
    from services.placement.types import KVSchedulerConfig, Request

    policy = make_policy(name, KVSchedulerConfig(capacity=PROFILE.kv_capacity_tokens))
    grown: dict[str, int] = {}
    moved, first = 0, events.time_s[0]
    next_end = first + period
    for t, kind, request, kv_tokens in zip(events.time_s, events.kind, events.request, events.kv_tokens):
        if t >= next_end:
            moved += len(policy.grow([Request(r, n) for r, n in grown.items()]))
            grown.clear()
            next_end = first + ((t - first) // period + 1) * period
        rid = f"r{request}"
        if kind == UPDATE:
            grown[rid] = kv_tokens
        elif kind == DEPART:
            grown.pop(rid, None)
            policy.depart(rid)
        else:
            policy.allocate(rid, kv_tokens)
    return moved + len(policy.grow([]))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_per_period_moves_are_the_front_ticks(events, name):
    """With update_interval_s the simulator counts the moves a front router makes: those its policy decided during
    a period, made at the period's end and coalesced (a move and a move back within one period are none)."""
    period = 0.05
    simulated = simulate(name, events, SimulationConfig(profile=PROFILE, update_interval_s=period))
    assert simulated.migrations == _front_tick_migrations(name, events, period)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_move_of_a_request_that_ends_before_it_commits_is_not_made(events, name):
    """move_s: a move commits that long after the policy decided it; one whose request departs sooner is not made
    (pinned back on its source, as the front does). Moves that never finish in time: none is made."""
    instant = simulate(name, events, SimulationConfig(profile=PROFILE, update_interval_s=0.05))
    slow = simulate(name, events, SimulationConfig(profile=PROFILE, update_interval_s=0.05, move_s=2.0))
    never = simulate(name, events, SimulationConfig(profile=PROFILE, update_interval_s=0.05, move_s=1e9))
    assert instant.finished_first == 0 and instant.migrations > 0
    assert 0 < slow.finished_first and slow.migrations > 0
    assert never.migrations == 0 and never.finished_first > 0
    for result in (slow, never):
        assert result.num_allocated == result.num_departed == events.num_admitted and result.final_instances == 0
    with pytest.raises(ValueError, match="move_s"):
        simulate(name, events, SimulationConfig(profile=PROFILE, move_s=-1.0))


@pytest.mark.parametrize("name", ["mell", "bf", "lb"])  # (Worst-Fit hardly moves)
def test_moves_are_not_started_while_one_of_the_request_or_too_many_are_under_way(events, name):
    """As in the front: a move is not started while a move of the same request is under way ("moving") or while
    max_concurrent_moves are ("busy"); the policy has the request back on its source, and every request still ends."""
    def run(move_s: float, limit: int = 0):
        return simulate(name, events, SimulationConfig(profile=PROFILE, update_interval_s=0.05, move_s=move_s,
                                                       max_concurrent_moves=limit))

    long_moves, one_at_a_time, free = run(2.0), run(0.5, limit=1), run(0.5)
    assert long_moves.not_started.get("moving", 0) > 0 and "busy" not in long_moves.not_started
    assert one_at_a_time.not_started.get("busy", 0) > 0 and "busy" not in free.not_started
    assert one_at_a_time.migrations < free.migrations
    for result in (long_moves, one_at_a_time):
        assert result.num_allocated == result.num_departed == events.num_admitted and result.final_instances == 0
    with pytest.raises(ValueError, match="max_concurrent_moves"):
        run(0.5, limit=-1)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_growth_seen_once_per_policy_period_moves_only_at_its_end(events, name):
    """update_interval_s: arrivals and departures reach the policy at once, growth at the end of each period (as the
    front router's policy loop sees it): every change of the instances in use happens at an arrival, a departure or
    a period's end, every request departs, and a growth held when its request departs is dropped."""
    period = 0.05
    result = simulate(name, events, SimulationConfig(profile=PROFILE, update_interval_s=period))
    assert result.num_allocated == result.num_departed == events.num_admitted and result.final_instances == 0
    at_once = {t for t, kind in zip(events.time_s, events.kind) if kind != UPDATE}
    first = events.time_s[0]
    for t, _ in result.timeline[1:]:
        periods = (t - first) / period
        assert t in at_once or abs(periods - round(periods)) < 1e-6, t
    per_event = simulate(name, events, SimulationConfig(profile=PROFILE))
    assert result.timeline != per_event.timeline  # growth did wait for the period's end
    with pytest.raises(ValueError, match="update_interval_s"):
        simulate(name, events, SimulationConfig(profile=PROFILE, batch_interval_s=0.25, update_interval_s=period))
