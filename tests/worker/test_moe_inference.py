"""MoE models sharded across real worker processes equal transformers: experts split by TP (their intermediate
dimension) or by EP (whole experts per rank, data-parallel attention, all-to-all dispatch), with redundant slots."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.driver import Driver
from services.launch.generate import generate
from services.model.spec import ModelSpec
from services.topology import Topology, place
from tests.conftest import hf_greedy, make_checkpoint

pytestmark = pytest.mark.multiprocess

# Five prompts: with ep4 one DP rank gets two requests, and the ranks' token counts differ every step.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], list(range(20, 41)), [150, 7, 99, 12, 3], [42, 17]]
NUM_NEW_TOKENS = 12
LOGITS_ATOL = 1e-4

# (style, workers, topology, redundant experts)
LAYOUTS = [
    ("qwen3_moe", 1, "tp1pp1", 0),
    ("qwen3_moe", 2, "tp2pp1", 0),
    ("qwen3_moe", 4, "tp4pp1", 0),
    ("qwen3_moe", 2, "ep2pp1", 0),
    ("qwen3_moe", 4, "ep4pp1", 0),
    ("qwen3_moe", 4, "ep2pp2", 0),
    ("qwen3_moe", 2, "ep2pp1", 2),  # 10 physical slots for 8 experts: two hot-spare copies
    ("mixtral", 2, "tp2pp1", 0),
    ("mixtral", 4, "ep4pp1", 4),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {style: make_checkpoint(tmp_path_factory.mktemp(f"moe-{style}"), style)
            for style in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="module")
def oracles(checkpoints):
    return {style: hf_greedy(path, PROMPTS, NUM_NEW_TOKENS) for style, path in checkpoints.items()}


async def _generate(addresses: list[str]):
    async with Driver(addresses) as driver:
        return await generate(driver, PROMPTS, NUM_NEW_TOKENS, return_logits=True), driver.infos


@pytest.mark.parametrize("style,num_workers,topology,redundant", LAYOUTS,
                         ids=[f"{s}-{t}-r{r}" for s, _, t, r in LAYOUTS])
def test_moe_generation_matches_transformers(checkpoints, oracles, style, num_workers, topology, redundant):
    ref_tokens, ref_logits = oracles[style]
    config = ClusterConfig(model=str(checkpoints[style]), num_workers=num_workers, topology=topology,
                           kv_cache_bytes=1 << 20, block_size=4, num_redundant_experts=redundant,
                           candidate_topologies=(topology,))
    with LocalCluster(config) as cluster:
        results, infos = asyncio.run(_generate(cluster.worker_addresses))
    for i, result in enumerate(results):
        assert result.token_ids == ref_tokens[i], f"prompt {i}"
        np.testing.assert_allclose(np.stack(result.logits), ref_logits[i].numpy(), atol=LOGITS_ATOL, rtol=0)
    spec = ModelSpec.from_dir(checkpoints[style])
    placement = place(Topology.parse(topology), spec.shape, num_redundant_experts=redundant)
    full_bytes = spec.num_parameters * 4
    for info, wp in zip(infos, placement.workers, strict=True):
        assert (info.ep_rank, info.ep_size) == (wp.ep_rank, wp.ep_size)
        assert (info.expert_slot_start, info.expert_slot_end) == (wp.expert_slots.start, wp.expert_slots.stop)
        if num_workers > 1 and not redundant:
            assert info.param_bytes < full_bytes  # a shard, not the whole model
