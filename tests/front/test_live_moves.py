"""Live moves of running requests between real instances: same layout and another layout, exact tokens."""

from __future__ import annotations

import asyncio

import pytest

from services.router.contracts import GenerationRequest
from tests.conftest import until
from tests.front.conftest import (
    MAX_TOKENS,
    PROMPTS,
    TOKEN,
    greedy_request,
    open_front,
    reference_tokens,
    run_with_moves,
)

pytestmark = pytest.mark.asyncio

async def test_moves_between_layouts_keep_every_token(instances):
    """a (tp1pp1) -> b (tp1pp1, same layout) -> c (tp1pp2) -> a, mid-generation: the tokens of an unmoved run,
    no prefill on the instances they moved to, every move stopping the request only for its delta."""
    a, b, c = instances.instances
    reference = [await reference_tokens(instances.engines[0], p, f"ref-{i}") for i, p in enumerate(PROMPTS)]
    prefills = [engine.num_full_prefills for engine in instances.engines]
    async with open_front(instances, migrate=False) as front:
        runs = await asyncio.gather(*(
            run_with_moves(front, greedy_request(f"live-{i}", p), [(6, b), (16, c), (27, a)])
            for i, p in enumerate(PROMPTS)))
        assert front.totals.moves["moved"] == 3 * len(PROMPTS)
    for (tokens, results), expected in zip(runs, reference):
        assert tokens == expected
        assert [r.moved for r in results] == [True, True, True], [r.error for r in results]
        assert all(r.kv_bytes_delta > 0 and r.downtime_s > 0 for r in results)
    # Only instance a prefilled (the front placed every request there first); b and c only adopted.
    assert [e.num_full_prefills - p for e, p in zip(instances.engines, prefills)] == [len(PROMPTS), 0, 0]
    assert [e.instance_moves.num_in for e in instances.engines] == [len(PROMPTS), len(PROMPTS), len(PROMPTS)]
    for engine in instances.engines:  # every block came back
        assert engine.scheduler.block_manager.num_used == 0
        assert not engine.scheduler.moves.parked


async def test_seeded_sampling_moves_exactly_by_kv_and_by_reprefill(instances):
    """A sampled request (temperature, top-p, a seed) keeps its tokens through a KV move and a re-prefill move
    (its sampling state is the router's: seed and generated count travel with it); the re-prefill costs the
    target one prefill and carries no KV."""
    from services.contracts.step import SamplingParams

    a, b, c = instances.instances
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    request = GenerationRequest("seeded", tuple(PROMPTS[2]), MAX_TOKENS, sampling=sampling)
    expected = [t for d in [d async for d in instances.engines[0].generate(
        GenerationRequest("seeded-ref", tuple(PROMPTS[2]), MAX_TOKENS, sampling=sampling))] for t in d.token_ids]
    prefills = [engine.num_full_prefills for engine in instances.engines]
    async with open_front(instances, migrate=False) as front:
        tokens, kv_moves = await run_with_moves(front, request, [(5, c)])
        assert tokens == expected and kv_moves[0].moved and not kv_moves[0].reprefilled
        again = GenerationRequest("seeded-2", tuple(PROMPTS[2]), MAX_TOKENS, sampling=sampling)
        tokens, reprefills = await run_with_moves(front, again, [(5, b), (20, c)], reprefill=True)
        assert tokens == expected
        assert all(r.moved and r.reprefilled and r.kv_bytes_precopied + r.kv_bytes_delta == 0 for r in reprefills)
        assert front.totals.reprefilled == 2
    assert [e.num_full_prefills - p for e, p in zip(instances.engines, prefills)] == [2, 1, 1]


