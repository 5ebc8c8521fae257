"""Requests streamed at once through an in-process router engine, timed token by token (pipeline, async_steps)."""

from __future__ import annotations

import asyncio
import statistics
import time


async def stream_all(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    """Greedy requests of exactly `new_tokens` each, all at once: generated tokens/s (submission to the last token),
    mean TPOT (ms), the seconds and each request's tokens."""
    from services.router.contracts import GenerationRequest

    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]

    async def consume(i: int) -> None:
        request = GenerationRequest(f"{tag}-{i}", tuple(prompts[i]), new_tokens)
        async for delta in engine.generate(request):
            tokens[i].extend(delta.token_ids)
            times[i].extend([time.perf_counter()] * len(delta.token_ids))

    started = time.perf_counter()
    await asyncio.gather(*(consume(i) for i in range(len(prompts))))
    seconds = time.perf_counter() - started
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    return dict(tokens_per_s=sum(map(len, tokens)) / seconds, tpot_ms=statistics.mean(tpots) * 1e3 if tpots else 0.0,
                seconds=seconds, tokens=tokens)
