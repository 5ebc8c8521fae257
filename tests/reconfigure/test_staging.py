"""Staging (issue 12, first part): the target's shards are built while the router serves, before the freeze; the
ApplySwitch then only moves KV and swaps. A staging that fails changes nothing and never freezes the router."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.status import OperationState
from services.controller.transaction import Reconfigurer
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import TOKEN, generated_tokens

pytestmark = pytest.mark.multiprocess


class _Worker:
    """A worker stub that keeps its replies (and can fail its StageSwitch)."""

    def __init__(self, stub, fail_staging: bool = False) -> None:
        self._stub = stub
        self.fail_staging = fail_staging
        self.staged = self.applied = None

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def StageSwitch(self, request, **kwargs):  # noqa: N802
        if self.fail_staging:
            raise RuntimeError("staging refused by the test")
        self.staged = await self._stub.StageSwitch(request, **kwargs)
        return self.staged

    async def ApplySwitch(self, request, **kwargs):  # noqa: N802
        self.applied = await self._stub.ApplySwitch(request, **kwargs)
        return self.applied


def _reconfigurer(stack, workers) -> Reconfigurer:
    return Reconfigurer(stack.state, ModelSpec.from_dir(stack.cluster.model_dir), workers, stack.state.router_stub,
                        TOKEN)


async def test_the_apply_uses_the_staged_shards(live_stack, switch_checkpoint):
    engine = live_stack.engine
    workers = [_Worker(stub) for stub in live_stack.state.worker_stubs]
    reconfigurer = _reconfigurer(live_stack, workers)
    prompts = [[9, 4 * i + 3, 77, 12, 5] * (i + 2) for i in range(6)]
    tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"s{i}", tuple(p), 40)))
             for i, p in enumerate(prompts)]
    await until(lambda: engine.stats().num_generation_tokens >= 6 * 3, what="every request decoding")
    for target, active, duty in (("tp4pp1", 4, 1.0), ("tp1pp3", 3, 0.5), ("tp2pp2", 4, 1.0)):
        reconfigurer.staging_duty = duty  # 0.5: every worker rests as long as it builds (and pre-copies)
        operation = await reconfigurer.reconfigure(target)
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert operation.staging_seconds > 0 and "STAGING" in operation.phase_seconds
        assert operation.downtime_seconds == pytest.approx(sum(operation.phase_seconds.values())
                                                           - operation.staging_seconds
                                                           - operation.phase_seconds["DRAINING"])
        assert [w.staged.staged for w in workers] == [rank < active for rank in range(4)]
        rested = [w.staged.rested_seconds for w in workers[:active]]
        assert all(r > 0 for r in rested) if duty < 1 else not any(rested), rested
        assert [w.applied.used_staged for w in workers] == [rank < active for rank in range(4)]
        # Pre-copied: the target's runner was built over the staged pool while serving (no decode graphs on CPU).
        assert operation.precopy.endswith("rounds"), operation.precopy
        assert [w.applied.used_staged_runner for w in workers] == [rank < active for rank in range(4)]
        assert not any(w.applied.staged_graphs for w in workers)
    in_place = await reconfigurer.reconfigure("tp4pp1", strategy="in-place")  # the old way: no staging
    assert "STAGING" not in in_place.phase_seconds and not any(w.applied.used_staged for w in workers)
    assert (await reconfigurer.reconfigure("tp2pp2")).state is OperationState.SUCCEEDED
    expected, _ = hf_greedy(switch_checkpoint, prompts, 40)
    assert await asyncio.gather(*tasks) == expected


async def test_a_failed_staging_changes_nothing_and_never_freezes(live_stack, switch_checkpoint, monkeypatch):
    engine = live_stack.engine
    workers = [_Worker(stub, fail_staging=rank == 1) for rank, stub in enumerate(live_stack.state.worker_stubs)]
    reconfigurer = _reconfigurer(live_stack, workers)
    freezes = []
    freeze = engine.freeze

    async def counted_freeze(*args, **kwargs):
        freezes.append(args)
        return await freeze(*args, **kwargs)

    monkeypatch.setattr(engine, "freeze", counted_freeze)
    prompts = [[8, 3 * i + 1, 60, 7] * (i + 2) for i in range(4)]
    tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"f{i}", tuple(p), 30)))
             for i, p in enumerate(prompts)]
    await until(lambda: engine.stats().num_generation_tokens >= 4 * 3, what="every request decoding")
    operation = await reconfigurer.reconfigure("tp4pp1")
    assert operation.state is OperationState.ROLLED_BACK and "staging refused by the test" in operation.error
    assert set(operation.phase_seconds) == {"STAGING"} and operation.downtime_seconds == 0
    assert not freezes and not engine.stats().is_frozen and str(engine.topology) == "tp2pp2"
    monkeypatch.setattr(engine, "freeze", freeze)
    workers[1].fail_staging = False
    # What the other workers staged for tp4pp1 is not used by a switch to another target.
    operation = await reconfigurer.reconfigure("tp2pp1")
    assert operation.state is OperationState.SUCCEEDED and all(w.applied.used_staged for w in workers[:2])
    assert (await reconfigurer.reconfigure("tp2pp2")).state is OperationState.SUCCEEDED
    expected, _ = hf_greedy(switch_checkpoint, prompts, 30)
    assert await asyncio.gather(*tasks) == expected


async def test_a_switch_over_the_staging_budget_runs_in_place_and_the_plan_says_so(live_stack, switch_checkpoint):
    from services.controller.plan import plan_switch

    workers = [_Worker(stub) for stub in live_stack.state.worker_stubs]
    reconfigurer = _reconfigurer(live_stack, workers)
    reconfigurer.staging_budget_bytes = 1024  # far below any shard
    plan = await plan_switch(reconfigurer, "tp4pp1")
    assert not plan.stages and "over the staging budget of 0.0 MiB" in plan.staging_note
    operation = await reconfigurer.reconfigure("tp4pp1")
    assert operation.state is OperationState.SUCCEEDED, operation.error
    assert "STAGING" not in operation.phase_seconds and not any(w.applied.used_staged for w in workers)
    assert operation.staging.startswith("in-place: worker ") and "over the staging budget" in operation.staging
    reconfigurer.staging_budget_bytes = 1 << 30  # room enough
    plan = await plan_switch(reconfigurer, "tp2pp2")
    assert plan.stages and plan.staging_note == ""
    back = await reconfigurer.reconfigure("tp2pp2")
    assert back.state is OperationState.SUCCEEDED and back.staging == "staged" and "STAGING" in back.phase_seconds
