"""The freeze's drain: how long it waited before a request first waited for it (the router's FreezeResponse
drain_seconds; the controller reports that part as DRAINING, outside the downtime). Steps in flight still deliver
their tokens until the first of them comes back; a request outside every step waits from the freeze on.

The engine runs over a driver whose steps return when the test says, and the engine's clock is the test's (the waits
only let the engine's loop run: no time passes).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.contracts.step import SequenceOutput, StepOutput
from services.contracts.step_rows import RowEncoder
from services.router.config import SchedulerConfig
from services.router.engine import Engine
from tests.conftest import until
from tests.router.fakes import prompt_of, seq_of


class HeldSteps:
    """A driver whose steps stay in flight until finish(i): step i samples token 7 for each of its requests."""

    def __init__(self, topology: str = "tp1pp2", num_blocks: int = 32, block_size: int = 4) -> None:
        self.infos = [SimpleNamespace(topology=topology, num_kv_blocks=num_blocks)]
        self.num_kv_blocks, self.block_size, self.dp_size = num_blocks, block_size, 1
        self.steps: list[tuple[list, asyncio.Future]] = []
        self.rows = RowEncoder()  # what the engine tells the wire (nothing is encoded here)

    async def submit(self, sequences, commit_expert_map: int = 0) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.steps.append((list(sequences), future))
        return future

    def finish(self, index: int) -> None:
        sequences, future = self.steps[index]
        future.set_result(StepOutput(index, 0, tuple(SequenceOutput(s.request_id, 7) for s in sequences)))

    def worker_times(self):
        return ()

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def engine(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("services.router.engine.time.monotonic", clock)
    driver = HeldSteps()
    engine = Engine(driver, tokenizer=None, model_name="m", max_model_len=64,
                    scheduler_config=SchedulerConfig(max_model_len=64))
    await engine.start()
    yield engine, driver, clock
    for i, (_, future) in enumerate(driver.steps):
        if not future.done():
            driver.finish(i)
    await engine.stop()


async def _two_steps_in_flight(engine, driver) -> None:
    """Request a in step 0, then b in step 1 (tp1pp2: two micro-batches in flight)."""
    engine.scheduler.add(seq_of("a", prompt_of(0, 5), 8))
    engine.wake()
    await until(lambda: len(driver.steps) == 1, what="step 0 sent", interval_s=0)
    engine.scheduler.add(seq_of("b", prompt_of(1, 5), 8))
    engine.wake()
    await until(lambda: len(driver.steps) == 2, what="step 1 sent", interval_s=0)


async def test_the_drain_lasts_until_the_first_step_in_flight_comes_back(engine):
    engine, driver, clock = engine
    await _two_steps_in_flight(engine, driver)
    freezing = asyncio.ensure_future(engine.freeze(5))
    await until(lambda: engine.scheduler.is_frozen, what="the scheduler frozen", interval_s=0)
    clock.now = 100.4
    driver.finish(0)  # a's step: from now on a waits for the freeze
    await until(lambda: engine.scheduler.get("a").num_computed_tokens == 5, what="a's step done", interval_s=0)
    clock.now = 101.0
    driver.finish(1)
    assert await freezing == pytest.approx(0.4)
    assert len(driver.steps) == 2  # nothing was scheduled meanwhile
    assert await engine.freeze(5) == pytest.approx(0.4)  # a renewal of the lease keeps the first freeze's times
    engine.resume()
    clock.now = 102.0
    await until(lambda: len(driver.steps) == 3, what="step 2 sent", interval_s=0)
    assert await asyncio.wait_for(_freeze_when_done(engine, driver, clock), 5) == pytest.approx(0.5)


async def _freeze_when_done(engine, driver, clock) -> float:
    """A new freeze (after a resume) starts its own drain: step 2 comes back 0.5 s into it."""
    freezing = asyncio.ensure_future(engine.freeze(5))
    await until(lambda: engine.scheduler.is_frozen, what="the scheduler frozen", interval_s=0)
    clock.now = 102.5
    for i, (_, future) in enumerate(driver.steps):
        if not future.done():
            driver.finish(i)
    return await freezing


async def test_a_request_outside_every_step_waits_from_the_freeze_on(engine):
    engine, driver, clock = engine
    await _two_steps_in_flight(engine, driver)
    engine.scheduler.add(seq_of("c", prompt_of(2, 5), 8))  # waiting: both micro-batches are taken
    assert engine.scheduler.has_unscheduled()
    freezing = asyncio.ensure_future(engine.freeze(5))
    await until(lambda: engine.scheduler.is_frozen, what="the scheduler frozen", interval_s=0)
    clock.now = 100.7
    driver.finish(0)
    driver.finish(1)
    assert await freezing == 0.0


async def test_nothing_in_flight_holds_at_once(engine):
    engine, driver, _ = engine
    assert await engine.freeze(5) == 0.0
