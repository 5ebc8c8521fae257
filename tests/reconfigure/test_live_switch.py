"""Live reconfiguration with requests in flight: exact tokens, no re-prefill, refusals, idempotency."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from services.controller.status import OperationState
from services.controller.transaction import OperationBusy
from services.router.contracts import GenerationRequest
from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from services.topology import Topology, TopologyError
from services.worker.threads import threads_per_worker, usable_cores
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens

pytestmark = pytest.mark.multiprocess

# Same size with KV replication (4 ranks, 2 KV heads), shrink, grow into an uneven split, same size, grow.
CHAIN = ["tp4pp1", "tp2pp1", "tp1pp3", "tp1pp2", "tp2pp2"]


async def test_requests_in_flight_survive_a_chain_of_switches(live_stack, switch_checkpoint):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 30))] for _ in range(16)]
    lengths = [rng.randrange(70, 110) for _ in prompts]  # outlast the chain on a busy machine
    expected, _ = hf_greedy(switch_checkpoint, prompts, max(lengths))
    engine = live_stack.engine
    tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"r{i}", tuple(p), n)))
             for i, (p, n) in enumerate(zip(prompts, lengths))]
    await until(lambda: engine.stats().num_running == len(prompts), what="every request running before a switch")
    for target in CHAIN:
        before = {stream.address: stream for stream in engine.driver.streams}
        operation = await live_stack.reconfigurer.reconfigure(target)
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert str(engine.topology) == target
        # One micro-batch in flight per stage of the live layout: the start's pp is no floor (tp2pp2 -> tp4pp1).
        assert engine.num_inflight_batches == Topology.parse(target).pp, target
        # The step streams of workers active before and after carry on; the others end (in the background).
        streams = engine.driver.streams
        assert all(stream is before[stream.address] for stream in streams if stream.address in before), target
        dropped = [stream for stream in before.values() if stream not in streams]
        await until(lambda: not any(stream.is_open for stream in dropped), what="the dropped streams closed")
        assert sum(1 for t in tasks if not t.done()) > 0, "switch with nothing in flight proves nothing"
    outputs = await asyncio.gather(*tasks)
    for i, tokens in enumerate(outputs):
        assert tokens == expected[i][: lengths[i]], f"request {i}"
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert stats.extra["num_full_prefills"] == len(prompts)  # nobody was prefilled again


async def test_refusals_and_idempotency(live_stack):
    reconfigurer = live_stack.reconfigurer
    with pytest.raises(TopologyError, match="tp\\*pp=8 exceeds the 4 available workers"):
        await reconfigurer.reconfigure("tp4pp2")
    with pytest.raises(TopologyError, match="invalid topology 'tpXpp'"):
        await reconfigurer.reconfigure("tpXpp")
    same = await reconfigurer.reconfigure("tp2pp2", operation_id="noop")
    assert same.state is OperationState.SUCCEEDED and not same.phase_seconds  # nothing to do
    first = asyncio.ensure_future(reconfigurer.reconfigure("tp4pp1", operation_id="op-1"))
    await asyncio.sleep(0)
    with pytest.raises(OperationBusy, match="op-1"):
        await reconfigurer.reconfigure("tp2pp1", operation_id="op-2")
    retry = asyncio.ensure_future(reconfigurer.reconfigure("tp4pp1", operation_id="op-1"))
    done, again = await first, await retry
    assert done.state is OperationState.SUCCEEDED and again == done
    # staged with a KV pre-copy (the default)
    assert set(done.phase_seconds) == {"STAGING", "PRECOPY", "DRAINING", "QUIESCING", "PREPARING_WORKERS",
                                       "APPLYING_TOPOLOGY", "MIGRATING", "REBINDING"}
    assert done.phase_seconds["DRAINING"] == 0  # no step was in flight: the freeze held at once
    assert done.precopy.endswith("rounds")  # no request runs: nothing to copy, but the rounds ran
    back = await reconfigurer.reconfigure("tp2pp2")
    assert back.state is OperationState.SUCCEEDED


async def test_a_restarted_controller_recovers_the_live_layout(live_stack, tmp_path):
    import dataclasses

    from services.controller.state import ControllerState

    state_file = str(tmp_path / "controller-state.json")
    first = ControllerState(dataclasses.replace(live_stack.state.config, state_file=state_file))
    await first.open()
    first.record_operation(await live_stack.reconfigurer.reconfigure("tp4pp1", operation_id="before-restart"))
    await first.close()
    # A new controller process, started with the layout of the original command line (tp2pp2, now stale).
    restarted = ControllerState(dataclasses.replace(live_stack.state.config, topology="tp2pp2",
                                                    state_file=state_file))
    await restarted.open()
    try:
        await restarted.recover()
        assert str(restarted.topology) == "tp4pp1"  # from the workers
        assert restarted.last_operation.operation_id == "before-restart"  # from the state file
        assert restarted.last_operation.state is OperationState.SUCCEEDED
        assert restarted.status.topology == "tp4pp1"
    finally:
        await restarted.close()
    await live_stack.reconfigurer.reconfigure("tp2pp2")


async def test_workers_get_their_share_of_the_cores_after_each_switch(live_stack):
    """Threads = usable cores // active workers, set again by every switch; a standby keeps 1 (on 2 cores:
    tp1pp1 gives its worker both, tp2pp2 gives each of the 4 one)."""
    for target in ("tp1pp1", "tp2pp2"):
        operation = await live_stack.reconfigurer.reconfigure(target)
        assert operation.state is OperationState.SUCCEEDED, operation.error
        topology, threads = Topology.parse(target), []
        for address in live_stack.cluster.worker_addresses:
            async with grpc.aio.insecure_channel(address) as channel:
                info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
                threads.append(info.num_threads)
        assert threads == [threads_per_worker(usable_cores(), topology.num_workers, rank < topology.num_workers)
                           for rank in range(len(threads))], target


async def test_steps_ahead_in_flight_drain_into_a_switch_and_resume_after_it(live_stack, switch_checkpoint):
    """tp1pp1 sends its decodes a step ahead (async scheduling): a freeze drains both steps in flight, the switch
    out of tp1pp1 and back keeps every stream exact, and the decodes go ahead again once back in tp1pp1. (tp1pp1's
    cache holds about half of what the 12 requests grow to: some are preempted and prefill again meanwhile.)"""
    engine, reconfigurer = live_stack.engine, live_stack.reconfigurer
    assert (await reconfigurer.reconfigure("tp1pp1")).state is OperationState.SUCCEEDED
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 20))] for _ in range(12)]
    lengths = [rng.randrange(200, 230) for _ in prompts]
    expected, _ = hf_greedy(switch_checkpoint, prompts, max(lengths))
    tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"ahead-{i}", tuple(p), n)))
             for i, (p, n) in enumerate(zip(prompts, lengths))]
    await until(lambda: engine.stats().num_decodes_ahead > 2 * len(prompts), what="decodes sent ahead")
    for target in ("tp2pp1", "tp1pp1"):  # in place: the freeze starts at once, with both steps in flight
        assert any(not t.done() for t in tasks), "a switch with nothing in flight proves nothing"
        operation = await reconfigurer.reconfigure(target, strategy="in-place")
        assert operation.state is OperationState.SUCCEEDED, operation.error
    outputs = await asyncio.gather(*tasks)
    for i, tokens in enumerate(outputs):
        assert tokens == expected[i][: lengths[i]], f"request {i}"
    ahead = engine.stats().num_decodes_ahead
    assert await generated_tokens(engine, GenerationRequest("after", tuple(prompts[0]), 8)) == expected[0][:8]
    assert engine.stats().num_decodes_ahead > ahead  # tp1pp1 again: ahead again
    assert (await reconfigurer.reconfigure("tp2pp2")).state is OperationState.SUCCEEDED
