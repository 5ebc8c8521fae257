"""Invariant numerics through live switches (issue 39): 64 greedy bf16 streams carried through tp1pp1 -> tp2pp1 ->
tp1pp2 -> tp2pp2 are bitwise the tokens of the same requests served unswitched together, and of each served alone
(its first 32 tokens); a Qwen3-MoE model through tp4pp1 -> ep4pp1 -> tp4pp1 likewise."""

from __future__ import annotations

import pytest
import pytest_asyncio

from services.launch.cluster import ClusterConfig, LocalCluster
from tests.conftest import make_checkpoint
from tests.reconfigure.conftest import open_live_stack, serve_alone_together_and_switched

pytestmark = pytest.mark.multiprocess

NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def invariant_cluster(tmp_path_factory):
    """4 workers in bfloat16 with invariant numerics, starting in tp1pp1 (3 on standby)."""
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("invariant") / "llama-invariant", "llama", seed=7)
    config = ClusterConfig(model=str(checkpoint), num_workers=4, topology="tp1pp1", dtype="bfloat16",
                           numerics="invariant", kv_cache_bytes=4 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def stack(invariant_cluster):
    async with open_live_stack(invariant_cluster, leave_in="tp1pp1") as live:
        yield live


async def test_the_controller_reports_how_each_worker_computes(stack):
    from services.model import cpu_kernels

    workers = (await stack.state.refresh()).workers
    assert {(w.numerics, w.dtype, w.gemm) for w in workers} == {("invariant", "bfloat16",
                                                                 f"ordered ({cpu_kernels.kind()})")}


async def test_switches_change_no_token_of_64_bf16_streams(stack):
    alone, together, switched = await serve_alone_together_and_switched(stack, NUM_REQUESTS, ["tp2pp1", "tp1pp2",
                                                                                           "tp2pp2"], 32)
    assert [tokens[:32] for tokens in together] == alone
    assert switched == together
    assert len({tuple(tokens) for tokens in alone}) > NUM_REQUESTS // 2  # streams of their own, not one repeated


async def test_moe_switches_tp4_ep4_tp4_change_no_token_of_16_bf16_streams(tmp_path):
    """Qwen3-MoE (8 experts, layer 1 dense) in bf16, invariant: 16 greedy streams through tp4pp1 -> ep4pp1 ->
    tp4pp1 (experts whole per rank and attention data-parallel in ep4) equal the same requests together and alone."""
    checkpoint = make_checkpoint(tmp_path / "qwen3-moe", "qwen3_moe", seed=7)
    config = ClusterConfig(model=str(checkpoint), num_workers=4, topology="tp4pp1", dtype="bfloat16",
                           numerics="invariant", kv_cache_bytes=2 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        async with open_live_stack(cluster, leave_in=None) as live:
            alone, together, switched = await serve_alone_together_and_switched(live, 16, ["ep4pp1", "tp4pp1"], 16)
    assert [tokens[:16] for tokens in together] == alone
    assert switched == together
