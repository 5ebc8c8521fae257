"""Visibility of live reconfiguration on the live stack (real workers, engine, router and controller): WatchStatus
phase events, `reconfigctl reconfigure` / `plan` / `status`, and the switch metrics on the router's /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.contracts.phases import PHASES
from services.controller.plan import plan_switch
from services.controller.progress import PhaseDisplay, format_bytes
from services.controller.status import OperationState, OperationStatus
from services.controller.transaction import Reconfigurer
from services.ctl import main
from services.router.api import create_app
from services.router.contracts import GenerationRequest
from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc
from tests.conftest import until
from tests.reconfigure.conftest import TOKEN
from tests.reconfigure.helpers import reconfigctl_lines

live = pytest.mark.multiprocess


async def _reconfigctl(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))  # this loop keeps serving the controller and the router


def _start(engine, num_requests: int, prompt_len: int, max_tokens: int, tag: str) -> list[asyncio.Future]:
    async def run(i: int) -> list[int]:
        prompt = tuple(3 + (7 * i + 11 * j) % 250 for j in range(prompt_len))
        request = GenerationRequest(f"{tag}{i}", prompt, max_tokens)
        return [t for delta in [d async for d in engine.generate(request)] for t in delta.token_ids]

    return [asyncio.ensure_future(run(i)) for i in range(num_requests)]


async def _in_flight(engine, num_tokens: int) -> None:
    """Until the requests hold KV of their prompt and some output."""
    await until(lambda: engine.stats().num_generation_tokens >= num_tokens, timeout_s=120,
                what=f"{num_tokens} tokens generated")


def _prefix_length(op: controller_pb2.OperationStatus) -> int:
    """How many phases are closed; asserts they are a prefix of the transaction's phases, in order."""
    closed = set(op.phase_seconds)
    assert closed == set(PHASES[: len(closed)]), sorted(closed)
    return len(closed)


@live
async def test_watch_status_streams_every_phase_in_order(live_stack, controller):
    tasks = _start(live_stack.engine, 6, 20, 40, "w")
    await _in_flight(live_stack.engine, 6 * 3)
    metadata = auth_metadata(TOKEN)
    async with grpc.aio.insecure_channel(controller.address) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        watch = stub.WatchStatus(controller_pb2.WatchStatusRequest(interval_seconds=0.1), metadata=metadata)
        await watch.read()  # subscribed before the operation starts
        switch = asyncio.ensure_future(stub.Reconfigure(
            controller_pb2.ReconfigureRequest(topology="tp4pp1", operation_id="watch-1"), metadata=metadata))
        events = []
        while not events or events[-1].state == controller_pb2.OPERATION_STATE_RUNNING:
            status = await asyncio.wait_for(watch.read(), 30)
            if status.last_operation.operation_id == "watch-1":
                events.append(status.last_operation)
        watch.cancel()
        final = await switch
    assert events[-1] == final and final.state == controller_pb2.OPERATION_STATE_SUCCEEDED
    assert len(events) >= 3  # the phases arrive as they happen, not only at the end
    closed_before, running_seen = 0, []
    for event in events:
        closed = _prefix_length(event)
        assert closed >= closed_before  # phases only ever close, in order
        # A closed phase's time is final — except that APPLYING_TOPOLOGY and MIGRATING run in one worker RPC:
        # when it returns, the workers' own timing splits the pair (their sum stays as measured).
        pair = ("APPLYING_TOPOLOGY", "MIGRATING")
        for phase in PHASES[:closed]:
            if phase in pair and "MIGRATING" not in PHASES[:closed]:
                continue
            assert event.phase_seconds[phase] == final.phase_seconds[phase]
        if set(pair) <= set(PHASES[:closed]):
            assert sum(event.phase_seconds[p] for p in pair) == pytest.approx(sum(final.phase_seconds[p] for p in pair))
        if event.state == controller_pb2.OPERATION_STATE_RUNNING and event.phase:
            assert event.phase == PHASES[closed]  # the running phase is the next one
            if event.phase not in running_seen:
                running_seen.append(event.phase)
        closed_before = closed
    # The freeze runs as DRAINING; the router's answer splits off QUIESCING, the part requests waited for
    assert running_seen == sorted(running_seen, key=PHASES.index) and "DRAINING" in running_seen
    assert closed_before == len(PHASES) and not final.phase
    assert all(seconds >= 0 for seconds in final.phase_seconds.values())
    assert final.ended_at - final.started_at >= sum(final.phase_seconds.values()) > 0
    assert final.kv_bytes_moved > 0 and final.weight_bytes_loaded > 0
    assert str(live_stack.engine.topology) == "tp4pp1"
    assert (await live_stack.reconfigurer.reconfigure("tp2pp2")).state is OperationState.SUCCEEDED
    await asyncio.gather(*tasks)


