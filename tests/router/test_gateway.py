"""The engine and an API server joined by the gateway (one process here, a real socket pair between them): the
API server's client streams what the engine in this process would, stop strings found there end the request in the
engine, refusals keep their kind, a client that leaves aborts its request, the engine's drain and stop reach the
API server, /metrics adds up its latencies with the engine's series.

The workers are a stand-in that samples a scripted text one byte-token at a time (the tokenizer is byte level)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from services.contracts.step import SequenceOutput, StepOutput
from services.contracts.step_rows import RowEncoder
from services.model.tokenizer import Tokenizer, write_tokenizer_files
from services.router.api.engine_client import ENGINE_GONE, EngineClient
from services.router.config import SchedulerConfig
from services.router.contracts import EngineDrainingError, GenerationRequest, QueueFullError, RequestError
from services.router.engine import SHUTDOWN_ABORT, Engine
from services.router.gateway import ApiGateway
from services.router.ipc import EngineInfo
from tests.conftest import until

TEXT = "The quick brown fox jumps over the lazy dog. " * 4


class ScriptedSteps:
    """Workers that sample the i-th byte of TEXT as a request's i-th token (each step returns at once)."""

    def __init__(self) -> None:
        self.infos = [SimpleNamespace(topology="tp1pp1", num_kv_blocks=256)]
        self.num_kv_blocks, self.block_size, self.dp_size = 256, 4, 1
        self.rows = RowEncoder()

    async def submit(self, sequences, commit_expert_map: int = 0) -> asyncio.Future:
        outputs = tuple(SequenceOutput(s.request_id, ord(TEXT[s.num_generated % len(TEXT)]))
                        for s in sequences if s.sample)
        future = asyncio.get_running_loop().create_future()
        future.set_result(StepOutput(0, 0, outputs))
        return future

    def worker_times(self):
        return ()

    async def close(self) -> None:
        pass


@pytest.fixture
async def pair(tmp_path):
    """(engine, gateway, client): a running engine over scripted workers, and an API server's client of it."""
    write_tokenizer_files(tmp_path, 4096)
    tokenizer = Tokenizer.from_dir(tmp_path)
    engine = Engine(ScriptedSteps(), tokenizer, "m", 1024, SchedulerConfig(max_model_len=1024, max_waiting=4),
                    vocab_size=tokenizer.vocab_size)
    await engine.start()
    info = EngineInfo(model_name="m", model_dir=str(tmp_path), max_model_len=1024, context_note="",
                      vocab_size=tokenizer.vocab_size)
    gateway = ApiGateway(engine, info, lambda: b"reconfig:engine_series 1.0\n")
    ours, theirs = socket.socketpair()
    connection = await gateway.serve(0, ours)
    client = await EngineClient.connect(theirs)
    client.ready()
    await asyncio.wait_for(connection.ready, 10)
    yield engine, gateway, client
    await engine.stop()
    await gateway.close()
    await client.close()


def request(request_id: str, max_tokens: int = 40, **options) -> GenerationRequest:
    return GenerationRequest(request_id, (1, 2, 3), max_tokens, **options)


async def collect(deltas) -> tuple[str, list[int], str | None]:
    text, tokens, reason = "", [], None
    async for delta in deltas:
        text, tokens, reason = text + delta.text, tokens + list(delta.token_ids), delta.finish_reason
    return text, tokens, reason


async def test_the_api_servers_stream_is_the_engines_own(pair):
    engine, _, client = pair
    here = await collect(engine.generate(request("in-process")))
    there = await collect(client.generate(request("api")))
    assert there == here == (TEXT[:40], [ord(c) for c in TEXT[:40]], "length")
    stopped = await collect(client.generate(request("stop", stop_strings=("fox",))))
    assert stopped[0] == "The quick brown " and stopped[2] == "stop"
    await until(lambda: engine.scheduler.get("stop") is None and not engine.streams, what="the engine let it go")


async def test_refusals_keep_their_kind(pair):
    engine, _, client = pair
    with pytest.raises(RequestError, match="outside the model's vocabulary"):
        await anext(client.generate(GenerationRequest("bad", (1, 10**6), 4)))
    engine.scheduler.freeze()  # nothing runs: the queue fills (max_waiting 4)
    waiting = [client.generate(request(f"w{i}")) for i in range(4)]
    started = [asyncio.ensure_future(anext(w)) for w in waiting]
    await until(lambda: engine.scheduler.num_waiting == 4, what="4 waiting")
    with pytest.raises(QueueFullError):
        await anext(client.generate(request("full")))
    engine.resume()
    await asyncio.gather(*started)
    for w in waiting:
        await w.aclose()  # the clients leave: their requests are aborted in the engine
    await until(lambda: not engine.streams and engine.scheduler.num_running == 0, what="the aborts")
    draining = asyncio.ensure_future(engine.drain(0))
    await until(lambda: client.is_draining and not client.is_ready, what="the drain to reach the API server")
    with pytest.raises(EngineDrainingError):
        await anext(client.generate(request("late")))
    await draining


async def test_the_engines_stop_ends_what_runs_with_its_reason(pair):
    engine, gateway, client = pair
    engine.scheduler.freeze()
    running = client.generate(request("held"))
    first = asyncio.ensure_future(anext(running))
    await until(lambda: engine.scheduler.num_waiting == 1, what="the request to arrive")
    await engine.stop()
    delta = await first
    assert (delta.finish_reason, delta.error) == ("abort", SHUTDOWN_ABORT)
    await gateway.close()
    await until(lambda: client.closed.is_set(), what="the connection to end")
    with pytest.raises(EngineDrainingError, match=ENGINE_GONE):
        await anext(client.generate(request("after")))


async def test_metrics_add_the_servers_latencies_to_the_engines_series(pair):
    _, _, client = pair
    samples = [("reconfig:request_success", "Finished requests.", "counter",
                (("reconfig:request_success_total", (("finished_reason", "stop"), ("model_name", "m")), 3.0),))]
    text = (await client.render_metrics(samples)).decode()
    assert text.startswith("reconfig:engine_series 1.0\n")
    assert 'reconfig:request_success_total{finished_reason="stop",model_name="m"} 3.0' in text
