"""KV migration between TP and EP layouts: block maps between KV pools, run in one process.

Each "rank" is a KVCache of its own (shared-memory layers, as a CPU worker's), migrated by `migrate_kv` in a thread
of its own over the real ShmChannel (peers' pools mapped by segment name), with a barrier-based AND as the world's
agreement. The KV is random, the block maps are random; every byte is checked bit for bit against the layouts."""

from __future__ import annotations

import multiprocessing
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.rpc.reconfig.v1 import worker_pb2
from services.topology import (
    KVMigrationPlan,
    Placement,
    Topology,
    place,
    plan_kv_migration,
)
from services.worker.channel import DistChannel, ShmChannel
from services.worker.kv_cache import KVCache
from services.worker.kv_migration import (
    BlockMaps,
    MigrationAborted,
    MigrationStats,
    block_counts,
    block_maps_from_proto,
    check_block_maps,
    migrate_kv,
    reverse_block_maps,
)
from services.worker.parallel import ParallelState
from tests.worker.helpers import BLOCK_SIZE, DTYPE, NUM_BLOCKS, SHAPE, random_cache

Caches = dict[int, KVCache | None]


class Agreement:
    """The world's agreement of threads: an AND of every rank's vote, once per round (a barrier between votes)."""

    def __init__(self, num_ranks: int) -> None:
        self._barrier = threading.Barrier(num_ranks, timeout=60)
        self._votes: dict[int, list[bool]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def __call__(self, ok: bool) -> bool:
        round_ = getattr(self._local, "round", 0)
        self._local.round = round_ + 1
        with self._lock:
            self._votes.setdefault(round_, []).append(ok)
        self._barrier.wait()
        return all(self._votes[round_])


def layout(text: str) -> Placement:
    return place(Topology.parse(text), SHAPE)


def random_caches(placement: Placement, ranks: list[int], seed: int) -> Caches:
    """rank -> a full cache of its layers and KV heads in `placement`, random contents."""
    return {rank: random_cache(worker, rank, seed) for rank, worker in zip(ranks, placement.workers)}


def empty_caches(placement: Placement, ranks: list[int]) -> Caches:
    """rank -> a migration target of its layout (no layer allocated yet)."""
    return {rank: KVCache(worker.layers, len(worker.kv_heads), SHAPE.head_dim, BLOCK_SIZE, DTYPE,
                          torch.device("cpu"), num_blocks=NUM_BLOCKS, allocate=False)
            for rank, worker in zip(ranks, placement.workers)}


def snapshot(caches: Caches) -> dict[int, dict[int, torch.Tensor]]:
    """rank -> layer -> a copy of its tensor (the old layers are freed as they move)."""
    return {rank: {layer: cache.layer(layer).tensor.clone() for layer in cache.layer_ids}
            for rank, cache in caches.items() if cache is not None}


def random_maps(old_pools: int, new_pools: int, seed: int) -> BlockMaps:
    """Some used blocks of every old pool, each moved to a random new pool at a random free id (what the router's
    repartition gives: requests' blocks in token order, not sorted)."""
    rng = random.Random(seed)
    free = {pool: rng.sample(range(NUM_BLOCKS), NUM_BLOCKS) for pool in range(new_pools)}
    maps: BlockMaps = {}
    for src_pool in range(old_pools):
        for block in rng.sample(range(NUM_BLOCKS), rng.randint(1, NUM_BLOCKS // 2)):
            dst_pool = rng.randrange(new_pools)
            if free[dst_pool]:
                src_ids, dst_ids = maps.setdefault((src_pool, dst_pool), ([], []))
                src_ids.append(block)
                dst_ids.append(free[dst_pool].pop())
    return maps


def run(plan: KVMigrationPlan, old: Caches, new: Caches, maps: BlockMaps | None, layers: list[int] | None = None,
        fault=None) -> dict[int, MigrationStats | BaseException]:
    """migrate_kv on every rank of the plan, one thread each, over the real ShmChannel."""
    ranks = plan.ranks()
    pools = {rank: old[rank].segment_names() for rank in ranks if old.get(rank) is not None}
    agree = Agreement(len(ranks))

    def one(rank: int) -> MigrationStats:
        channel = ShmChannel(pools, plan, BLOCK_SIZE, SHAPE.head_dim, DTYPE)
        return migrate_kv(plan, rank, old.get(rank), new.get(rank), [], channel, agree, layers=layers,
                          fault=fault and (lambda layer: fault(rank, layer)), block_maps=maps)

    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = {rank: pool.submit(one, rank) for rank in ranks}
    results: dict[int, MigrationStats | BaseException] = {}
    for rank, future in futures.items():
        error = future.exception()
        results[rank] = error if error is not None else future.result()
    return results


def expected_layer(plan: KVMigrationPlan, before: dict[int, dict[int, torch.Tensor]], maps: BlockMaps, rank: int,
                   layer: int) -> torch.Tensor:
    """What `rank`'s new tensor of `layer` must hold, from the layouts alone: for each pool pair into its pool, the
    old pool's blocks (from any old worker holding that pool and head) at their new ids; zeros elsewhere."""
    heads = plan.new_local_kv_heads(rank)
    want = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, len(heads), SHAPE.head_dim, dtype=DTYPE)
    for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items():
        if dst_pool != plan.new_pool(rank):
            continue
        for slot, head in enumerate(heads):
            holder = next(r for r in before if layer in plan.old_local_layers(r) and plan.old_pool(r) == src_pool
                          and head in plan.old_local_kv_heads(r))
            old_slot = head - plan.old_local_kv_heads(holder).start
            want[:, dst_ids, :, slot] = before[holder][layer][:, src_ids, :, old_slot]
    return want


def moved_bytes(plan: KVMigrationPlan, maps: BlockMaps, rank: int, local: bool) -> int:
    """Bytes `rank` must copy in (from itself or from peers): each of its transfers, its pool pair's blocks."""
    per_head_block = 2 * BLOCK_SIZE * SHAPE.head_dim * DTYPE.itemsize
    return sum(t.num_kv_heads * len(maps.get(t.pools, ([], []))[0]) * per_head_block
               for t in plan.receives_of(rank) if t.is_local == local)


def close(*caches: Caches) -> None:
    for group in caches:
        for cache in group.values():
            if cache is not None:
                cache.close()


SWITCHES = [("ep2pp1", "tp2pp1", 2), ("tp2pp1", "ep2pp1", 2), ("ep2pp1", "tp1pp2", 2), ("ep2pp2", "tp2pp2", 4),
            ("ep4pp1", "tp2pp2", 4), ("ep2pp1", "ep2pp1-swapped", 2)]


@pytest.mark.parametrize(("old_text", "new_text", "num_ranks"), SWITCHES)
def test_blocks_land_at_their_new_pool_and_id_and_come_back(old_text: str, new_text: str, num_ranks: int) -> None:
    old_ranks = list(range(num_ranks))
    new_ranks = old_ranks[::-1] if new_text.endswith("-swapped") else old_ranks
    old, new = layout(old_text), layout(new_text.removesuffix("-swapped"))
    plan = plan_kv_migration(old, old_ranks, new, new_ranks)
    maps = random_maps(len({plan.old_pool(r) for r in old_ranks}), len({plan.new_pool(r) for r in new_ranks}),
                       seed=num_ranks + len(old_text + new_text))
    start = random_caches(old, old_ranks, seed=7)
    before = snapshot(start)
    middle = empty_caches(new, new_ranks)
    try:
        stats = run(plan, start, middle, maps)
        for rank in new_ranks:
            assert isinstance(stats[rank], MigrationStats), stats[rank]
            assert sorted(middle[rank].segment_names()) == list(plan.new_local_layers(rank))
            for layer in plan.new_local_layers(rank):
                assert torch.equal(middle[rank].layer(layer).tensor, expected_layer(plan, before, maps, rank, layer))
            assert stats[rank].bytes_received == moved_bytes(plan, maps, rank, local=False)
            assert stats[rank].bytes_local == moved_bytes(plan, maps, rank, local=True)
            assert stats[rank].layers_kept == 0
        assert all(not cache.segment_names() for cache in start.values())  # every old layer freed
        # and back, with the reversed maps: every used block of every old pool is restored bit for bit
        back = plan_kv_migration(new, new_ranks, old, old_ranks)
        end = empty_caches(old, old_ranks)
        stats = run(back, middle, end, reverse_block_maps(maps))
        assert all(isinstance(s, MigrationStats) for s in stats.values()), stats
        for rank in old_ranks:
            used = sorted({b for (src_pool, _), (src_ids, _) in maps.items() if src_pool == plan.old_pool(rank)
                           for b in src_ids})
            for layer in plan.old_local_layers(rank):
                assert torch.equal(end[rank].layer(layer).tensor[:, used], before[rank][layer][:, used])
        close(end)
    finally:
        close(start, middle)


def test_a_pool_pair_without_blocks_copies_nothing() -> None:
    """ep2 -> tp2 where pool 1 holds nothing: only pool 0's blocks move; no transfer of pool 1 touches a byte."""
    old, new = layout("ep2pp1"), layout("tp2pp1")
    plan = plan_kv_migration(old, [0, 1], new, [0, 1])
    maps: BlockMaps = {(0, 0): ([5, 2, 9], [0, 1, 2]), (1, 0): ([], [])}
    start, middle = random_caches(old, [0, 1], seed=3), empty_caches(new, [0, 1])
    before = snapshot(start)
    try:
        stats = run(plan, start, middle, maps)
        for rank in (0, 1):
            for layer in range(SHAPE.num_layers):
                assert torch.equal(middle[rank].layer(layer).tensor, expected_layer(plan, before, maps, rank, layer))
        # rank 0 holds pool 0: its own heads locally, rank 1's heads of pool 0 go to rank 1
        assert stats[0].bytes_received == 0 and stats[1].bytes_local == 0
        assert stats[0].bytes_local == stats[1].bytes_received == 4 * 3 * 2 * BLOCK_SIZE * SHAPE.head_dim * 4
    finally:
        close(start, middle)


def test_identity_switches_keep_the_fast_path_and_the_kept_layers() -> None:
    """No maps (a TP/PP switch): every used block keeps its id; unchanged layers are kept as they are."""
    old, new = layout("tp2pp1"), layout("tp2pp1")
    plan = plan_kv_migration(old, [0, 1], new, [1, 0])  # ranks swap halves: every layer moves
    start, middle = random_caches(old, [0, 1], seed=11), empty_caches(new, [1, 0])
    before = snapshot(start)
    used = [7, 1, 2, 3, 10]
    try:
        ranks = plan.ranks()
        pools = {rank: start[rank].segment_names() for rank in ranks}
        agree = Agreement(2)

        def one(rank: int) -> MigrationStats:
            channel = ShmChannel(pools, plan, BLOCK_SIZE, SHAPE.head_dim, DTYPE)
            return migrate_kv(plan, rank, start[rank], middle[rank], used, channel, agree)

        with ThreadPoolExecutor(2) as pool:
            stats = list(pool.map(one, ranks))
        identity = {(0, 0): (sorted(used), sorted(used))}
        for rank in ranks:
            for layer in range(SHAPE.num_layers):
                assert torch.equal(middle[rank].layer(layer).tensor,
                                   expected_layer(plan, before, identity, rank, layer))
        assert [s.bytes_received for s in stats] == [moved_bytes(plan, identity, r, local=False) for r in ranks]
        same = plan_kv_migration(new, [1, 0], new, [1, 0])
        end = empty_caches(new, [1, 0])
        kept = run(same, middle, end, {(0, 0): ([3, 1], [3, 1])})  # identity maps: the old tensors are kept
        assert [kept[r].layers_kept for r in (0, 1)] == [SHAPE.num_layers] * 2
        assert all(torch.equal(end[r].layer(layer).tensor, expected_layer(plan, before, identity, r, layer))
                   for r in (0, 1) for layer in range(SHAPE.num_layers))
        close(end)
    finally:
        close(start, middle)


def test_maps_that_renumber_are_applied_even_where_the_plan_keeps_layers() -> None:
    """The same TP layout with maps that move blocks: no layer is kept as is, every block lands at its new id."""
    tp2 = layout("tp2pp1")
    plan = plan_kv_migration(tp2, [0, 1], tp2, [0, 1])
    maps: BlockMaps = {(0, 0): ([1, 2, 8], [6, 0, 3])}
    start, middle = random_caches(tp2, [0, 1], seed=17), empty_caches(tp2, [0, 1])
    before = snapshot(start)
    try:
        stats = run(plan, start, middle, maps)
        assert [stats[r].layers_kept for r in (0, 1)] == [0, 0]
        assert all(torch.equal(middle[r].layer(layer).tensor, expected_layer(plan, before, maps, r, layer))
                   for r in (0, 1) for layer in range(SHAPE.num_layers))
    finally:
        close(start, middle)


def test_a_fault_aborts_every_rank_at_the_same_layer_and_the_reversed_maps_roll_back() -> None:
    old, new = layout("ep2pp1"), layout("tp1pp2")
    plan = plan_kv_migration(old, [0, 1], new, [0, 1])
    failing = plan.layers()[2]  # two layers done when rank 1 fails
    maps = random_maps(2, 1, seed=5)
    start, middle = random_caches(old, [0, 1], seed=13), empty_caches(new, [0, 1])
    before = snapshot(start)

    def fault(rank: int, layer: int) -> None:
        if rank == 1 and layer == failing:
            raise RuntimeError("injected")

    try:
        results = run(plan, start, middle, maps, fault=fault)
        done = plan.layers()[:2]
        for rank in (0, 1):
            aborted = results[rank]
            assert isinstance(aborted, MigrationAborted) and aborted.layer == failing
            assert aborted.done_layers == done
            assert ("injected" in str(aborted)) == (rank == 1)
        # the journal: done layers are in the new layout only, the others still in the old one
        assert sorted(layer for r in (0, 1) for layer in middle[r].segment_names()) == sorted(done)
        assert all(sorted(start[r].segment_names()) == sorted(set(range(4)) - set(done)) for r in (0, 1))
        back = plan_kv_migration(new, [0, 1], old, [0, 1])  # the rollback: done layers move back, maps reversed
        results = run(back, middle, start, reverse_block_maps(maps), layers=done)
        assert all(isinstance(s, MigrationStats) for s in results.values()), results
        for rank in (0, 1):
            used = sorted(b for (src_pool, _), (src_ids, _) in maps.items() if src_pool == rank for b in src_ids)
            assert sorted(start[rank].segment_names()) == list(range(4))
            for layer in range(4):
                assert torch.equal(start[rank].layer(layer).tensor[:, used], before[rank][layer][:, used])
            for layer in set(range(4)) - set(done):  # never moved: untouched, unused blocks included
                assert torch.equal(start[rank].layer(layer).tensor, before[rank][layer])
    finally:
        close(start, middle)


def test_block_maps_from_the_request() -> None:
    request = worker_pb2.ApplySwitchRequest(block_maps=[
        worker_pb2.BlockMap(src_pool=1, dst_pool=0, src_block_ids=[4, 2], dst_block_ids=[0, 1]),
        worker_pb2.BlockMap(src_pool=0, dst_pool=0, src_block_ids=[3], dst_block_ids=[2])])
    maps = block_maps_from_proto(request.block_maps)
    assert maps == {(1, 0): ([4, 2], [0, 1]), (0, 0): ([3], [2])}
    assert reverse_block_maps(maps) == {(0, 1): ([0, 1], [4, 2]), (0, 0): ([2], [3])}
    assert block_maps_from_proto(worker_pb2.ApplySwitchRequest().block_maps) is None
    assert reverse_block_maps(None) is None
    # an old block copied twice (a shared block) goes back once
    assert reverse_block_maps({(0, 0): ([5, 5], [0, 1]), (0, 1): ([5], [0])}) == {(0, 0): ([0], [5]),
                                                                                  (1, 0): ([], [])}


@pytest.mark.parametrize(("maps", "message"), [
    ({(0, 0): ([1, 2], [3])}, "2 source ids for 1 destination ids"),
    ({(0, 0): ([1], [-3])}, ">= 0"),
    ({(0, 0): ([1, 2], [3, 3])}, "written twice"),
    ({(0, 1): ([1], [3]), (1, 1): ([1], [3])}, "a block of pool 1 is written twice"),
])
def test_maps_that_cannot_be_copied_are_refused(maps: BlockMaps, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_block_maps(maps)


def test_a_pair_given_twice_is_refused() -> None:
    twice = [worker_pb2.BlockMap(src_pool=0, dst_pool=1, src_block_ids=[1], dst_block_ids=[1])] * 2
    with pytest.raises(ValueError, match="given twice"):
        block_maps_from_proto(twice)


# --- over torch.distributed: two processes, gloo (on a shared GPU through host memory) ------------------------------

DIST_DEVICES = [pytest.param("cpu", id="cpu"),
                pytest.param("cuda", id="cuda-shared", marks=[pytest.mark.gpu, pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="needs CUDA")])]
DIST_SEED = 21


def _dist_rank(rank: int, port: int, device: str, old_text: str, new_text: str, maps: BlockMaps, out: str) -> None:
    """One rank of a world of two: migrate there over the DistChannel, then back with the reversed maps; save what
    it holds after each."""
    parallel = ParallelState(rank, 2, "127.0.0.1", port, "gloo", 60)
    try:
        old, new = layout(old_text), layout(new_text)
        there, back = plan_kv_migration(old, [0, 1], new, [0, 1]), plan_kv_migration(new, [0, 1], old, [0, 1])
        start = random_cache(old.workers[rank], rank, DIST_SEED, device)
        middle, end = (KVCache(w.layers, len(w.kv_heads), SHAPE.head_dim, BLOCK_SIZE, DTYPE, torch.device(device),
                               num_blocks=NUM_BLOCKS, allocate=False) for w in (new.workers[rank], old.workers[rank]))

        def channel(block_maps: BlockMaps) -> DistChannel:
            return DistChannel(parallel, block_counts(block_maps), BLOCK_SIZE, SHAPE.head_dim, DTYPE,
                               torch.device(device))

        stats = migrate_kv(there, rank, start, middle, [], channel(maps), parallel.agree, block_maps=maps)
        held = {layer: middle.layer(layer).tensor.cpu().clone() for layer in middle.layer_ids}  # freed going back
        back_maps = reverse_block_maps(maps)
        migrate_kv(back, rank, middle, end, [], channel(back_maps), parallel.agree, block_maps=back_maps)
        torch.save({"there": held, "back": {layer: end.layer(layer).tensor.cpu() for layer in end.layer_ids},
                    "received": stats.bytes_received, "local": stats.bytes_local}, f"{out}/{rank}.pt")
        for cache in (start, middle, end):
            cache.close()
    finally:
        parallel.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DIST_DEVICES)
@pytest.mark.parametrize(("old_text", "new_text"), [("ep2pp1", "tp2pp1"), ("ep2pp1", "tp1pp2")])
def test_the_dist_channel_sizes_each_transfer_by_its_pool_pair(old_text: str, new_text: str, device: str,
                                                               tmp_path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    maps = random_maps(2, 1, seed=9)
    assert len(maps[0, 0][0]) != len(maps[1, 0][0])  # receive buffers of two sizes
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_dist_rank, args=(rank, store.port, device, old_text, new_text, maps,
                                                         str(tmp_path))) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert [worker.exitcode for worker in workers] == [0, 0]
    old, new = layout(old_text), layout(new_text)
    plan = plan_kv_migration(old, [0, 1], new, [0, 1])
    start = random_caches(old, [0, 1], DIST_SEED)
    before = snapshot(start)
    close(start)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert sorted(result["there"]) == list(plan.new_local_layers(rank))
        for layer, tensor in result["there"].items():
            assert torch.equal(tensor, expected_layer(plan, before, maps, rank, layer))
        assert result["received"] == moved_bytes(plan, maps, rank, local=False)
        assert result["local"] == moved_bytes(plan, maps, rank, local=True)
        used = sorted(maps[rank, 0][0])
        for layer, tensor in result["back"].items():
            assert torch.equal(tensor[:, used], before[rank][layer][:, used])
