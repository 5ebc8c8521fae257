"""One API request as several engine requests: `n` choices per prompt and lists of prompts. Each choice is its own
engine request (scheduled, preempted and switched like any other); they start together, and the first failure
ends them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from starlette.requests import Request

from services.router.api.metrics import RequestTimer
from services.router.api.protocol import MAX_SEED, UsageInfo
from services.router.api.streaming import GenerationRun, start_generation
from services.router.contracts import EngineProtocol, GenerationRequest

T = TypeVar("T")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a seeded request: seed + index (mod 2**64), so choice 0 keeps the request's
    seed (n=1 is unchanged), choices differ, and the same request gives the same choices."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def with_choice_seed(generation: GenerationRequest, index: int) -> GenerationRequest:
    """`generation` for choice `index` of its prompt."""
    return replace(generation, sampling=replace(generation.sampling, seed=choice_seed(generation.sampling.seed, index)))


async def gather_all(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Await every awaitable concurrently; the first failure cancels the others and is raised as is."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_all(
    engine: EngineProtocol, generations: Sequence[GenerationRequest], timer: Callable[[], RequestTimer],
    request: Request,
) -> list[GenerationRun]:
    """Submit every generation and wait for each one's first delta; if one is refused, the others are closed."""
    if len(generations) == 1:
        return [await start_generation(engine, generations[0], timer(), request)]
    tasks = [asyncio.ensure_future(start_generation(engine, g, timer(), request)) for g in generations]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, GenerationRun):
                await result.close()
        raise


def merge_events(streams: Sequence[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The events of several streams as they come; the first failure stops (and closes) every stream. One stream
    is its own events (no generator in between)."""
    return streams[0] if len(streams) == 1 else _merged_events(streams)


async def _merged_events(streams: Sequence[AsyncIterator[str]]) -> AsyncIterator[str]:
    queue: asyncio.Queue[tuple[str | None, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((event, None))
            queue.put_nowait((None, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            queue.put_nowait((None, exc))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        num_open = len(tasks)
        while num_open:
            event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                num_open -= 1
            else:
                yield event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summed_usage(runs: Sequence[GenerationRun], num_choices_per_prompt: int) -> UsageInfo:
    """Usage of a fanned-out request: each prompt counted once, every choice's completion tokens."""
    prompt_tokens = sum(run.usage.prompt_tokens for run in runs[::num_choices_per_prompt])
    completion_tokens = sum(run.usage.completion_tokens for run in runs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