@live
async def test_reconfigctl_reconfigure_wait_status_and_json(live_stack, controller, capsys):
    tasks = _start(live_stack.engine, 6, 20, 40, "c")
    await _in_flight(live_stack.engine, 6 * 3)
    code = await _reconfigctl("reconfigure", "tp4pp1", "--wait", "--operation-id", "cli-1", *controller.flags())
    captured = capsys.readouterr()
    assert code == 0, captured.err
    op = live_stack.state.last_operation
    assert op.operation_id == "cli-1" and op.state is OperationState.SUCCEEDED
    lines = reconfigctl_lines(captured.out)
    assert "\r" not in captured.out  # not a terminal: one line per phase, nothing rewritten
    assert lines[0] == "reconfigure tp2pp2 -> tp4pp1 (operation cli-1)"
    for line, phase in zip(lines[1:9], PHASES, strict=True):
        mark, name, seconds, unit = line.split()
        assert (mark, name, seconds, unit) == ("✓", phase, f"{op.phase_seconds[phase]:.3f}", "s")
    assert lines[9] == f"SUCCEEDED: tp2pp2 -> tp4pp1 is live after {op.downtime_seconds:.3f} s of downtime"
    serving = op.phase_seconds["STAGING"] + op.phase_seconds["PRECOPY"]
    assert op.downtime_seconds == pytest.approx(sum(op.phase_seconds.values()) - serving
                                                - op.phase_seconds["DRAINING"])
    assert op.staging_seconds == pytest.approx(serving)
    assert lines[10] == (f"  staged {op.staging_seconds:.3f} s while serving; KV pre-copied "
                        f"{format_bytes(op.kv_bytes_precopied)} ({op.precopy}) while serving; downtime "
                        f"{op.downtime_seconds:.3f} s; KV delta moved {format_bytes(op.kv_bytes_moved)}; "
                        f"weights loaded {format_bytes(op.weight_bytes_loaded)}; requests preempted 0")
    assert op.kv_bytes_precopied > 0 and op.kv_bytes_moved > 0 and len(lines) == 11

    assert await _reconfigctl("status", *controller.flags()) == 0
    status_lines = reconfigctl_lines(capsys.readouterr().out)
    start = next(i for i, line in enumerate(status_lines) if line.startswith("last operation: reconfigure cli-1"))
    for line, phase in zip(status_lines[start + 1:start + 9], PHASES, strict=True):
        name, seconds, unit, share, bar = line.split(maxsplit=4)
        assert (name, seconds, unit) == (phase, f"{op.phase_seconds[phase]:.3f}", "s")
        if phase in ("STAGING", "PRECOPY", "DRAINING"):  # no request waited: no share of the downtime
            assert (share, bar) == ("while", "serving")
        else:
            assert share == f"{op.phase_seconds[phase] / op.downtime_seconds:.0%}"
    assert status_lines[start + 9] == lines[10]

    assert await _reconfigctl("reconfigure", "tp2pp2", "--json", *controller.flags()) == 0  # no --wait
    back = json.loads("\n".join(reconfigctl_lines(capsys.readouterr().out)))
    assert (back["state"], back["from_topology"], back["to_topology"]) == ("SUCCEEDED", "tp4pp1", "tp2pp2")
    assert set(back["phase_seconds"]) == set(PHASES) and back["kv_bytes_moved"] > 0
    assert OperationStatus.from_pb(live_stack.state.last_operation.to_pb()).to_json() == back
    await asyncio.gather(*tasks)