async def test_a_request_moves_before_the_front_saw_its_first_token(instances):
    """The front moves a request it has no token of yet (its policy moves new requests too): waiting, prefilling
    or already decoding on the source (whichever the move finds there: the scheduler's tests cover each), it ends
    on the target with the tokens of an unmoved run, and nothing stays behind."""
    a, b, _ = instances.instances
    expected = await reference_tokens(instances.engines[0], PROMPTS[3], "early-ref")
    async with open_front(instances, migrate=False) as front:
        stream = front.generate(greedy_request("early", PROMPTS[3]))
        first = asyncio.ensure_future(anext(stream))  # places it (on a) and reads its first delta
        # At the turn of the event loop in which instance a admitted it (its router runs in this loop): its first
        # token needs a's step and the worker's reply (many turns and a round trip to another process), so the
        # front has none yet. (Moved before a has it, the move fails: NOT_FOUND, and it goes on at a.)
        source = instances.engines[0].scheduler
        await until(lambda: source.get("early") is not None, what="the request admitted on a", interval_s=0)
        [route] = [r for r in front.requests_on(a) if r.request.request_id == "early"]  # placed on a
        assert not route.seq.output_token_ids
        result = await front.move("early", b)
        tokens = list((await first).token_ids) + [t async for d in stream for t in d.token_ids]
    assert result.moved, result.error
    assert tokens == expected
    for engine in instances.engines:
        assert engine.scheduler.block_manager.num_used == 0 and not engine.scheduler.moves.parked


async def test_migration_rpcs_refuse_with_precise_codes(instances):
    """Unknown requests, unreserved pulls, a migrated Generate without the control-plane token, a request that is
    still prefilling: each gets its gRPC code, and nothing changes."""
    import grpc

    from services.front.instances import Instance, request_to_pb
    from services.rpc.reconfig.v1 import router_pb2

    a = instances.instances[0]
    await a.connect()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await a.migrate_out("nobody", router_pb2.MigrateOutRequest.EXPORT)
        assert error.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await a.migrate_in(router_pb2.MigrateInRequest(request_id="nobody",
                                                           action=router_pb2.MigrateInRequest.PULL))
        assert error.value.code() is grpc.StatusCode.NOT_FOUND
        wire = request_to_pb(greedy_request("x", PROMPTS[0]))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await a.migrate_in(router_pb2.MigrateInRequest(request_id="x", action=router_pb2.MigrateInRequest.RESERVE,
                                                           request=wire, num_tokens=500))
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # more KV than the request can have
        anonymous = Instance("anonymous", a.address)  # no token
        anonymous.open()
        wire.migrated.num_computed_tokens = 5
        wire.migrated.output_token_ids[:] = [1]
        call = anonymous.generate(wire)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
        call = a.generate(wire)  # with the token, but nothing reserved under its id
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() is grpc.StatusCode.NOT_FOUND
        await anonymous.close()
    finally:
        await a.close()
    assert instances.engines[0].scheduler.block_manager.num_used == 0


async def test_an_instance_added_at_runtime_serves_and_a_drained_one_is_removed(instances):
    """The front starts over a and b; c (another layout) is added while it serves, takes a request moved to it,
    then is drained (its request moves on live) and removed. Refusals: removing a serving instance, adding one
    that does not answer."""
    import grpc

    from services.front.instance_admin import MoveRefused

    a, b, c = instances.instances
    reference = await reference_tokens(instances.engines[0], PROMPTS[1], "ref-added")
    opened = type(instances)(instances.engines, [a, b], instances.model_dir, instances.servers)
    async with open_front(opened, migrate=False) as front:
        added = await front.add_instance(c.address)
        assert added.name not in ("a", "b") and added.topology == "tp1pp2" and front.policy.config.max_instances == 3
        with pytest.raises(grpc.aio.AioRpcError):
            await front.add_instance("127.0.0.1:9")  # nothing listens there
        tokens = []
        async for delta in front.generate(greedy_request("added", PROMPTS[1])):
            tokens.extend(delta.token_ids)
            if len(tokens) >= 5 and not front.totals.moves["moved"]:
                assert (await front.move("added", added)).moved
                with pytest.raises(MoveRefused):
                    await front.remove_instance(added.name)  # serving
                moved, failed, _ = await front.drain_instance(added.name)
                assert (moved, failed) == (1, 0)
        assert tokens == reference
        await front.remove_instance(added.name)
        assert [i.name for i in front.instances] == ["a", "b"] and front.policy.config.max_instances == 2


