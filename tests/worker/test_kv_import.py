"""KV import between instances (live request migration), in one process: each source "worker" is a KVCache in
shared memory, as a CPU worker's; every target worker imports the blocks into the ids its router reserved, re-cut
from the source layout to its own over the real ShmChannel. Every imported byte is checked against the source;
the refusals are checked for their exception (the worker's gRPC code follows from it)."""

from __future__ import annotations

import socket

import pytest
import torch

from services.topology import Topology, place
from services.worker.cuda_ipc import IpcHandle
from services.worker.kv_cache import KVCache
from services.worker.kv_import import ImportRefused, KVSourceSpec, import_kv
from tests.worker.helpers import BLOCK_SIZE, DTYPE, NUM_BLOCKS, SHAPE, random_cache

PAIRS = [("tp1pp1", "tp1pp1"), ("tp2pp1", "tp1pp2"), ("tp1pp4", "tp2pp2"), ("tp4pp1", "tp1pp1")]


def _source(topology: str, seed: int):
    """The source's workers, each holding its slice of one random KV (replicas of a KV head hold the same bytes,
    as in a real layout), and the whole KV by layer: [2, blocks, block_size, KV heads, D]."""
    placement = place(Topology.parse(topology), SHAPE)
    generator = torch.Generator().manual_seed(seed)
    whole = [torch.randn((2, NUM_BLOCKS, BLOCK_SIZE, SHAPE.num_kv_heads, SHAPE.head_dim), generator=generator)
             for _ in range(SHAPE.num_layers)]
    caches = [KVCache(worker.layers, len(worker.kv_heads), SHAPE.head_dim, BLOCK_SIZE, DTYPE, torch.device("cpu"),
                      num_blocks=NUM_BLOCKS) for worker in placement.workers]
    for worker, cache in zip(placement.workers, caches):
        for layer in worker.layers:
            cache.layer(layer).tensor.copy_(whole[layer][:, :, :, worker.kv_heads.start:worker.kv_heads.stop])
    spec = KVSourceSpec(placement.topology, None, {i: c.segment_names() for i, c in enumerate(caches)}, BLOCK_SIZE,
                        socket.gethostname())
    return whole, caches, spec


def _close(*caches) -> None:
    for cache in caches:
        cache.close()


@pytest.mark.parametrize("source_layout,target_layout", PAIRS)
def test_every_imported_byte_equals_the_source(source_layout, target_layout):
    whole, src_caches, spec = _source(source_layout, seed=1)
    target = place(Topology.parse(target_layout), SHAPE)
    dst_caches = [random_cache(worker, rank, seed=2) for rank, worker in enumerate(target.workers)]
    src_ids, dst_ids = [5, 6, 7, 0, 11], [1, 2, 3, 9, 4]  # a run, and ids that change order
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    before = [[layer.clone() for layer in cache.layers] for cache in dst_caches]
    try:
        for rank, cache in enumerate(dst_caches):
            stats = import_kv(spec, src_ids, dst_ids, SHAPE, target, rank, cache)
            worker = target.workers[rank]
            per_block = 2 * BLOCK_SIZE * SHAPE.head_dim * DTYPE.itemsize
            assert stats.bytes_received == per_block * len(src_ids) * len(worker.layers) * len(worker.kv_heads)
        for rank, (worker, cache) in enumerate(zip(target.workers, dst_caches)):
            for index, layer in enumerate(worker.layers):
                tensor = cache.layer(layer).tensor
                for j, head in enumerate(worker.kv_heads):
                    expected = whole[layer][:, src_ids, :, head]
                    assert torch.equal(tensor[:, dst_ids, :, j], expected), (rank, layer, head)
                assert torch.equal(tensor[:, untouched], before[rank][index][:, untouched])  # nothing else written
    finally:
        _close(*src_caches, *dst_caches)


def test_imports_that_cannot_run_here_are_refused():
    _, src_caches, spec = _source("tp1pp1", seed=3)
    target = place(Topology.parse("tp1pp1"), SHAPE)
    cache = random_cache(target.workers[0], 0, seed=4)
    try:
        elsewhere = KVSourceSpec(spec.topology, None, spec.pools, BLOCK_SIZE, "another-host")
        with pytest.raises(ImportRefused, match="another-host"):
            import_kv(elsewhere, [0], [0], SHAPE, target, 0, cache)
        handle = IpcHandle(0, 0, 64, b"\0" * 64).to_bytes()
        on_a_gpu = KVSourceSpec(spec.topology, None, {0: {}}, BLOCK_SIZE, socket.gethostname(),
                                {0: dict.fromkeys(range(SHAPE.num_layers), handle)})
        with pytest.raises(ImportRefused, match="GPU pool"):
            import_kv(on_a_gpu, [0], [0], SHAPE, target, 0, cache)
        with pytest.raises(ValueError, match="outside this pool"):
            import_kv(spec, [0], [NUM_BLOCKS], SHAPE, target, 0, cache)
        with pytest.raises(ValueError, match="source block ids"):
            import_kv(spec, [0, 1], [0], SHAPE, target, 0, cache)
        other_blocks = KVSourceSpec(spec.topology, None, spec.pools, BLOCK_SIZE * 2, socket.gethostname())
        with pytest.raises(ValueError, match="tokens"):
            import_kv(other_blocks, [0], [0], SHAPE, target, 0, cache)
    finally:
        _close(*src_caches, cache)


def test_a_cuda_ipc_handle_round_trips_and_a_bad_one_is_refused():
    handle = IpcHandle(device=1, offset_bytes=4096, num_bytes=1 << 20, handle=bytes(range(64)))
    assert IpcHandle.from_bytes(handle.to_bytes()) == handle
    with pytest.raises(ValueError, match="bytes"):
        IpcHandle.from_bytes(handle.to_bytes()[:-1])


def test_torch_shareable_handles_give_the_cuda_handle_or_are_refused():
    from services.worker.cuda_ipc import IpcUnavailable, raw_handle

    cuda_handle = bytes(range(64))
    assert raw_handle(cuda_handle) == cuda_handle                      # an older torch: the bare handle
    assert raw_handle(b"\x03c" + cuda_handle) == cuda_handle           # [version]['c'][handle]
    with pytest.raises(IpcUnavailable, match="expandable"):
        raw_handle(b"\x03e" + cuda_handle + b"\0" * 12)                # an expandable segment's
