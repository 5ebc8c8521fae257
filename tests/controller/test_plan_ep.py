"""The Plan of a switch to or from an EP layout: KV per pool pair and per pool of the target from the router's
placement of the running requests, and the expert bytes that can change view by all-to-all."""

from __future__ import annotations

from services.controller.plan import pool_pair_blocks, reshardable_expert_bytes
from services.model.spec import ModelSpec
from services.topology import Topology, place
from tests.conftest import make_checkpoint


def test_pool_pairs_and_pools_come_from_the_routers_placement():
    from services.controller.plan import pool_plans
    from services.rpc.reconfig.v1 import router_pb2

    placements = [router_pb2.RequestPlacement(request_id=rid, src_pool=src, dst_pool=dst, num_blocks=n)
                  for rid, src, dst, n in (("a", 0, 1, 9), ("b", 0, 0, 5), ("c", 1, 1, 2), ("d", 1, -1, 4))]
    assert pool_pair_blocks(placements) == {(0, 1): 9, (0, 0): 5, (1, 1): 2}  # d is preempted: it moves nothing
    assert [(p.pool, p.num_requests, p.num_blocks) for p in pool_plans(placements, 3)] == [
        (0, 1, 5), (1, 2, 11), (2, 0, 0)]


def test_reshardable_expert_bytes(tmp_path):
    spec = ModelSpec.from_dir(make_checkpoint(tmp_path / "moe", "qwen3_moe"))  # 3 layers, layer 1 dense, 8 x 32
    tp4, ep4, ep2pp2 = (place(Topology.parse(t), spec.shape) for t in ("tp4pp1", "ep4pp1", "ep2pp2"))
    per_layer = spec.num_experts * spec.moe_intermediate_size * 3 * spec.hidden_size * 4 // 4  # fp32, 1/4 each
    for rank in range(4):
        assert reshardable_expert_bytes(tp4, ep4, rank, spec, 4) == 2 * per_layer  # the two sparse layers
        assert reshardable_expert_bytes(ep4, tp4, rank, spec, 4) == 2 * per_layer
        assert reshardable_expert_bytes(tp4, ep2pp2, rank, spec, 4) == 0  # other width and stages: the store


def test_staging_verdict_names_the_worker_over_the_budget():
    from services.controller.staging import staging_verdict

    needs = {0: 10 << 20, 1: 20 << 20, 2: 20 << 20}
    assert staging_verdict(needs, None) == "" and staging_verdict(needs, 20 << 20) == ""
    assert staging_verdict(needs, 15 << 20) == ("worker 1 would stage 20.0 MiB beside its live shard, over the "
                                                 "staging budget of 15.0 MiB")


def test_staging_needs_are_the_slices_each_target_worker_loads(tmp_path):
    from services.controller.staging import planned_reloads, staging_needs

    spec = ModelSpec.from_dir(make_checkpoint(tmp_path / "llama", "llama"))

    def needs(target: str) -> dict[int, int]:
        live, new = Topology.parse("tp2pp2"), Topology.parse(target)
        return staging_needs(planned_reloads(spec, live, None, new, None), new, 4)

    assert sorted(needs("tp4pp1")) == [0, 1, 2, 3] and all(n > 0 for n in needs("tp4pp1").values())
    assert set(needs("tp2pp2").values()) == {0}  # every slice is already held: staging costs nothing
    assert sorted(needs("tp1pp2")) == [0, 1]  # standby workers stage nothing
