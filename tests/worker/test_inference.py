"""Sharded inference across real worker processes equals the Hugging Face transformers oracle."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.driver import Driver
from services.launch.generate import generate
from services.model.spec import ModelSpec
from services.topology import Topology, place
from tests.conftest import hf_greedy

pytestmark = pytest.mark.multiprocess

# Prompts of different lengths (one spans several KV blocks of 4 tokens), 16 new tokens each.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], list(range(20, 41)), [150, 7, 99, 12, 3]]
NUM_NEW_TOKENS = 16
# fp32 on both sides; the sharded sums differ from the dense ones only by reduction order.
LOGITS_ATOL = 1e-4

# (workers, topology): TP only, PP only, both, KV-head replication (4 ranks > 2 KV heads), uneven layers (3 on 3).
LAYOUTS = [(1, "tp1pp1"), (2, "tp2pp1"), (2, "tp1pp2"), (4, "tp2pp2"), (4, "tp4pp1"), (3, "tp1pp3")]


@pytest.fixture(scope="module")
def oracle(hf_checkpoint):
    return hf_greedy(hf_checkpoint, PROMPTS, NUM_NEW_TOKENS)


async def _generate(addresses: list[str]):
    async with Driver(addresses) as driver:
        return await generate(driver, PROMPTS, NUM_NEW_TOKENS, return_logits=True), driver.infos


@pytest.mark.parametrize("num_workers,topology", LAYOUTS, ids=[t for _, t in LAYOUTS])
def test_sharded_generation_matches_transformers(hf_checkpoint, oracle, num_workers, topology):
    ref_tokens, ref_logits = oracle
    config = ClusterConfig(model=str(hf_checkpoint), num_workers=num_workers, topology=topology,
                           kv_cache_bytes=1 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        results, infos = asyncio.run(_generate(cluster.worker_addresses))
    for i, result in enumerate(results):
        assert result.token_ids == ref_tokens[i], f"prompt {i}"
        np.testing.assert_allclose(np.stack(result.logits), ref_logits[i].numpy(), atol=LOGITS_ATOL, rtol=0)
    _assert_shards(hf_checkpoint, Topology.parse(topology), infos)


def _assert_shards(model_dir, topology: Topology, infos) -> None:
    """Each worker reports its own layers/heads and holds its shard's bytes, not the whole model."""
    spec = ModelSpec.from_dir(model_dir)
    placement = place(topology, spec.shape)
    full_bytes = spec.num_parameters * 4
    for info, wp in zip(infos, placement.workers, strict=True):
        assert (info.layer_start, info.layer_end) == (wp.layers.start, wp.layers.stop)
        assert (info.kv_head_start, info.kv_head_end) == (wp.kv_heads.start, wp.kv_heads.stop)
        expected = expected_shard_bytes(spec, wp, placement.padded_vocab_size)
        assert abs(info.param_bytes - expected) <= 0.03 * expected, (info.rank, info.param_bytes, expected)
        if topology.num_workers > 1:
            assert info.param_bytes < 0.8 * full_bytes


def expected_shard_bytes(spec: ModelSpec, wp, padded_vocab: int) -> int:
    """Parameter bytes a worker should hold, computed from the placement alone (fp32)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv, inter = len(wp.q_heads) * d, len(wp.kv_heads) * d, len(wp.intermediate)
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    per_layer += (q + 2 * kv) if spec.qkv_bias else 0
    per_layer += 2 * d if spec.qk_norm else 0
    total = len(wp.layers) * per_layer
    vocab_rows = len(wp.vocab_rows)
    if wp.is_first_stage:
        total += vocab_rows * h
    if wp.is_last_stage:
        total += h
        if not (spec.tie_word_embeddings and wp.is_first_stage):
            total += vocab_rows * h
    return 4 * total