@live
async def test_reconfigctl_refusals_busy_and_idempotent_retry(live_stack, controller, capsys, monkeypatch):
    assert await _reconfigctl("reconfigure", "tp4pp2", *controller.flags()) == 2
    assert "refused (INVALID_ARGUMENT): " in capsys.readouterr().err
    assert await _reconfigctl("plan", "tp3pp1", *controller.flags()) == 2
    assert "refused (INVALID_ARGUMENT): " in capsys.readouterr().err

    engine, gate = live_stack.engine, asyncio.Event()
    rebind, failed = engine.rebind, []

    async def failing_rebind(num_kv_blocks, *args):  # fails once
        if not failed:
            failed.append(num_kv_blocks)
            raise RuntimeError("rebind refused by the test")
        return await rebind(num_kv_blocks, *args)

    monkeypatch.setattr(engine, "rebind", failing_rebind)
    assert await _reconfigctl("reconfigure", "tp4pp1", "--operation-id", "rb-1", *controller.flags()) == 1
    captured = capsys.readouterr()
    assert "reconfigctl reconfigure: operation rb-1 ROLLED_BACK: " in captured.err
    assert "rebind refused by the test" in captured.err
    outcome = reconfigctl_lines(captured.out)  # the controller's log of the failure shares stdout
    start = next(i for i, line in enumerate(outcome) if line.startswith("ROLLED_BACK: tp2pp2 -> tp4pp1; error: "))
    assert "rebind refused by the test" in outcome[start]
    assert [line.split()[0] for line in outcome[start + 1:start + 7]] == ["STAGING", "PRECOPY", "DRAINING",
                                                                           "QUIESCING", "PREPARING_WORKERS", "staged"]
    assert str(live_stack.state.topology) == "tp2pp2" and not engine.stats().is_frozen  # the old layout serves
    monkeypatch.setattr(engine, "rebind", rebind)

    freeze = engine.freeze

    async def held_freeze(timeout_s: float = 60.0, lease_s: float = 0.0) -> float:  # holds DRAINING until the gate
        await gate.wait()
        return await freeze(timeout_s, lease_s)

    monkeypatch.setattr(engine, "freeze", held_freeze)
    asked, answered, reconfigure = [], [], Reconfigurer.reconfigure

    async def recorded(self, topology: str, operation_id: str = "", *args, **kwargs):  # the controller's calls
        asked.append(operation_id)
        try:
            return await reconfigure(self, topology, operation_id, *args, **kwargs)
        finally:
            answered.append(operation_id)

    monkeypatch.setattr(Reconfigurer, "reconfigure", recorded)
    first = asyncio.ensure_future(_reconfigctl("reconfigure", "tp4pp1", "--wait", "--operation-id", "busy-1",
                                               *controller.flags()))
    await until(lambda: live_stack.state.last_operation is not None
                and live_stack.state.last_operation.operation_id == "busy-1", timeout_s=120, what="busy-1 running")
    assert await _reconfigctl("reconfigure", "tp2pp1", "--operation-id", "busy-2", *controller.flags()) == 2
    refusal = capsys.readouterr()  # also what busy-1's --wait drew so far (STAGING, maybe PRECOPY)
    assert "refused (FAILED_PRECONDITION): operation 'busy-1' is running" in refusal.err
    retry = asyncio.ensure_future(_reconfigctl("reconfigure", "tp4pp1", "--operation-id", "busy-1", "--json",
                                               *controller.flags()))
    await until(lambda: asked.count("busy-1") == 2, what="the retry of busy-1 to reach the controller")
    assert "busy-1" not in answered  # the retry joined busy-1, which the gate holds in DRAINING
    assert not first.done() and not retry.done()
    gate.set()
    assert await first == 0 and await retry == 0
    out = "\n".join(reconfigctl_lines(capsys.readouterr().out))
    joined = json.loads(out[out.index("{"):out.rindex("}") + 1])  # the retry's JSON: the same operation
    assert joined == live_stack.state.last_operation.to_json() and joined["state"] == "SUCCEEDED"
    drawn = "\n".join(reconfigctl_lines(refusal.out)) + "\n" + out  # busy-1's progress, before and after the refusal
    for phase in PHASES:
        assert f"✓ {phase}" in drawn


