"""Moves that fail leave the request running on its source; an instance that dies loses only its requests' KV
(they are placed again and finish); the front router lives on."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from services.front.mover import MoveSettings
from services.router.grpc_server import start_router_grpc
from tests.conftest import until
from tests.front.conftest import (
    PROMPTS,
    TOKEN,
    greedy_request,
    open_front,
    open_instances,
    reference_tokens,
    run_with_moves,
    start_clusters,
)

pytestmark = pytest.mark.asyncio

# Instance b's worker takes a second for every KV import (a move there can be given up mid-copy); instance c's second
# worker fails every KV import: every move to c fails, at the first pull.
FAULTS = ("", "rpc:method=ImportKV:rank=0:delay=1", "rpc:method=ImportKV:rank=1:action=raise")


@pytest.fixture(scope="module")
def failing_clusters(front_checkpoint):
    with start_clusters(front_checkpoint, faults=FAULTS) as clusters:
        yield clusters


@pytest_asyncio.fixture
async def failing(failing_clusters):
    async with open_instances(failing_clusters) as opened:
        yield opened


async def test_a_failed_move_leaves_the_request_running_on_its_source(failing):
    """One move fails in its pre-copy (serving never stopped), one after the stop (its delta): both requests go on
    on instance a and end with the unmoved tokens; c keeps no block; a keeps nothing parked."""
    a, b, c = failing.instances
    reference = [await reference_tokens(failing.engines[0], p, f"ref-{i}") for i, p in enumerate(PROMPTS[:2])]
    async with open_front(failing, migrate=False) as front:
        tokens0, results0 = await run_with_moves(front, greedy_request("pre", PROMPTS[0]), [(8, c)])
        front.settings = type(front.settings)(migrate=False, move=MoveSettings(max_rounds=0))  # straight to stop
        tokens1, results1 = await run_with_moves(front, greedy_request("post", PROMPTS[1]), [(8, c)])
        assert front.totals.moves == {"moved": 0, "failed": 2, "finished": 0, "dropped": 0, "deferred": 0}
    assert (tokens0, tokens1) == tuple(reference)
    assert not results0[0].moved and results0[0].rounds == 0 and "ImportKV" in results0[0].error
    assert not results1[0].moved and results1[0].downtime_s == 0
    c_engine = failing.engines[2]
    assert c_engine.scheduler.block_manager.num_used == 0 and not c_engine.scheduler.moves.parked
    assert failing.engines[0].num_full_prefills == 4  # 2 references + 2 live: none re-prefilled
    assert failing.engines[0].instance_moves.num_out == 0


async def test_a_move_given_up_midway_holds_nothing_on_its_target(failing):
    """A move to b is cancelled while b's worker copies the request's KV (a front that stops cancels its moves so):
    b gives its reservation back only once that copy has ended (no worker writes into blocks given to someone
    else), the request runs on on a and ends with the unmoved tokens, nothing stays parked on a."""
    a, b, _ = failing.instances
    a_engine, b_engine = failing.engines[0], failing.engines[1]
    reference = await reference_tokens(a_engine, PROMPTS[3], "ref-cut")
    async with open_front(failing, migrate=False) as front:
        stream = front.generate(greedy_request("cut", PROMPTS[3]))
        tokens = list((await anext(stream)).token_ids)
        assert "cut" in [route.request.request_id for route in front.requests_on(a)]
        move = asyncio.ensure_future(front.move("cut", b))
        await until(lambda: "cut" in b_engine.instance_moves._pulling, what="b's worker copying the KV in")
        move.cancel()
        with pytest.raises(asyncio.CancelledError):
            await move
        assert not b_engine.instance_moves._pulling and b_engine.scheduler.block_manager.num_used == 0
        async for delta in stream:
            tokens.extend(delta.token_ids)
        assert front.totals.moves["moved"] == 0
    assert tokens == reference
    assert not a_engine.scheduler.moves.parked and a_engine.scheduler.block_manager.num_used == 0


async def test_a_lost_instance_loses_only_its_requests_kv(failing):
    """Instance b's router goes away mid-generation: its request is placed again on another instance with its
    prompt and what it generated, and ends with the tokens of an unmoved run; a request on a never noticed."""
    a, b, c = failing.instances
    prompts = PROMPTS[2:]
    reference = [await reference_tokens(failing.engines[0], p, f"ref-{i}") for i, p in enumerate(prompts)]
    async with open_front(failing, migrate=False) as front:
        tokens, streams = {}, {}
        for i, prompt in enumerate(prompts):
            streams[i] = front.generate(greedy_request(f"loss-{i}", prompt))
            tokens[i] = list((await anext(streams[i])).token_ids)
        # loss-1 runs on b now (by re-prefill: b's worker takes a second per KV import, see FAULTS)
        assert (await front.move("loss-1", b, reprefill=True)).moved
        assert "loss-1" in [route.request.request_id for route in front.requests_on(b)]
        await failing.servers[1].stop(0)  # b's router is gone (its workers' KV with it, for the front)
        for i in tokens:
            async for delta in streams[i]:
                tokens[i].extend(delta.token_ids)
        assert [tokens[0], tokens[1]] == reference
        assert front.totals.replaced == 1 and not b.is_up
        assert front.is_ready  # the front router lives on over a and c
        # b's router comes back on its port: the front finds it (it probes instances it lost) and places there again.
        port = int(b.address.rsplit(":", 1)[1])
        failing.servers[1], _ = await start_router_grpc(failing.engines[1], "127.0.0.1", port, TOKEN)
        await until(lambda: b.is_up, what="the front to find b back", interval_s=0.05)
