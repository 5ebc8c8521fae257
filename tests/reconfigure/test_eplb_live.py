"""EPLB on a live expert-parallel stack: a skewed router (a few hot experts, all on one rank) gives a measured
balancedness; one rebalance, applied while requests decode, raises it to >= 0.85 with every output unchanged and no
request lost; a rank that fails to stage the map aborts the rebalance with the old map kept everywhere."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from pathlib import Path

import pytest

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.contracts import GenerationRequest
from services.router.expert_balance import ExpertBalanceAborted
from services.router.main import RouterConfig, build_engine
from services.topology.eplb import initial_phy2log
from tests.conftest import make_checkpoint, until
from tests.reconfigure.conftest import generated_tokens

pytestmark = pytest.mark.multiprocess

# The skewed-router workload lives with the benches that also use it (bench/skew.py); loaded from its file, as
# bench/ on sys.path would shadow packages named like its scripts.
_SKEW = importlib.util.spec_from_file_location("bench_skew", Path(__file__).resolve().parents[2] / "bench" / "skew.py")
_skew_module = importlib.util.module_from_spec(_SKEW)
_SKEW.loader.exec_module(_skew_module)
skew_router = _skew_module.skew_router

NUM_EXPERTS, NUM_REDUNDANT, EP = 8, 2, 2
_rng = random.Random(13)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(_rng.randrange(4, 24))] for _ in range(16)]
NUM_TOKENS = 24


def _hot_experts() -> list[int]:
    """The experts whose every copy sits on rank 0 in the map the workers start with: all load on one rank."""
    phy2log = initial_phy2log(NUM_EXPERTS, NUM_EXPERTS + NUM_REDUNDANT, EP)
    per_rank = len(phy2log) // EP
    return sorted(set(phy2log[:per_rank]) - set(phy2log[per_rank:]))


@pytest.fixture(scope="module")
def skewed_cluster(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("eplb") / "qwen3-moe-skewed", "qwen3_moe", seed=3)
    shares = skew_router(path, _hot_experts(), PROMPTS)
    assert min(shares.values()) >= 0.75, shares  # the workload really is skewed
    # The step (fault) rule: rank 1 fails the first staging after its copies, never inside a collective.
    config = ClusterConfig(model=str(path), num_workers=EP, topology=f"ep{EP}pp1", kv_cache_bytes=1 << 20,
                           block_size=4, num_redundant_experts=NUM_REDUNDANT, candidate_topologies=(f"ep{EP}pp1",),
                           faults="eplb:rank=1:once=1")
    with LocalCluster(config) as cluster:
        yield cluster


async def _round(engine, tag: str) -> list[asyncio.Future]:
    return [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"{tag}{i}", tuple(p), NUM_TOKENS)))
            for i, p in enumerate(PROMPTS)]


async def test_rebalance_under_skew_while_serving(skewed_cluster):
    engine = await build_engine(RouterConfig(worker_addresses=tuple(skewed_cluster.worker_addresses),
                                             model_dir=str(skewed_cluster.model_dir), model_name="eplb"))
    try:
        reference = await asyncio.gather(*await _round(engine, "a"))
        before = await engine.experts.status()
        assert before.expert_parallel and before.ep_size == EP
        assert before.balancedness < 0.7, before.balancedness  # the hot experts all live on rank 0
        maps_before = [tuple(layer.phy2log) for layer in before.layers]

        # A rank failing to stage: aborted everywhere, the old map stays, serving goes on.
        with pytest.raises(ExpertBalanceAborted, match="old expert map stays"):
            await engine.experts.rebalance()
        kept = await engine.experts.status()
        assert [tuple(layer.phy2log) for layer in kept.layers] == maps_before and kept.epoch == 0

        # The real one, while every request of the second round decodes.
        tasks = await _round(engine, "b")
        await until(lambda: engine.stats().num_running == len(PROMPTS), what="every request running")
        result = await engine.experts.rebalance()
        assert sum(not t.done() for t in tasks) > 0, "a rebalance with nothing in flight proves nothing"
        assert result.epoch == 1 and result.slots_changed > 0 and result.bytes_moved > 0
        assert result.balancedness_after >= 0.85 > result.balancedness_before
        assert await asyncio.gather(*tasks) == reference

        # Measured on the new map: the same workload again.
        assert await asyncio.gather(*await _round(engine, "c")) == reference
        after = await engine.experts.status()
        assert after.epoch == 1 and [tuple(layer.phy2log) for layer in after.layers] != maps_before
        assert after.balancedness >= 0.85, (before.balancedness, after.balancedness)
        stats = engine.stats()
        assert stats.num_preemptions == 0
        assert stats.extra["num_full_prefills"] == 3 * len(PROMPTS)
    finally:
        await engine.stop()