@live
async def test_reconfigctl_plan_table_and_json(live_stack, controller, capsys):
    tasks = _start(live_stack.engine, 4, 20, 40, "p")
    await _in_flight(live_stack.engine, 4 * 3)
    await live_stack.engine.freeze()  # the blocks in use stay put between the three looks at the plan
    try:
        assert await _reconfigctl("plan", "tp2pp1", "--json", *controller.flags()) == 0
        planned = json.loads("\n".join(reconfigctl_lines(capsys.readouterr().out)))
        assert await _reconfigctl("plan", "tp2pp1", *controller.flags()) == 0
        table = reconfigctl_lines(capsys.readouterr().out)
        expected = await plan_switch(live_stack.reconfigurer, "tp2pp1")
    finally:
        live_stack.engine.resume()
    assert planned["from_topology"] == "tp2pp2" and planned["to_topology"] == "tp2pp1"
    assert planned["num_used_blocks"] == expected.num_used_blocks > 0
    assert [w["kv_bytes_in"] for w in planned["workers"]] == [w.kv_bytes_in for w in expected.workers]
    assert [w["state_after"] for w in planned["workers"]] == ["ACTIVE", "ACTIVE", "STANDBY", "STANDBY"]
    assert sum(w["kv_bytes_in"] for w in planned["workers"]) > 0 and planned["fits"] and planned["is_candidate"]
    assert table[0].split() == ["plan:", "tp2pp2", "->", "tp2pp1", "KV", "blocks", "in", "use:",
                                str(expected.num_used_blocks), "blocks", "per", "worker", "after:",
                                str(expected.num_kv_blocks_after), "fits:", "yes", "candidate:", "yes"]
    assert table[2].split() == ["RANK", "STATE", "KV", "IN", "KV", "LOCAL", "WEIGHTS", "LOAD", "WEIGHTS", "KEEP",
                                "PEAK", "EXTRA", "BLOCKS", "AFTER"]
    for rank, line in enumerate(table[3:7]):
        w = expected.workers[rank]
        assert line.split() == [str(rank), w.state_before, "->", w.state_after,
                                *format_bytes(w.kv_bytes_in).split(), *format_bytes(w.kv_bytes_local).split(),
                                *format_bytes(w.weight_bytes_load).split(), *format_bytes(w.weight_bytes_keep).split(),
                                *format_bytes(w.peak_extra_bytes).split(), str(w.num_kv_blocks_after)]
    total_in = format_bytes(sum(w.kv_bytes_in for w in expected.workers))
    assert table[7].split()[:3] == ["total", *total_in.split()]
    assert str(live_stack.state.topology) == "tp2pp2"  # planning changed nothing
    await asyncio.gather(*tasks)


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


async def _scrape(client: httpx.AsyncClient) -> dict:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return _samples(response.text)


