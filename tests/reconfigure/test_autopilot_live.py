"""The autopilot on the live stack (real workers, engine, router gRPC and the controller's transaction):
`reconfigctl calibrate` measures the layouts by switching through them and sending requests; in `auto` the loop
switches up under load and back down once it has passed, through the same Reconfigure an operator uses, with the
requests in flight finishing exactly as without the switches."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest

from services.controller.autopilot.calibrate import CalibrationPlan
from services.controller.autopilot.loop import Autopilot, AutopilotConfig
from services.controller.autopilot.policy import PolicyConfig
from services.controller.autopilot.profile import Profile
from services.controller.server import start_controller_grpc
from services.controller.servicer import ControllerServicer
from services.ctl import main
from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.contracts import GenerationRequest
from services.rpc.auth import auth_metadata, write_token_file
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc
from tests.conftest import make_checkpoint, until
from tests.reconfigure.conftest import TOKEN, generated_tokens, open_live_stack
from tests.reconfigure.helpers import reconfigctl_lines

live = pytest.mark.multiprocess
LAYOUTS = ("tp2pp2", "tp4pp1")


async def _reconfigctl(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))  # this loop keeps serving the controller and the router


@live
async def test_calibrate_measures_each_layout_and_the_switches(live_stack, tmp_path, capsys):
    token_file = tmp_path / "token"
    write_token_file(token_file, TOKEN)
    profile_file = tmp_path / "profile.json"
    autopilot = Autopilot(live_stack.reconfigurer, AutopilotConfig(profile_path=str(profile_file)),
                          model="switch", machine="test")
    server, port = await start_controller_grpc(
        live_stack.state, "127.0.0.1", 0, TOKEN,
        ControllerServicer(live_stack.state, live_stack.reconfigurer, autopilot=autopilot))
    flags = ("--controller", f"127.0.0.1:{port}", "--token-file", str(token_file))
    try:
        assert await _reconfigctl("autopilot", "status", *flags) == 0
        assert "profile: none" in capsys.readouterr().out
        assert await _reconfigctl("autopilot", "status", "--plot", str(tmp_path / "none.png"), *flags) == 1
        assert "no profile to plot yet" in capsys.readouterr().err
        assert await _reconfigctl("calibrate", "--layouts", "tp2pp3", *flags) == 2  # not a layout of 4 workers
        code = await _reconfigctl("calibrate", "--layouts", ",".join(LAYOUTS), "--batch-sizes", "1,3",
                                  "--prompt-tokens", "8,24", "--output-tokens", "5", "--json", *flags)
        assert code == 0
        status = json.loads("\n".join(reconfigctl_lines(capsys.readouterr().out)))
        assert await _reconfigctl("autopilot", "status", "--plot", str(tmp_path / "profile.png"), *flags) == 0
        assert (tmp_path / "profile.png").stat().st_size > 0
        assert await _reconfigctl("autopilot", "set", "advise", *flags) == 0
        assert autopilot.mode == "advise"
        with pytest.raises(SystemExit):  # argparse knows the modes
            await _reconfigctl("autopilot", "set", "sideways", *flags)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # and so does the controller
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await controller_pb2_grpc.ControllerStub(channel).SetAutopilot(
                    controller_pb2.SetAutopilotRequest(mode="sideways"), metadata=auth_metadata(TOKEN))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and autopilot.mode == "advise"
    finally:
        await server.stop(0)
    assert str(live_stack.state.topology) == "tp2pp2"  # it ends where it started
    assert {m["layout"] for m in status["layouts"]} == set(LAYOUTS)
    profile = Profile.load(profile_file)  # cached where the controller reads it at the next start
    assert set(profile.layouts) == set(LAYOUTS)
    assert set(profile.switches) == {("tp2pp2", "tp4pp1"), ("tp4pp1", "tp2pp2")}
    assert all(s.downtime_s > 0 for s in profile.switches.values())
    # 2 layouts x 2 prompt lengths x 2 batch sizes, each a real wave through the router.
    assert len(profile.decode_samples) == 8 and all(s.tpot_s > 0 for s in profile.decode_samples)
    assert all(p.seconds > 0 for p in profile.prefill_samples)
    for name, model in profile.layouts.items():
        assert model.kv_blocks > 0 and model.block_size == 4 and model.num_workers == 4
        assert model.tpot(1, 16) > 0
    assert live_stack.engine.stats().num_running == 0


def _requests(n: int, max_tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"auto{i}", tuple(5 + (13 * i + 7 * j) % 200 for j in range(12)), max_tokens)
            for i in range(n)]


@live
async def test_auto_switches_up_under_load_and_back_down_with_exact_outputs(live_stack):
    engine, reconfigurer = live_stack.engine, live_stack.reconfigurer
    requests = _requests(6, 24)
    expected = await asyncio.gather(*(generated_tokens(engine, r) for r in requests))  # no switch

    # A profile in which tp4pp1 scales better (crossover at 4 requests in flight) and switches are cheap.
    from services.controller.autopilot.profile import LayoutModel, SwitchSample
    models = {"tp2pp2": LayoutModel("tp2pp2", 0.01, 0.010, 0.0, 0.0, 1e-4, 4096, 4, 4),
              "tp4pp1": LayoutModel("tp4pp1", 0.03, 0.005, 0.0, 0.0, 1e-4, 4096, 4, 4)}
    switches = {(a, b): SwitchSample(a, b, 0.1, 1.0) for a, b in (LAYOUTS, LAYOUTS[::-1])}
    # learn=0: this stack's real TPOTs have nothing to do with the made-up lines, which are what is tested here.
    policy = PolicyConfig(window=2, cooldown_s=0.0, min_dwell_s=0.0, horizon_s=60.0, learn=0.0)
    autopilot = Autopilot(reconfigurer, AutopilotConfig(mode="auto", policy=policy),
                          Profile("switch", "test", models, switches))

    tick = await autopilot.tick()
    assert tick.decision.action == "keep"          # idle: tp2pp2 is the better layout
    # Long requests in flight; a wave of tokens first so that they hold KV when the autopilot looks.
    requests = [dataclasses.replace(r, request_id=f"again{i}") for i, r in enumerate(requests)]
    running = [asyncio.ensure_future(generated_tokens(engine, r)) for r in requests]
    await until(lambda: engine.stats().num_generation_tokens >= 6 * 3, timeout_s=120, what="a wave of tokens")
    tick = await autopilot.tick()
    assert tick.decision.action == "switch" and tick.decision.target == "tp4pp1", tick.decision.reason
    assert tick.operation_id and tick.outcome == "SUCCEEDED", tick.outcome
    assert str(live_stack.state.topology) == "tp4pp1" and autopilot.num_switches == 1
    assert await asyncio.gather(*running) == expected  # the switch under them changed no token

    # Load gone: the window's mean falls under T_l, and the autopilot goes back down.
    decisions = [await autopilot.tick() for _ in range(3)]
    assert [d.decision.action for d in decisions].count("switch") == 1, [d.decision.reason for d in decisions]
    assert str(live_stack.state.topology) == "tp2pp2" and autopilot.num_switches == 2
    assert "T_l" in next(d for d in decisions if d.decision.switches).decision.reason


@pytest.fixture(scope="module")
def uneven_cluster(switch_checkpoint):
    """Two workers, rank 0's model work 30x slower than rank 1's (a slower device: tens of ms a step, well above the
    noise of a busy machine)."""
    config = ClusterConfig(model=str(switch_checkpoint), num_workers=2, topology="tp1pp2", kv_cache_bytes=1 << 20,
                           block_size=4, faults="forward:rank=0:slow=30")
    with LocalCluster(config) as cluster:
        yield cluster


@live
async def test_calibration_measures_each_worker_and_the_autopilot_splits_layers_by_speed(uneven_cluster):
    async with open_live_stack(uneven_cluster, leave_in=None) as stack:
        engine, reconfigurer = stack.engine, stack.reconfigurer
        request = GenerationRequest("uneven", tuple(range(7, 19)), 12)
        expected = await generated_tokens(engine, request)
        autopilot = Autopilot(reconfigurer, AutopilotConfig(
            mode="auto", policy=PolicyConfig(cooldown_s=0.0, min_dwell_s=0.0)), model="switch", machine="test")
        profile = await autopilot.calibrate(CalibrationPlan(layouts=("tp1pp2", "tp2pp1"), batch_sizes=(1, 3),
                                                            prompt_tokens=(8,), output_tokens=4, rounds=2))
        speeds = {w.rank: w for w in profile.worker_speeds}
        assert set(speeds) == {0, 1} and profile.num_layers == 3
        assert speeds[0].layer_s > 2 * speeds[1].layer_s          # the slow rank, measured through the router
        assert speeds[1].head_ratio > 0 and speeds[0].head_ratio == 0  # rank 1 is the last stage
        # The even split of 3 layers gives stage 0 two; by speed it gets one. The calibration ran the same waves
        # with that split (whether it keeps it is a timing verdict: bench/balance.py measures it, not this test).
        ((layout, split, even_s, split_s, kept),) = profile.split_trials
        assert (layout, split) == ("tp1pp2", (1, 2)) and even_s > 0 and split_s > 0
        assert profile.layer_partition("tp1pp2") == ((1, 2) if kept else None)
        autopilot.profile = dataclasses.replace(profile, partitions={"tp1pp2": (1, 2)})
        tick = await autopilot.tick()
        assert tick.decision.switches and tick.decision.target == "tp1pp2", tick.decision.reason
        assert tick.decision.layer_partition == (1, 2) and "measured speed" in tick.decision.reason
        assert tick.outcome == "SUCCEEDED" and stack.state.layer_partition == (1, 2)
        assert not (await autopilot.tick()).decision.switches   # balanced now: nothing more to do
        assert await generated_tokens(engine, dataclasses.replace(request, request_id="again")) == expected
        await reconfigurer.reconfigure("tp1pp2")                   # back to the even split for the next test


@live
async def test_moe_calibration_and_an_autopilot_switch_between_tp_and_ep(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "qwen3-moe", "qwen3_moe", seed=7)
    config = ClusterConfig(model=str(checkpoint), num_workers=2, topology="tp2pp1", kv_cache_bytes=1 << 20,
                           block_size=4)
    with LocalCluster(config) as cluster:
        async with open_live_stack(cluster, leave_in=None) as stack:
            autopilot = Autopilot(stack.reconfigurer, AutopilotConfig(mode="auto"), model="moe", machine="test")
            profile = await autopilot.calibrate(CalibrationPlan(layouts=("tp2pp1", "ep2pp1"), batch_sizes=(1, 3),
                                                                prompt_tokens=(8,), output_tokens=4, rounds=2))
            assert set(profile.layouts) == {"tp2pp1", "ep2pp1"} and str(stack.state.topology) == "tp2pp1"
            tp, ep = profile.layouts["tp2pp1"], profile.layouts["ep2pp1"]
            assert (tp.kv_pools, ep.kv_pools) == (1, 2)          # EP: one KV pool per data-parallel rank
            assert ep.max_requests(16) == 2 * (ep.kv_blocks // 4)
            # Make EP the better layout at every load (flat lines, a quarter of TP's step): the autopilot moves there
            # through the same transaction.
            step_s = max(tp.tpot(1, 16), 1e-3)
            flat = dataclasses.replace(tp, step_s=step_s, per_request_s=0.0, per_position_s=0.0)
            faster = dataclasses.replace(ep, step_s=step_s / 4, per_request_s=0.0, per_position_s=0.0)
            cheap = {k: dataclasses.replace(v, downtime_s=1e-3, staging_s=0.0) for k, v in profile.switches.items()}
            autopilot.profile = dataclasses.replace(profile, layouts={"tp2pp1": flat, "ep2pp1": faster},
                                                    switches=cheap)
            autopilot.config = dataclasses.replace(autopilot.config, policy=PolicyConfig(min_dwell_s=0.0))
            tick = await autopilot.tick()
            assert tick.decision.target == "ep2pp1" and "every load" in tick.decision.reason
            assert tick.outcome == "SUCCEEDED", tick.outcome
            assert str(stack.state.topology) == "ep2pp1"
