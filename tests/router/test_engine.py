"""The engine over real workers: concurrent requests equal the oracle; stop strings; abort frees; preemption."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.router.contracts import GenerationRequest, QueueFullError, RequestError
from tests.conftest import hf_greedy, until

pytestmark = pytest.mark.multiprocess


async def _collect(engine, request):
    deltas = [d async for d in engine.generate(request)]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1]


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 160) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


async def test_concurrent_requests_equal_transformers(serving_engine, serving_checkpoint):
    prompts = _prompts(12, seed=1)
    lengths = [random.Random(i).randrange(1, 20) for i in range(len(prompts))]
    expected, _ = hf_greedy(serving_checkpoint, prompts, max(lengths))
    results = await asyncio.gather(*(
        _collect(serving_engine, GenerationRequest(f"r{i}", tuple(p), n)) for i, (p, n) in enumerate(zip(prompts, lengths))
    ))
    for i, (tokens, text, last) in enumerate(results):
        assert tokens == expected[i][: lengths[i]], f"request {i}"
        assert text == serving_engine.tokenizer.decode(tokens)
        assert last.finish_reason == "length" and last.num_generated_tokens == lengths[i]
    stats = serving_engine.stats()
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0 and stats.num_preemptions == 0


async def test_stop_string_trims_and_finishes(serving_engine, serving_checkpoint):
    prompt = [5, 6, 7, 8]
    expected, _ = hf_greedy(serving_checkpoint, [prompt], 24)
    full = serving_engine.tokenizer.decode(expected[0])
    stop = full[6:9]
    assert stop and full.find(stop) >= 0
    _, text, last = await _collect(serving_engine, GenerationRequest("s", tuple(prompt), 24, stop_strings=(stop,)))
    assert text == full[: full.find(stop)] and last.finish_reason == "stop"


async def test_closing_the_stream_aborts_and_frees_blocks(serving_engine):
    stream = serving_engine.generate(GenerationRequest("gone", tuple(range(3, 40)), 200))
    await stream.__anext__()
    await stream.aclose()  # what a disconnecting client's handler does
    await until(lambda: (stats := serving_engine.stats()).num_running == 0 and stats.num_kv_blocks_used == 0,
                timeout_s=120, what="the aborted request's blocks freed")


async def test_admission_errors(serving_engine):
    with pytest.raises(RequestError):
        await _collect(serving_engine, GenerationRequest("long", (5,) * 250, 10))  # context is 256
    serving_engine.scheduler.freeze()  # nothing runs: the queue fills up
    streams = [serving_engine.generate(GenerationRequest(f"q{i}", (5, 6), 2)) for i in range(65)]
    tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
    await until(lambda: serving_engine.stats().num_waiting + sum(t.done() for t in tasks) == len(tasks),
                what="every request queued or refused")
    failed = [t for t in tasks if t.done() and isinstance(t.exception(), QueueFullError)]
    assert len(failed) == 1  # max_waiting=64
    serving_engine.resume()
    await asyncio.gather(*(t for t in tasks if t not in failed))
    for s in streams:
        await s.aclose()


async def test_preemption_under_a_small_cache_keeps_outputs_exact(serving_engine, serving_checkpoint):
    await serving_engine.freeze()
    await serving_engine.rebind(24)  # 24 blocks of 4 tokens for 8 requests of up to 45 tokens: some must be preempted
    serving_engine.resume()
    prompts = _prompts(8, seed=2)
    expected, _ = hf_greedy(serving_checkpoint, prompts, 16)
    results = await asyncio.gather(*(
        _collect(serving_engine, GenerationRequest(f"p{i}", tuple(p), 16)) for i, p in enumerate(prompts)
    ))
    assert [r[0] for r in results] == expected
    assert serving_engine.stats().num_preemptions > 0


async def test_token_ids_outside_the_model_vocabulary_are_refused(serving_engine):
    with pytest.raises(RequestError, match="token id 264 is outside the model's vocabulary"):
        await _collect(serving_engine, GenerationRequest("oov", (5, 264), 3))
    assert serving_engine.stats().num_waiting == 0


async def test_a_defect_applying_a_step_ends_its_requests_with_an_error_and_the_engine_lives_on(
        serving_engine, monkeypatch):
    engine = serving_engine
    original = engine.scheduler.on_batch_done
    calls = []

    def broken_once(batch, *args, **kwargs):
        if not calls:
            calls.append(batch.batch_id)
            raise RuntimeError("a defect")
        return original(batch, *args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "on_batch_done", broken_once)
    _, _, last = await _collect(engine, GenerationRequest("victim", (5, 6, 7), 8))
    assert last.finish_reason == "error" and "internal error applying a step: RuntimeError: a defect" in last.error
    monkeypatch.setattr(engine.scheduler, "on_batch_done", original)
    tokens, _, last = await _collect(engine, GenerationRequest("after", (5, 6, 7), 4))
    assert last.finish_reason == "length" and len(tokens) == 4
