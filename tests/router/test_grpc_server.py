"""The router's gRPC service over the real Engine and worker processes: Generate streaming and its errors,
the guarded admin RPCs, and a client that goes away."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import NamedTuple

import grpc
import pytest

from services.model.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, Tokenizer
from services.router.contracts import EngineStats
from services.router.engine import Engine
from services.router.grpc_server import start_router_grpc
from services.router.wire import request_from_pb, stats_from_pb, stats_to_pb
from services.router.main import RouterConfig, build_engine
from services.rpc.auth import UNAUTHENTICATED_MESSAGE, auth_metadata, generate_token
from services.rpc.errors import RETRY_AFTER_KEY
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc, worker_pb2
from tests.conftest import hf_greedy, until

pytestmark = pytest.mark.multiprocess

PROMPT = (7, 31, 5, 99, 12, 64, 3, 150, 42, 18)  # 10 tokens: 3 blocks of 4 once a token is generated
TEXT_PROMPT = "hi there"
NUM_ORACLE_TOKENS = 8


class Router(NamedTuple):
    stub: router_pb2_grpc.RouterStub
    engine: Engine
    token: str


class Oracle(NamedTuple):
    tokens: list[int]              # greedy continuation of PROMPT by transformers
    text_prompt_tokens: list[int]  # greedy continuation of TEXT_PROMPT (tokenized with BOS)


@pytest.fixture(scope="module")
def oracle(serving_checkpoint) -> Oracle:
    """The transformers oracle for the two prompts used here."""
    text_prompt = Tokenizer.from_dir(serving_checkpoint).encode(TEXT_PROMPT)
    tokens, _ = hf_greedy(serving_checkpoint, [list(PROMPT), text_prompt], NUM_ORACLE_TOKENS)
    return Oracle(*tokens)


async def _serve(engine: Engine, token: str | None):
    server, port = await start_router_grpc(engine, "127.0.0.1", 0, token)
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture
async def router(serving_engine):
    """The Router service on port 0 over the real engine, and a client stub."""
    token = generate_token()
    server, channel = await _serve(serving_engine, token)
    yield Router(router_pb2_grpc.RouterStub(channel), serving_engine, token)
    await channel.close()
    await server.stop(None)


async def _collect(stub, request, timeout_s: float = 30.0) -> list[router_pb2.GenerateResponse]:
    return [response async for response in stub.Generate(request, timeout=timeout_s)]


def _tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_generate_streams_the_greedy_tokens(router, oracle):
    stub, engine, _ = router
    responses = await _collect(stub, router_pb2.GenerateRequest(prompt_token_ids=PROMPT,
                                                                max_tokens=NUM_ORACLE_TOKENS, ignore_eos=True))
    assert _tokens(responses) == oracle.tokens
    assert "".join(r.text for r in responses) == engine.tokenizer.decode(oracle.tokens)
    assert [r.finish_reason for r in responses] == [""] * (len(responses) - 1) + ["length"]
    assert [r.usage.completion_tokens for r in responses] == list(range(1, NUM_ORACLE_TOKENS + 1))
    assert {r.usage.prompt_tokens for r in responses} == {len(PROMPT)}
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id.startswith("grpc-")
    stats = engine.stats()
    assert (stats.num_running, stats.num_kv_blocks_used) == (0, 0)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (len(PROMPT), NUM_ORACLE_TOKENS)


async def test_a_text_prompt_is_tokenized_with_bos(router, oracle):
    stub, engine, _ = router
    responses = await _collect(stub, router_pb2.GenerateRequest(prompt=TEXT_PROMPT, max_tokens=NUM_ORACLE_TOKENS,
                                                                ignore_eos=True))
    assert _tokens(responses) == oracle.text_prompt_tokens
    assert responses[-1].usage.prompt_tokens == len(engine.tokenizer.encode(TEXT_PROMPT)) == len(TEXT_PROMPT) + 1


async def test_stop_token_ids_and_sampling_reach_the_workers(router, oracle):
    stub, _, _ = router
    greedy = oracle.tokens
    stop = greedy[3]
    responses = await _collect(stub, router_pb2.GenerateRequest(
        request_id="mine", prompt_token_ids=PROMPT, max_tokens=NUM_ORACLE_TOKENS, stop_token_ids=[stop],
        ignore_eos=True))
    assert {r.request_id for r in responses} == {"mine"}
    assert _tokens(responses) == greedy[: greedy.index(stop) + 1] and responses[-1].finish_reason == "stop"

    # top_k=1 keeps only the argmax: even a hot temperature must reproduce the greedy tokens.
    top1 = worker_pb2.SamplingParams(temperature=5.0, top_k=1, seed=3)
    responses = await _collect(stub, router_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, max_tokens=NUM_ORACLE_TOKENS, ignore_eos=True, sampling=top1))
    assert _tokens(responses) == greedy

    # A seed makes sampling reproducible; without top_k the hot distribution leaves the greedy path.
    seeded = worker_pb2.SamplingParams(temperature=5.0, top_p=0.99, seed=11)
    request = router_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=NUM_ORACLE_TOKENS, ignore_eos=True,
                                         sampling=seeded)
    first, second = _tokens(await _collect(stub, request)), _tokens(await _collect(stub, request))
    assert first == second and first != greedy and len(first) == NUM_ORACLE_TOKENS


@pytest.mark.parametrize("fields,message", [
    (dict(max_tokens=2), "exactly one of prompt_token_ids and prompt"),
    (dict(prompt="a", prompt_token_ids=[1], max_tokens=2), "exactly one of"),
    (dict(prompt_token_ids=[1], max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt_token_ids=[1, 100000], max_tokens=1), "token id 100000 is outside the vocabulary"),
    (dict(prompt_token_ids=[-3], max_tokens=1), "token id -3"),
    (dict(prompt_token_ids=[1], max_tokens=1, sampling=worker_pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt_token_ids=[1], max_tokens=1, sampling=worker_pb2.SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[1], max_tokens=1, sampling=worker_pb2.SamplingParams(top_k=-1)), "top_k"),
    (dict(prompt_token_ids=[1, 259], max_tokens=1), "token id 259 is outside the vocabulary [0, 259)"),
    # Refused by the engine's admission: the context is 256 positions.
    (dict(prompt_token_ids=[5] * 250, max_tokens=10), "more than the context of 256 tokens"),
])
async def test_malformed_requests_are_invalid_argument(router, fields, message):
    stub, engine, _ = router
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _collect(stub, router_pb2.GenerateRequest(**fields))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_kv_blocks_used) == (0, 0, 0)


async def test_a_full_queue_is_resource_exhausted(serving_cluster, oracle):
    engine = await build_engine(RouterConfig(worker_addresses=tuple(serving_cluster.worker_addresses),
                                             model_dir=str(serving_cluster.model_dir), max_waiting=2))
    server, channel = await _serve(engine, None)
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        await engine.freeze()  # nothing is scheduled: requests stay in the queue
        request = router_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=3, ignore_eos=True)
        queued = [asyncio.ensure_future(_collect(stub, request)) for _ in range(2)]
        await until(lambda: engine.stats().num_waiting == 2)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _collect(stub, request)
        assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.value.details() == "2 requests are waiting (max_waiting)"
        assert (RETRY_AFTER_KEY, "1") in tuple(error.value.trailing_metadata())
        assert not any(task.done() for task in queued)
        engine.resume()
        for responses in await asyncio.gather(*queued):
            assert _tokens(responses) == oracle.tokens[:3]
    finally:
        await channel.close()
        await server.stop(None)
        await engine.stop()


async def test_a_cancelled_call_frees_its_blocks(router):
    stub, engine, token = router
    call = stub.Generate(router_pb2.GenerateRequest(request_id="gone", prompt_token_ids=PROMPT, max_tokens=200,
                                                    ignore_eos=True))
    assert len((await call.read()).token_ids) == 1
    # Frozen, the request holds its blocks and gets no token: only the cancellation can free them.
    await stub.Freeze(router_pb2.FreezeRequest(timeout_seconds=10), metadata=auth_metadata(token), timeout=15)
    held = engine.stats()
    assert held.num_running == 1 and held.num_kv_blocks_used >= 3
    call.cancel()
    await until(lambda: engine.stats().num_running == 0 and engine.stats().num_kv_blocks_used == 0)
    await stub.Resume(router_pb2.ResumeRequest(), metadata=auth_metadata(token), timeout=5)
    await asyncio.sleep(0.1)  # not synchronisation: time for steps the cancelled request must not get
    assert engine.stats().num_generation_tokens == held.num_generation_tokens < 200


ADMIN_CALLS = [
    ("Freeze", router_pb2.FreezeRequest()),
    ("Rebind", router_pb2.RebindRequest(num_kv_blocks=8)),
    ("Resume", router_pb2.ResumeRequest()),
    ("Stats", router_pb2.StatsRequest()),
]


@pytest.mark.parametrize("metadata", [None, auth_metadata("not-the-token")], ids=["no-token", "wrong-token"])
async def test_admin_rpcs_need_the_token(router, metadata):
    stub, engine, _ = router
    before = engine.stats()
    for name, request in ADMIN_CALLS:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await getattr(stub, name)(request, metadata=metadata, timeout=5)
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.UNAUTHENTICATED,
                                                               UNAUTHENTICATED_MESSAGE), name
    assert engine.stats() == before and not before.is_frozen  # nothing froze, nothing rebound


async def test_admin_rpcs_with_the_token(router, oracle):
    stub, engine, token = router
    metadata = auth_metadata(token)
    num_blocks = engine.stats().num_kv_blocks_total
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Rebind(router_pb2.RebindRequest(num_kv_blocks=8), metadata=metadata, timeout=5)
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "Freeze first" in error.value.details()
    frozen = await stub.Freeze(router_pb2.FreezeRequest(timeout_seconds=3), metadata=metadata, timeout=5)
    assert frozen.stats.is_frozen and engine.stats().is_frozen

    # Frozen: a request is admitted but not scheduled.
    waiting = asyncio.ensure_future(_collect(stub, router_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, max_tokens=NUM_ORACLE_TOKENS, ignore_eos=True)))
    await until(lambda: engine.stats().num_waiting == 1)
    stats = await stub.Stats(router_pb2.StatsRequest(), metadata=metadata, timeout=5)
    assert (stats.num_waiting, stats.num_running, stats.num_generation_tokens) == (1, 0, 0)

    rebound = await stub.Rebind(router_pb2.RebindRequest(num_kv_blocks=8), metadata=metadata, timeout=5)
    assert rebound.stats.num_kv_blocks_total == 8 == engine.stats().num_kv_blocks_total < num_blocks
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Rebind(router_pb2.RebindRequest(num_kv_blocks=0), metadata=metadata, timeout=5)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "num_blocks must be >= 1, got 0"
    with pytest.raises(grpc.aio.AioRpcError) as error:  # a worker that is gone: the old streams stay in place
        await stub.Rebind(router_pb2.RebindRequest(num_kv_blocks=8, worker_addresses=["127.0.0.1:1"]),
                          metadata=metadata, timeout=15)
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE
    assert error.value.details().startswith("worker 127.0.0.1:1 does not answer: UNAVAILABLE")
    assert not waiting.done()
    resumed = await stub.Resume(router_pb2.ResumeRequest(), metadata=metadata, timeout=5)
    assert not resumed.stats.is_frozen
    assert _tokens(await asyncio.wait_for(waiting, 30)) == oracle.tokens  # 18 tokens fit the 8 blocks of 4
    stats = await stub.Stats(router_pb2.StatsRequest(), metadata=metadata, timeout=5)
    assert stats_from_pb(stats) == engine.stats()
    assert (stats.num_kv_blocks_total, stats.num_generation_tokens, stats.topology) == (8, NUM_ORACLE_TOKENS,
                                                                                       "tp1pp2")


@pytest.mark.parametrize("lease_seconds", [-1.0, float("nan"), float("inf")])
async def test_freeze_with_a_bad_lease_is_invalid_argument(router, lease_seconds):
    stub, engine, token = router
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Freeze(router_pb2.FreezeRequest(lease_seconds=lease_seconds), metadata=auth_metadata(token),
                          timeout=5)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("lease_seconds must be a finite number >= 0")
    assert not engine.stats().is_frozen


async def test_rebind_drop_kv_re_prefills_and_a_freeze_lease_resumes_by_itself(router, oracle):
    stub, engine, token = router
    metadata = auth_metadata(token)
    call = stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=NUM_ORACLE_TOKENS,
                                                    ignore_eos=True))
    first = await call.read()
    frozen = await stub.Freeze(router_pb2.FreezeRequest(timeout_seconds=5, lease_seconds=30), metadata=metadata,
                               timeout=10)
    assert frozen.stats.num_running == 1 and frozen.stats.num_kv_blocks_used >= 3
    rebound = await stub.Rebind(router_pb2.RebindRequest(num_kv_blocks=frozen.stats.num_kv_blocks_total,
                                                         drop_kv=True), metadata=metadata, timeout=5)
    assert rebound.stats.num_preemptions == frozen.stats.num_preemptions + 1
    assert (rebound.stats.num_running, rebound.stats.num_waiting, list(rebound.used_block_ids)) == (0, 1, [])
    # Another Freeze replaces the 30 s lease with a short one: nobody calls Resume, yet the request finishes.
    await stub.Freeze(router_pb2.FreezeRequest(timeout_seconds=5, lease_seconds=0.2), metadata=metadata, timeout=5)
    rest = []
    while (response := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
        rest.append(response)
    assert list(first.token_ids) + _tokens(rest) == oracle.tokens and rest[-1].finish_reason == "length"
    stats = engine.stats()
    assert not stats.is_frozen and engine.num_full_prefills == 2


async def test_without_a_token_admin_is_unreachable(serving_engine, oracle):
    server, channel = await _serve(serving_engine, None)
    async with channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for token in ("", "anything"):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Freeze(router_pb2.FreezeRequest(), metadata=auth_metadata(token), timeout=5)
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
        responses = await _collect(stub, router_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=1))
        assert _tokens(responses) == oracle.tokens[:1]
    await server.stop(None)
    assert not serving_engine.stats().is_frozen


def test_stats_round_trip():
    stats = EngineStats(num_running=3, num_waiting=4, num_kv_blocks_total=512, num_kv_blocks_used=9,
                        num_preemptions=1, num_decodes_ahead=5, num_prompt_tokens=70, num_generation_tokens=80,
                        topology="tp1pp4",
                        is_frozen=True, extra={"a": 1.5}, stalled="worker 127.0.0.1:1 stream failed")
    assert stats_from_pb(stats_to_pb(stats)) == stats
    field_names = {f.name for f in dataclasses.fields(EngineStats)}
    assert field_names <= set(router_pb2.RouterStats.DESCRIPTOR.fields_by_name), "RouterStats must mirror EngineStats"


def test_request_from_pb_converts_prompt_sampling_and_stops(serving_checkpoint):
    tokenizer = Tokenizer.from_dir(serving_checkpoint)
    request = request_from_pb(router_pb2.GenerateRequest(prompt_token_ids=[3, 4], max_tokens=2), tokenizer)
    assert request.prompt_token_ids == (3, 4) and request.sampling.is_greedy
    # EOS stops unless ignore_eos: the tokenizer's and the model config's (id 2 in the test checkpoints).
    assert request.stop_token_ids == tokenizer.eos_token_ids == frozenset({EOS_TOKEN_ID, 2})
    request = request_from_pb(router_pb2.GenerateRequest(
        request_id="mine", prompt="hi", max_tokens=1, stop=["\n", ""], stop_token_ids=[5], ignore_eos=True,
        sampling=worker_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=4, seed=11)), tokenizer)
    assert request.request_id == "mine" and request.prompt_token_ids == tuple(tokenizer.encode("hi"))
    assert request.prompt_token_ids[0] == BOS_TOKEN_ID
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (
        pytest.approx(0.7), pytest.approx(0.9), 4, 11)
    assert request.stop_strings == ("\n",) and request.stop_token_ids == frozenset({5})