async def test_a_move_whose_kv_the_target_cannot_read_goes_by_reprefill(instances, monkeypatch):
    """Instance a says its KV lives on another host and names no worker to send it (as a source across hosts from
    an older router would): the target's workers refuse the pull (FAILED_PRECONDITION, passed on by its router),
    the move goes on by re-prefill with exact tokens, and the next move on that pair re-prefills from the start (no
    reservation)."""
    from services.rpc.reconfig.v1.router_pb2 import MigrateInRequest as IN

    a, b, _ = instances.instances
    export = a.migrate_out

    async def elsewhere(request_id, action, timeout_s=30.0):
        state = await export(request_id, action, timeout_s)
        state.source.hostname = "another-host"
        for pool in state.source.pools.values():
            pool.shm_domain, pool.address = "another-boot/1", ""
        return state

    asked_b = []
    migrate_in = b.migrate_in

    async def counted(request, timeout_s=60.0):
        asked_b.append(request.action)
        return await migrate_in(request, timeout_s)

    monkeypatch.setattr(a, "migrate_out", elsewhere)
    monkeypatch.setattr(b, "migrate_in", counted)
    expected = [await reference_tokens(instances.engines[0], p, f"far-ref-{i}") for i, p in enumerate(PROMPTS[2:])]
    async with open_front(instances, migrate=False) as front:
        first, first_moves = await run_with_moves(front, greedy_request("far-1", PROMPTS[2]), [(9, b)])
        assert first == expected[0]
        assert first_moves[0].moved and first_moves[0].reprefilled and first_moves[0].kv_unreachable
        assert asked_b.count(IN.PULL) == 1  # refused once
        asked_b.clear()
        second, second_moves = await run_with_moves(front, greedy_request("far-2", PROMPTS[3]), [(9, b)])
        assert second == expected[1]
        assert second_moves[0].moved and second_moves[0].reprefilled and not second_moves[0].kv_unreachable
        assert IN.RESERVE not in asked_b and IN.PULL not in asked_b  # straight to re-prefill
        assert front.totals.reprefilled == 2 and front.totals.kv_bytes_moved == 0
    for engine in instances.engines:
        assert engine.scheduler.block_manager.num_used == 0


async def test_kv_from_another_hosts_workers_comes_over_torch_distributed(instances, monkeypatch):
    """Instance a's pools are not readable here (another shared-memory domain, as on another host), but its
    workers' addresses are known: the target's workers have each source worker send its slices over a gloo group
    of the two (ExportKV), and the request moves with its KV — no re-prefill — with exact tokens."""
    a, b, _ = instances.instances
    export = a.migrate_out

    async def elsewhere(request_id, action, timeout_s=30.0):
        state = await export(request_id, action, timeout_s)
        state.source.hostname = "another-host"
        for pool in state.source.pools.values():
            assert pool.address  # the source's router names its workers
            pool.shm_domain = "another-boot/1"
        return state

    monkeypatch.setattr(a, "migrate_out", elsewhere)
    expected = await reference_tokens(instances.engines[0], PROMPTS[1], "dist-ref")
    async with open_front(instances, migrate=False) as front:
        tokens, moves = await run_with_moves(front, greedy_request("dist-1", PROMPTS[1]), [(9, b)])
        assert front.totals.reprefilled == 0
    assert tokens == expected
    assert moves[0].moved and not moves[0].reprefilled and not moves[0].kv_unreachable
    assert moves[0].kv_bytes_precopied + moves[0].kv_bytes_delta > 0
    for engine in instances.engines:
        assert engine.scheduler.block_manager.num_used == 0


