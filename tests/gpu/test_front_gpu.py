"""The front router over instances on the GPU (issue 16): requests moved live between three GPU instances of two
layouts end with the tokens of an unmoved run. The targets' workers read the sources' GPU pools through CUDA IPC handles
(no prefill on any target), and a move by re-prefill keeps the tokens too.

Run by hand where CUDA is (../shared/gpu/README.md); skipped elsewhere (conftest.py)."""

from __future__ import annotations

import asyncio

from tests.conftest import make_checkpoint
from tests.front.conftest import (
    PROMPTS,
    greedy_request,
    open_front,
    open_instances,
    reference_tokens,
    run_with_moves,
    start_clusters,
)

HOPS = (6, 50, 100)  # after so many tokens: a -> b (same layout), b -> c (tp1pp2), c -> a; far apart: a GPU is fast


async def test_moves_between_gpu_instances_keep_every_token(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "llama-front-gpu", "llama", seed=7)
    with start_clusters(checkpoint, device="cuda") as clusters:
        async with open_instances(clusters) as opened:
            a, b, c = opened.instances
            expected = [await reference_tokens(opened.engines[0], p, f"ref-{i}") for i, p in enumerate(PROMPTS)]
            async with open_front(opened, migrate=False) as front:  # the first request is placed on a
                again, reprefilled = await run_with_moves(front, greedy_request("gpu-again", PROMPTS[2]),
                                                           [(6, b), (50, c)], reprefill=True)
            async with open_front(opened, migrate=False) as front:
                prefills = [engine.num_full_prefills for engine in opened.engines]
                runs = await asyncio.gather(*(
                    run_with_moves(front, greedy_request(f"gpu-{i}", p), list(zip(HOPS, (b, c, a))))
                    for i, p in enumerate(PROMPTS)))
                prefills = [engine.num_full_prefills - n for engine, n in zip(opened.engines, prefills)]
                totals = front.totals
            used = [engine.scheduler.block_manager.num_used for engine in opened.engines]
    for i, ((tokens, results), want) in enumerate(zip(runs, expected)):
        assert tokens == want, f"prompt {i}"
        assert [r.moved for r in results] == [True] * len(HOPS), [r.error for r in results]
        assert not any(r.reprefilled or r.kv_unreachable for r in results)
        assert all(r.kv_bytes_delta > 0 for r in results)
    print(f"FRONT_GPU moves={totals.moves} kv_bytes={totals.kv_bytes_moved} "
          f"downtime_ms_mean={1e3 * totals.move_downtime_s / max(1, totals.moves['moved']):.1f} "
          f"link_GBps={totals.link_bytes_per_s / 1e9:.3f}")
    assert prefills == [len(PROMPTS), 0, 0]  # the targets adopted the moved KV
    assert again == expected[2] and all(r.moved and r.reprefilled for r in reprefilled)
    assert used == [0, 0, 0]
