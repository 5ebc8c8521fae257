"""The front router over instances on the GPU (issue 16): requests moved live between three GPU instances of two
layouts end with transformers' tokens. A GPU pool is not in shared memory, so the target's workers refuse the KV
pull and each pair's moves go by re-prefill (the move still completes; the request keeps its stream).

Run by hand where CUDA is (../shared/gpu/README.md); skipped elsewhere (conftest.py)."""

from __future__ import annotations

import asyncio

from tests.conftest import hf_greedy, make_checkpoint
from tests.front.conftest import open_front, open_instances, start_clusters
from tests.front.test_live_moves import PROMPTS, _request, _run_with_moves

NEW_TOKENS = 32
HOPS = (6, 14, 22)  # after so many tokens: a -> b (same layout), b -> c (tp1pp2), c -> a


async def test_moves_between_gpu_instances_keep_transformers_tokens(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "llama-front-gpu", "llama", seed=7)
    expected, _ = hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)
    with start_clusters(checkpoint, device="cuda") as clusters:
        async with open_instances(clusters) as opened:
            a, b, c = opened.instances
            async with open_front(opened, migrate=False) as front:
                runs = await asyncio.gather(*(
                    _run_with_moves(front, _request(f"gpu-{i}", p, NEW_TOKENS), list(zip(HOPS, (b, c, a))))
                    for i, p in enumerate(PROMPTS)))
                totals = front.totals
            used = [engine.scheduler.block_manager.num_used for engine in opened.engines]
    for i, ((tokens, results), want) in enumerate(zip(runs, expected)):
        assert tokens == want, f"prompt {i}"
        assert [r.moved for r in results] == [True] * len(HOPS), [r.error for r in results]
        assert all(r.reprefilled for r in results)
    print(f"FRONT_GPU moves={totals.moves} reprefilled={totals.reprefilled} "
          f"downtime_ms_mean={1e3 * totals.move_downtime_s / max(1, totals.moves['moved']):.1f}")
    assert totals.moves["moved"] == len(HOPS) * len(PROMPTS) and totals.reprefilled == totals.moves["moved"]
    assert used == [0, 0, 0]
