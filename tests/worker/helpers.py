"""Helpers the worker tests share: a small layout's random KV caches (KV migration between pools, KV import
between instances), and a model runner in process (the fixed-shape decode step, steps sent ahead)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from services.model.kernels import choose as choose_kernels
from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.topology import ModelShape, Topology, WorkerPlacement, place
from services.worker.decode_graphs import DecodeGraphs
from services.worker.kv_cache import KVCache
from services.worker.model_runner import ModelRunner

CPU = torch.device("cpu")

# The KV tests' model: 4 MoE layers, 2 KV heads, small pools.
SHAPE = ModelShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=64, intermediate_size=128,
                   vocab_size=264, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   moe_layers=(0, 1, 2, 3))
BLOCK_SIZE, NUM_BLOCKS, DTYPE = 4, 12, torch.float32


def random_cache(worker: WorkerPlacement, rank: int, seed: int, device: str = "cpu") -> KVCache:
    """A full cache of a worker's layers and KV heads, random contents (the same for the same rank and seed)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    cache = KVCache(worker.layers, len(worker.kv_heads), SHAPE.head_dim, BLOCK_SIZE, DTYPE, torch.device(device),
                    num_blocks=NUM_BLOCKS)
    for tensor in cache.layers:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


# The in-process runner's KV cache: float32 blocks of RUNNER_BLOCK_SIZE tokens, RUNNER_NUM_BLOCKS of them.
RUNNER_BLOCK_SIZE, RUNNER_NUM_BLOCKS = 4, 96


def in_process_runner(spec, model_dir, graphs: bool, topology: Topology = Topology(1, 1),
                      device: torch.device = CPU, kernels: str = "torch",
                      dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A runner in process over rank 0 of `topology` (its collectives on one rank: only tp1pp1 runs steps);
    graphs: the fixed-shape decode step, captured as CUDA graphs on a GPU. kernels: services/model/kernels.py."""
    tensors = load_file(model_dir / "model.safetensors")
    placement = place(topology, spec.shape)
    wp = placement.workers[0]
    loader = ShardLoader(tensors.__getitem__, set(tensors), dtype, device)
    cache = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, RUNNER_BLOCK_SIZE, dtype, device,
                    num_blocks=RUNNER_NUM_BLOCKS)
    model = ShardedCausalLM(spec, wp, loader, SingleRankGroup(), kernels=choose_kernels(kernels, device))
    runner = ModelRunner(model, cache, placement, wp, None, device)
    if graphs:
        runner.graphs = DecodeGraphs(runner.model, cache, device, capture=device.type == "cuda")
    return runner