@live
async def test_metrics_after_switches_with_preemption_and_rollback(live_stack, monkeypatch):
    engine, reconfigurer = live_stack.engine, live_stack.reconfigurer
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        before = await _scrape(client)
        assert _value(before, "reconfig:switches_total", state="SUCCEEDED") == 0
        assert _value(before, "reconfig:switch_seconds_count") == 0
        assert _value(before, "reconfig:topology_info", topology="tp2pp2") == 1

        # A shrink whose capacity is below the live blocks: the newest requests are preempted.
        capacity = (await plan_switch(reconfigurer, "tp2pp1")).num_kv_blocks_after
        prompt_len, max_tokens, block_size = 180, 70, 4
        blocks_each = math.ceil((prompt_len + 4) / block_size)
        num_requests = capacity // blocks_each + 2
        assert num_requests * math.ceil((prompt_len + max_tokens) / block_size) <= engine.stats().num_kv_blocks_total
        tasks = _start(engine, num_requests, prompt_len, max_tokens, "m")
        await until(lambda: engine.stats().num_kv_blocks_used > capacity, timeout_s=120,
                    what="more KV used than the target holds")
        shrink = await reconfigurer.reconfigure("tp2pp1", operation_id="metrics-1")
        assert shrink.state is OperationState.SUCCEEDED and shrink.num_requests_preempted > 0
        after = await _scrape(client)
        report = engine.switch_totals().last
        assert report.operation_id == "metrics-1" and report.state == "SUCCEEDED"
        assert _value(after, "reconfig:switches_total", state="SUCCEEDED") == 1
        assert _value(after, "reconfig:switches_total", state="ROLLED_BACK") == 0
        for phase in PHASES:
            assert _value(after, "reconfig:switch_phase_seconds_count", phase=phase) == 1
            seconds = _value(after, "reconfig:switch_phase_seconds_sum", phase=phase)
            assert seconds == pytest.approx(report.phase_seconds[phase])
            if phase != "REBINDING":  # the report is sent on the Resume, inside REBINDING
                assert seconds == pytest.approx(shrink.phase_seconds[phase])
        assert 0 < report.phase_seconds["REBINDING"] <= shrink.phase_seconds["REBINDING"]
        downtime = _value(after, "reconfig:switch_cutover_seconds_sum")
        assert _value(after, "reconfig:switch_cutover_seconds_count") == 1
        assert downtime == pytest.approx(report.downtime_seconds) and 0 < downtime <= shrink.downtime_seconds
        assert _value(after, "reconfig:switch_seconds_count") == 1  # the whole switch: staging and pre-copy too
        assert _value(after, "reconfig:switch_seconds_sum") == pytest.approx(sum(report.phase_seconds.values()))
        assert _value(after, "reconfig:switch_seconds_sum") > downtime
        assert _value(after, "reconfig:last_switch_seconds") == pytest.approx(downtime)
        # The KV moved in the freeze (the pre-copy's delta): none when every request holding an id past the new
        # capacity was preempted
        assert _value(after, "reconfig:kv_migrated_bytes_total") == shrink.kv_bytes_moved
        assert _value(after, "reconfig:kv_precopied_bytes_total") == shrink.kv_bytes_precopied > 0
        assert _value(after, "reconfig:weight_loaded_bytes_total") == shrink.weight_bytes_loaded > 0
        assert _value(after, "reconfig:switch_preempted_requests_total") == shrink.num_requests_preempted
        assert _value(after, "reconfig:topology_info", topology="tp2pp1") == 1
        assert not any(n == "reconfig:topology_info" and ("topology", "tp2pp2") in ls for n, ls in after)
        await asyncio.gather(*tasks)  # the preempted requests re-prefill and finish too

        # A switch that fails before the workers move: rolled back, counted as such, the old layout serves on.
        rebind, failed = engine.rebind, []

        async def failing_rebind(num_kv_blocks, *args):
            if not failed:
                failed.append(num_kv_blocks)
                raise RuntimeError("rebind refused by the test")
            return await rebind(num_kv_blocks, *args)

        monkeypatch.setattr(engine, "rebind", failing_rebind)
        rolled = await reconfigurer.reconfigure("tp4pp1", operation_id="metrics-2")
        monkeypatch.setattr(engine, "rebind", rebind)
        assert rolled.state is OperationState.ROLLED_BACK and "rebind refused by the test" in rolled.error
        grow = await reconfigurer.reconfigure("tp2pp2", operation_id="metrics-3")
        assert grow.state is OperationState.SUCCEEDED
        final = await _scrape(client)
        assert _value(final, "reconfig:switches_total", state="SUCCEEDED") == 2
        assert _value(final, "reconfig:switches_total", state="ROLLED_BACK") == 1
        assert _value(final, "reconfig:switch_seconds_count") == 3
        assert _value(final, "reconfig:switch_phase_seconds_count", phase="QUIESCING") == 3
        assert _value(final, "reconfig:switch_phase_seconds_count", phase="MIGRATING") == 2  # not the rolled back
        assert _value(final, "reconfig:kv_migrated_bytes_total") == shrink.kv_bytes_moved + grow.kv_bytes_moved
        assert _value(final, "reconfig:topology_info", topology="tp2pp2") == 1
        assert engine.switch_totals().last.operation_id == "metrics-3"