async def test_a_source_that_froze_during_a_move_has_its_kv_copied_again(instances, monkeypatch):
    """The source freezes and resumes (as a switch or a rolled-back one does, which may give its workers new
    pools) after the pre-copy and before the stop: the stop's pool epoch differs, so the mover copies every block
    again, and the tokens stay exact. A commit while the source is frozen is refused (UNAVAILABLE)."""
    import grpc

    from services.rpc.reconfig.v1.router_pb2 import MigrateInRequest as IN
    from services.rpc.reconfig.v1.router_pb2 import MigrateOutRequest as OUT

    a, b, _ = instances.instances
    source_engine = instances.engines[0]
    expected = await reference_tokens(source_engine, PROMPTS[2], "froze-ref")
    pulled: list[list[int]] = []
    froze: list[int] = []  # the pulls made before the source froze
    migrate_out, migrate_in = a.migrate_out, b.migrate_in

    async def freezing(request_id, action, timeout_s=30.0):
        if action == OUT.STOP and not froze:
            froze.append(len(pulled))
            await source_engine.freeze(10)
            source_engine.resume()
        return await migrate_out(request_id, action, timeout_s)

    async def recorded(request, timeout_s=60.0):
        if request.action == IN.PULL:
            pulled.append(list(request.src_block_ids))
        return await migrate_in(request, timeout_s)

    monkeypatch.setattr(a, "migrate_out", freezing)
    monkeypatch.setattr(b, "migrate_in", recorded)
    async with open_front(instances, migrate=False) as front:
        tokens, moves = await run_with_moves(front, greedy_request("froze", PROMPTS[2]), [(9, b)])
    assert tokens == expected and moves[0].moved and not moves[0].reprefilled
    # The pre-copy's rounds (as many as the request's growth asked for), then the delta after the stop, which
    # started over from block 0.
    assert froze and len(pulled) == froze[0] + 1 and pulled[-1][:len(pulled[0])] == pulled[0]

    await a.connect()
    try:
        async with open_front(instances, migrate=False) as front:
            stream = front.generate(greedy_request("frozen-commit", PROMPTS[0]))
            await anext(stream)
            await migrate_out("frozen-commit", OUT.STOP)
            await source_engine.freeze(10)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await migrate_out("frozen-commit", OUT.COMMIT)
                assert error.value.code() is grpc.StatusCode.UNAVAILABLE
            finally:
                source_engine.resume()
            await migrate_out("frozen-commit", OUT.ABORT)  # it goes on at its source
            assert len([t async for d in stream for t in d.token_ids]) == MAX_TOKENS - 1
    finally:
        await a.close()


async def test_a_front_started_alone_cannot_start_or_stop_instances(instances):
    """Without the launcher of `reconfig up --instances`, StartInstance and StopInstance answer UNIMPLEMENTED
    (they say what to do instead), and nothing changes."""
    import grpc

    from services.front.server import start_front_grpc
    from services.rpc.auth import auth_metadata
    from services.rpc.reconfig.v1 import front_pb2, front_pb2_grpc

    async with open_front(instances, migrate=False) as front:
        server, port = await start_front_grpc(front, "127.0.0.1", 0, TOKEN)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = front_pb2_grpc.FrontStub(channel)
                for call, request in ((stub.StartInstance, front_pb2.StartInstanceRequest(topology="tp1pp1")),
                                      (stub.StopInstance, front_pb2.StopInstanceRequest(name="b"))):
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await call(request, metadata=auth_metadata(TOKEN), timeout=10)
                    assert error.value.code() is grpc.StatusCode.UNIMPLEMENTED
                    assert "instances" in error.value.details()
        finally:
            await server.stop(0)
        assert [i.name for i in front.instances] == ["a", "b", "c"]
