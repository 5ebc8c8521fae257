"""Mistral's sliding window: the paged attention path equals transformers when the window actually masks."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from services.contracts.step import SequenceStep, StepBatch
from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.model.spec import ModelSpec
from services.topology import Topology, place
from services.worker.kv_cache import KVCache
from services.worker.model_runner import ModelRunner
from tests.conftest import hf_greedy, make_checkpoint


def test_sliding_window_equals_transformers(tmp_path):
    model_dir = make_checkpoint(tmp_path / "mistral", "mistral", seed=4)
    spec = ModelSpec.from_dir(model_dir)
    assert spec.sliding_window == 6
    tensors = load_file(model_dir / "model.safetensors")
    placement = place(Topology(1, 1), spec.shape)
    wp = placement.workers[0]
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, torch.device("cpu"))
    cache = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, 4, torch.float32, torch.device("cpu"), num_blocks=16)
    runner = ModelRunner(ShardedCausalLM(spec, wp, loader, SingleRankGroup()), cache, placement, wp, None,
                         torch.device("cpu"))
    prompt, blocks = list(range(10, 30)), tuple(range(12))  # 20 tokens: far past the window of 6
    expected, _ = hf_greedy(model_dir, [prompt], 12)
    try:
        tokens = [runner.execute(StepBatch(0, (SequenceStep("a", tuple(prompt), 0, blocks),)), 0).outputs[0].token_id]
        for step in range(1, 12):
            batch = StepBatch(step, (SequenceStep("a", (tokens[-1],), len(prompt) + step - 1, blocks),))
            tokens.append(runner.execute(batch, 0).outputs[0].token_id)
    finally:
        cache.close()  # the KV pool is shared memory: unlink it (this process outlives the test)
    assert tokens == expected[0]
