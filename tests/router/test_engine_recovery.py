"""The engine when a worker dies (kill -9): it stalls instead of failing, survives a rebind to new workers with
the oracle's tokens, fails its requests when nobody recovers it in time, and a freeze's lease runs out."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.api.metrics import ApiMetrics
from services.router.contracts import GenerationRequest
from services.router.driver import Driver
from services.router.engine import Engine
from services.router.main import RouterConfig, build_engine
from tests.conftest import hf_greedy, until

pytestmark = pytest.mark.multiprocess

MAX_TOKENS = 40


@contextmanager
def _one_worker(checkpoint, kv_cache_bytes: int = 1 << 20) -> Iterator[LocalCluster]:
    """A one-worker tp1pp1 cluster (the smallest world a kill -9 can break)."""
    with LocalCluster(ClusterConfig(model=str(checkpoint), num_workers=1, kv_cache_bytes=kv_cache_bytes,
                                    block_size=4)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def healthy_cluster(serving_checkpoint):
    """Workers nobody kills: the survivors a recovery rebinds to, and the lease test's."""
    with _one_worker(serving_checkpoint, kv_cache_bytes=3 << 18) as cluster:
        yield cluster


async def _engine(cluster: LocalCluster, recovery_timeout_s: float) -> Engine:
    return await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                           model_dir=str(cluster.model_dir), recovery_timeout_s=recovery_timeout_s))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 160) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


async def _collect(engine: Engine, request: GenerationRequest):
    deltas = [d async for d in engine.generate(request)]
    return [t for d in deltas for t in d.token_ids], deltas[-1]


def _start(engine: Engine, prompts: list[list[int]], prefix: str = "r") -> list[asyncio.Future]:
    return [asyncio.ensure_future(_collect(engine, GenerationRequest(f"{prefix}{i}", tuple(p), MAX_TOKENS)))
            for i, p in enumerate(prompts)]


async def _kill_when_generating(engine: Engine, cluster: LocalCluster, num_requests: int) -> None:
    """SIGKILL the worker once every request has some tokens (and none can have finished)."""
    await until(lambda: engine.num_generation_tokens >= 2 * num_requests)
    os.kill(cluster.worker_pids[0], signal.SIGKILL)


async def _capacity(addresses: list[str]) -> int:
    async with Driver(addresses) as driver:
        return driver.num_kv_blocks


async def test_a_killed_worker_stalls_the_engine_and_a_rebind_to_new_workers_recovers_it(
        serving_checkpoint, healthy_cluster):
    prompts = _prompts(8, seed=5)
    expected, _ = hf_greedy(serving_checkpoint, prompts, MAX_TOKENS)
    with _one_worker(serving_checkpoint) as doomed:
        engine = await _engine(doomed, recovery_timeout_s=30)
        try:
            tasks = _start(engine, prompts)
            await _kill_when_generating(engine, doomed, len(prompts))
            await until(lambda: engine.stats().stalled != "")
            stalled = engine.stats()
            assert "failed" in stalled.stalled and stalled.is_frozen and stalled.extra["num_step_errors"] >= 1
            assert stalled.num_running == len(prompts) and not any(task.done() for task in tasks)
            assert engine.num_full_prefills == len(prompts)
            assert 'reconfig:router_stalled{model_name="m"} 1.0' in ApiMetrics(engine, "m").render()[0].decode()
            # What the controller does: freeze, rebind to the survivors (their caches are empty), resume.
            await engine.freeze(5)
            capacity = await _capacity(healthy_cluster.worker_addresses)
            await engine.rebind(capacity, tuple(healthy_cluster.worker_addresses), drop_kv=True)
            assert engine.stats().num_preemptions == len(prompts) == engine.stats().num_waiting
            engine.resume()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert [tokens for tokens, _ in results] == expected
            assert {last.finish_reason for _, last in results} == {"length"}
            stats = engine.stats()
            assert stats.stalled == "" and not stats.is_frozen and stats.num_kv_blocks_total == capacity
            assert (stats.num_running, stats.num_kv_blocks_used) == (0, 0)
            assert engine.num_full_prefills == 2 * len(prompts)  # each request re-prefilled once, on the new workers
        finally:
            await engine.stop()


async def test_without_a_recovery_the_requests_fail_after_the_timeout_and_the_engine_lives_on(serving_checkpoint):
    with _one_worker(serving_checkpoint) as doomed:
        engine = await _engine(doomed, recovery_timeout_s=1)
        try:
            tasks = _start(engine, _prompts(4, seed=6))
            await _kill_when_generating(engine, doomed, len(tasks))
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            # Ended by the 1 s recovery timeout: not before it, and well before the 20 s collective timeout or the
            # 60 s default (the slack is for noticing the kill on a busy machine).
            assert 0.9 < time.monotonic() - killed < 10
            for tokens, last in results:
                assert last.finish_reason == "error" and 0 < len(tokens) < MAX_TOKENS
                assert last.error.startswith("the workers failed (") and "not recovered within 1 s" in last.error
            stats = engine.stats()
            assert engine.is_ready and stats.stalled == "" and not stats.is_frozen
            assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)

            # A new request finds the workers still broken: it stalls again (bounded by the same timeout). A
            # stall that times out while the controller holds a freeze leaves the router frozen.
            num_step_errors = stats.extra["num_step_errors"]
            (task,) = _start(engine, _prompts(1, seed=7), prefix="late")
            await until(lambda: engine.stats().stalled != "")
            await engine.freeze(5)
            tokens, last = await asyncio.wait_for(task, 5)
            assert (tokens, last.finish_reason) == ([], "error")
            stats = engine.stats()
            assert stats.is_frozen and stats.stalled == "" and stats.extra["num_step_errors"] == num_step_errors + 1
            engine.resume()
            assert not engine.stats().is_frozen and engine.is_ready
        finally:
            await engine.stop()


async def test_without_a_recovery_timeout_a_failed_step_fails_its_requests_at_once(serving_checkpoint):
    with _one_worker(serving_checkpoint) as doomed:
        engine = await _engine(doomed, recovery_timeout_s=0)
        try:
            tasks = _start(engine, _prompts(4, seed=8))
            await _kill_when_generating(engine, doomed, len(tasks))
            results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
            for _, last in results:
                assert last.finish_reason == "error" and "stream failed" in last.error
            stats = engine.stats()
            assert stats.stalled == "" and not stats.is_frozen and engine.is_ready
            assert (stats.num_running, stats.num_kv_blocks_used) == (0, 0)
        finally:
            await engine.stop()


async def test_a_freeze_whose_lease_runs_out_resumes_by_itself(healthy_cluster, serving_checkpoint):
    prompt = _prompts(1, seed=9)
    expected, _ = hf_greedy(serving_checkpoint, prompt, MAX_TOKENS)
    engine = await _engine(healthy_cluster, recovery_timeout_s=30)
    try:
        await engine.freeze(5, lease_s=0.3)
        await engine.freeze(5, lease_s=0)  # another freeze replaces the lease: none now
        (task,) = _start(engine, prompt)
        await until(lambda: engine.stats().num_waiting == 1, what="the request queued behind the freeze")
        await asyncio.sleep(0.5)  # not synchronisation: past the replaced 0.3 s lease, which must not resume
        assert engine.stats().is_frozen and engine.stats().num_waiting == 1
        await engine.freeze(5, lease_s=0.3)
        tokens, last = await asyncio.wait_for(task, 10)  # no resume() call
        assert tokens == expected[0] and last.finish_reason == "length"
        assert not engine.stats().is_frozen
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="lease_s"):
                await engine.freeze(5, lease_s=bad)
    finally:
        await engine.stop()