class _Terminal(io.StringIO):
    """A stream that says it is a terminal; `screen()` is what a terminal would show after the writes."""

    encoding = "utf-8"

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        lines, line, cursor = [], [], 0
        for char in self.getvalue():
            if char == "\n":
                lines.append("".join(line).rstrip())
                line, cursor = [], 0
            elif char == "\r":
                cursor = 0
            else:
                line[cursor:cursor + 1] = [char]
                cursor += 1
        return lines + (["".join(line).rstrip()] if "".join(line).strip() else [])


def test_terminal_display_rewrites_the_running_phase_in_place():
    clock = [0.0]
    terminal = _Terminal()
    display = PhaseDisplay(terminal, clock=lambda: clock[0])
    op = OperationStatus("op-9", "reconfigure", OperationState.RUNNING, 1.0, from_topology="tp2pp2",
                         to_topology="tp4pp1")
    closed = {"QUIESCING": 0.12, "PREPARING_WORKERS": 0.05, "APPLYING_TOPOLOGY": 0.0}
    for seconds, phase, phase_seconds in [(0.0, "", {}), (0.0, "QUIESCING", {}), (0.1, "QUIESCING", {}),
                                          (0.2, "MIGRATING", closed), (1.5, "MIGRATING", closed)]:
        clock[0] = seconds
        display.update(dataclasses.replace(op, phase=phase, phase_seconds=phase_seconds))
        if phase == "MIGRATING" and seconds == 1.5:
            assert terminal.screen()[-1].split()[1:4] == ["MIGRATING", "1.3", "s"]  # seconds since it started
    assert terminal.getvalue().count("QUIESCING") == 3  # drawn running twice, then once done
    done = dataclasses.replace(op, state=OperationState.SUCCEEDED, ended_at=3.0, kv_bytes_moved=3 << 20,
                               weight_bytes_loaded=5 << 20, num_requests_preempted=2,
                               phase_seconds={**closed, "MIGRATING": 1.4, "REBINDING": 0.02})
    display.finish(done)
    assert terminal.screen() == [
        "reconfigure tp2pp2 -> tp4pp1 (operation op-9)",
        "  ✓ QUIESCING             0.120 s",
        "  ✓ PREPARING_WORKERS     0.050 s",
        "  ✓ APPLYING_TOPOLOGY     0.000 s",
        "  ✓ MIGRATING             1.400 s",
        "  ✓ REBINDING             0.020 s",
        "SUCCEEDED: tp2pp2 -> tp4pp1 is live after 1.590 s of downtime",
        "  downtime 1.590 s; KV moved 3.0 MiB; weights loaded 5.0 MiB; requests preempted 2",
    ]
