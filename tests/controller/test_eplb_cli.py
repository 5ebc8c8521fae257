"""EPLB's operator surface: `reconfigctl eplb status|rebalance` (parsing, printing, exit codes), the experts line of
`reconfigctl status`, the controller forwarding ExpertStatus / RebalanceExperts to the router and serializing a
rebalance with its layout operations, and the flags of `reconfig up` and the router. In process: a fake router
(a real grpc.aio server behind the token interceptor) and the real controller servicer, no worker processes."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.controller.cli import format_table
from services.controller.eplb_view import (
    balance_line,
    format_expert_status,
    format_rebalance,
    message_to_json,
    slots_by_rank,
)
from services.controller.experts import REBALANCE_OPERATION_PREFIX, ExpertOperations
from services.controller.server import start_controller_grpc
from services.controller.servicer import ControllerServicer
from services.controller.state import ControllerConfig, ControllerState
from services.controller.status import StackState, StackStatus
from services.controller.transaction import Reconfigurer
from services.ctl import build_parser, main
from services.rpc.auth import TokenAuthInterceptor, auth_metadata, generate_token, protect_all, write_token_file
from services.rpc.errors import ErrorInterceptor
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc, router_pb2, router_pb2_grpc
from services.topology import ModelShape, Topology
from tests.controller.conftest import closed_port
from tests.conftest import until

# A Qwen3-MoE-like shape: 8 experts, layers 0 and 2 sparse; 2 workers.
SHAPE = ModelShape(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=128,
                   vocab_size=264, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0, 2))


def expert_status() -> router_pb2.ExpertStatusResponse:
    """ep2 with 2 redundant slots (10 physical: 5 per rank), two sparse layers, EPLB on."""
    return router_pb2.ExpertStatusResponse(
        expert_parallel=True, ep_size=2, num_physical_experts=10, balancedness=0.75, epoch=3, window_steps=1000,
        eplb_enabled=True, step_interval=3000, num_rebalances=3,
        layers=[
            router_pb2.LayerBalance(layer=0, phy2log=[0, 1, 2, 3, 0, 4, 5, 6, 7, 1], load=[30, 10, 10, 10, 30,
                                    5, 5, 5, 5, 10], rank_load=[90, 30], balancedness=0.6666666),
            router_pb2.LayerBalance(layer=2, phy2log=list(range(8)) + [2, 3], load=[10] * 10, rank_load=[50, 50],
                                    balancedness=1.0),
        ],
    )


REBALANCED = router_pb2.RebalanceExpertsResponse(epoch=4, balancedness_before=0.612, balancedness_after=0.934,
                                                 bytes_moved=3 << 20, slots_changed=5, prepare_seconds=0.8125,
                                                 commit_seconds=0.0343)


# ---- printing (pure) ----------------------------------------------------------------------------------------------
def test_eplb_status_prints_each_layer_with_its_map_by_rank():
    lines = format_expert_status(expert_status()).splitlines()
    assert lines[0] == ("EPLB: on, every 3000 steps    epoch 3 (3 rebalances)    window 1000 steps    EP 2, "
                        "10 physical experts")
    assert lines[1] == "balancedness: 0.750 overall (mean / max rank load)"
    assert lines[3].split("  ")[0] == "LAYER" and "PHYSICAL -> LOGICAL (per rank)" in lines[3]
    assert lines[4].split() == ["0", "0.667", "90", "30", "0", "1", "2", "3", "0", "|", "4", "5", "6", "7", "1"]
    assert lines[5].split() == ["2", "1.000", "50", "50", "0", "1", "2", "3", "4", "|", "5", "6", "7", "2", "3"]
    assert len(lines) == 6


def test_eplb_status_of_a_tp_layout_says_there_is_nothing_to_balance():
    text = format_expert_status(router_pb2.ExpertStatusResponse(step_interval=3000))
    assert text.splitlines() == ["EPLB: off    epoch 0 (0 rebalances)",
                                 "not an expert-parallel layout: no expert map to balance (EPLB needs epXppY)"]


def test_rebalance_prints_before_after_bytes_and_times():
    assert format_rebalance(REBALANCED).splitlines() == [
        "rebalanced: epoch 4    balancedness 0.612 -> 0.934 (predicted on the window's load)",
        "  moved 3.0 MiB of expert weights, 5 slots changed; prepare 0.812 s (while serving), commit 0.034 s",
    ]


def test_status_line_and_its_place_in_the_table():
    assert balance_line(expert_status()) == ("experts: balancedness 0.750 over 2 sparse layers (window 1000 steps)"
                                             "    EPLB epoch 3, 3 rebalances, automatic every 3000 steps")
    disabled = router_pb2.ExpertStatusResponse(expert_parallel=True, step_interval=3000)
    assert balance_line(disabled).endswith("EPLB epoch 0, 0 rebalances, automatic off")
    lines = format_table(StackStatus(topology="ep2pp1", state=StackState.SERVING), "experts: X").splitlines()
    assert lines[-2:] == ["experts: X", "last operation: none"]
    assert "experts" not in format_table(StackStatus(topology="tp2pp1", state=StackState.SERVING))


def test_json_keeps_64_bit_integers_as_numbers():
    out = json.loads(json.dumps(message_to_json(expert_status())))
    assert (out["epoch"], out["window_steps"], out["num_rebalances"], out["step_interval"]) == (3, 1000, 3, 3000)
    assert out["layers"][0]["phy2log"] == [0, 1, 2, 3, 0, 4, 5, 6, 7, 1]
    assert out["layers"][1] == {"layer": 2, "phy2log": list(range(8)) + [2, 3], "load": [10] * 10,
                                "rank_load": [50, 50], "balancedness": 1.0}
    assert message_to_json(REBALANCED)["bytes_moved"] == 3 << 20


@given(st.integers(1, 8).flatmap(lambda ep: st.tuples(
    st.just(ep), st.lists(st.integers(0, 63), min_size=ep, max_size=8 * ep).filter(lambda m: len(m) % ep == 0))))
def test_the_map_by_rank_is_the_map_cut_into_equal_contiguous_runs(case):
    ep, phy2log = case
    groups = [group.split() for group in slots_by_rank(phy2log, ep).split(" | ")]
    assert len(groups) == ep and {len(group) for group in groups} == {len(phy2log) // ep}
    assert [int(expert) for group in groups for expert in group] == phy2log


def test_metrics_export_the_cached_eplb_values_in_ep_layouts_only():
    from prometheus_client import CollectorRegistry, generate_latest

    from services.router.api.metrics import expert_metrics

    class Collector:
        def __init__(self, experts) -> None:
            self.experts = experts

        def collect(self):
            return expert_metrics(self.experts, "moe")

    def scrape(experts) -> list[str]:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(experts))
        return [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]

    experts = SimpleNamespace(is_expert_parallel=True, last_balancedness=0.8125, num_rebalances=3, epoch=3)
    assert scrape(experts) == ['reconfig:eplb_balancedness{model_name="moe"} 0.8125',
                               'reconfig:eplb_rebalances_total{model_name="moe"} 3.0',
                               'reconfig:eplb_epoch{model_name="moe"} 3.0']
    assert scrape(SimpleNamespace(**{**vars(experts), "is_expert_parallel": False})) == []
    assert scrape(None) == []


# ---- parsing --------------------------------------------------------------------------------------------------------
def test_eplb_subcommands_parse():
    args = build_parser().parse_args(["eplb", "status", "--json", "--controller", "h:1"])
    assert (args.command, args.eplb_command, args.json, args.controller) == ("eplb", "status", True, "h:1")
    args = build_parser().parse_args(["eplb", "rebalance", "--timeout", "30"])
    assert (args.eplb_command, args.timeout, args.json) == ("rebalance", 30.0, False)


@pytest.mark.parametrize("argv", [["eplb"], ["eplb", "frobnicate"], ["eplb", "rebalance", "--bogus"]])
def test_eplb_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: reconfigctl" in capsys.readouterr().err


def test_up_flags_and_config_file_reach_cluster_and_router_configs(tmp_path, monkeypatch):
    from services.cli import build_parser as reconfig_parser
    from services.launch import up as up_module
    from services.launch.cluster import ClusterError
    from services.launch.up_config import UpConfig

    args = reconfig_parser().parse_args(["up", "--num-redundant-experts", "2", "--eplb", "--eplb-window", "50",
                                         "--eplb-step-interval", "100"])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "verbose", "handler")}
    config = UpConfig.load(None, overrides)
    assert (config.num_redundant_experts, config.eplb, config.eplb_window, config.eplb_step_interval) == (2, True, 50,
                                                                                                          100)
    defaults = UpConfig.load(None, {k: v for k, v in vars(reconfig_parser().parse_args(["up"])).items()
                                    if k not in ("command", "config", "verbose")})
    assert (defaults.num_redundant_experts, defaults.eplb, defaults.eplb_window,
            defaults.eplb_step_interval) == (0, False, 1000, 3000)
    toml = tmp_path / "stack.toml"
    toml.write_text("num_redundant_experts = 4\neplb = true\neplb_step_interval = 7\n")
    from_file = UpConfig.load(toml, {"eplb_step_interval": 9})
    assert (from_file.num_redundant_experts, from_file.eplb, from_file.eplb_step_interval) == (4, True, 9)
    for bad, message in (({"num_redundant_experts": -1}, "num_redundant_experts must be >= 0"),
                         ({"eplb_window": 0}, "eplb_window must be >= 1"),
                         ({"eplb_step_interval": 0}, "eplb_step_interval must be >= 1")):
        with pytest.raises(ValueError, match=message):
            UpConfig.load(None, bad)

    seen = {}

    class RecordingCluster:
        """Records what `up` asks for and stops it at the router."""

        def __init__(self, cluster_config):
            seen["cluster"] = cluster_config
            self.worker_addresses, self.model_dir, self.pids = ["127.0.0.1:1"], model, {}

        def start(self):
            pass

        def spawn_service(self, name, target, service_config):
            seen[name] = service_config
            raise ClusterError(f"{name}: recorded")

        def stop(self, timeout_s):
            pass

    model = tmp_path / "moe"  # `up` only resolves it here: the recording cluster starts nothing
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(up_module, "LocalCluster", RecordingCluster)
    stack = UpConfig.load(None, {**overrides, "model": str(model), "workers": 2, "topology": "ep2pp1"})
    assert up_module.up(stack) == 1
    assert (seen["cluster"].num_redundant_experts, seen["cluster"].eplb_window) == (2, 50)
    assert (seen["router"].eplb, seen["router"].eplb_step_interval) == (True, 100)


def test_router_flags(tmp_path):
    from services.router.__main__ import build_parser as router_parser, config_from_args

    base = ["--workers", "h:1,h:2", "--model", str(tmp_path)]
    config = config_from_args(router_parser().parse_args([*base, "--eplb", "--eplb-step-interval", "10"]))
    assert (config.eplb, config.eplb_step_interval, config.worker_addresses) == (True, 10, ("h:1", "h:2"))
    config = config_from_args(router_parser().parse_args(base))
    assert (config.eplb, config.eplb_step_interval, config.spread_decodes) == (False, 3000, False)
    assert config_from_args(router_parser().parse_args([*base, "--spread-decodes"])).spread_decodes
    with pytest.raises(SystemExit) as exit_info:
        router_parser().parse_args([*base, "--eplb-step-interval", "0"])
    assert exit_info.value.code == 2


# ---- the controller over a fake router ---------------------------------------------------------------------------
class FakeRouter(router_pb2_grpc.RouterServicer):
    """The router's two EPLB RPCs: canned answers, an optional error, and a rebalance that can be held."""

    def __init__(self) -> None:
        self.status = expert_status()
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.hold: asyncio.Event | None = None
        self.received = asyncio.Event()
        self.outcome = ""  # of the last rebalance: "returned", "cancelled"

    async def ExpertStatus(self, request, context):  # noqa: N802
        if self.error is not None:
            await context.abort(*self.error)
        return self.status

    async def RebalanceExperts(self, request, context):  # noqa: N802
        self.received.set()
        try:
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise
        self.outcome = "returned"
        if self.error is not None:
            await context.abort(*self.error)
        return REBALANCED


@dataclass
class Controller:
    """A controller servicer (with a Reconfigurer) on port 0, in front of the fake router."""

    router: FakeRouter
    router_address: str
    servicer: ControllerServicer
    reconfigurer: Reconfigurer
    address: str
    token: str
    token_file: str

    def stub(self, channel) -> controller_pb2_grpc.ControllerStub:
        return controller_pb2_grpc.ControllerStub(channel)


@pytest.fixture
async def controller(tmp_path):
    token = generate_token()
    token_file = tmp_path / "token"
    write_token_file(token_file, token)
    fake = FakeRouter()
    router_server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token, protect_all), ErrorInterceptor()])
    router_pb2_grpc.add_RouterServicer_to_server(fake, router_server)
    router_port = router_server.add_insecure_port("127.0.0.1:0")
    await router_server.start()
    workers = (f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}")  # nobody: GetStatus says DEGRADED
    state = ControllerState(ControllerConfig(token=token, worker_addresses=workers, topology="ep2pp1",
                                             router_grpc_address=f"127.0.0.1:{router_port}", port=0,
                                             rpc_timeout_s=2.0))
    await state.open()
    reconfigurer = Reconfigurer(state, SimpleNamespace(shape=SHAPE), None, state.router_stub, token)
    servicer = ControllerServicer(state, reconfigurer)
    server, port = await start_controller_grpc(state, "127.0.0.1", 0, token, servicer)
    try:
        yield Controller(fake, f"127.0.0.1:{router_port}", servicer, reconfigurer, f"127.0.0.1:{port}", token,
                         str(token_file))
    finally:
        await server.stop(0)
        await state.close()
        await router_server.stop(0)


async def test_expert_status_and_rebalance_are_forwarded_with_the_token(controller):
    metadata = auth_metadata(controller.token)
    async with grpc.aio.insecure_channel(controller.address) as channel:
        stub = controller.stub(channel)
        assert await stub.ExpertStatus(router_pb2.ExpertStatusRequest(), metadata=metadata) == expert_status()
        assert await stub.RebalanceExperts(router_pb2.RebalanceExpertsRequest(), metadata=metadata) == REBALANCED
    assert controller.reconfigurer.running is None  # the operation slot is free again


@pytest.mark.parametrize("code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED])
async def test_router_errors_keep_their_code_and_name_the_router(controller, code):
    controller.router.error = (code, "rebalance 4 aborted, the old expert map stays: worker 1 failed")
    async with grpc.aio.insecure_channel(controller.address) as channel:
        for call in (controller.stub(channel).RebalanceExperts(router_pb2.RebalanceExpertsRequest(),
                                                               metadata=auth_metadata(controller.token)),
                     controller.stub(channel).ExpertStatus(router_pb2.ExpertStatusRequest(),
                                                           metadata=auth_metadata(controller.token))):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            assert error.value.code() == code
            assert error.value.details() == (f"router at {controller.router_address}: rebalance 4 aborted, the old "
                                             "expert map stays: worker 1 failed")
    assert controller.reconfigurer.running is None


async def test_rebalance_is_refused_while_a_layout_operation_runs(controller):
    controller.reconfigurer.claim("op-7")  # what Reconfigure, recover and add-worker hold while they run
    async with grpc.aio.insecure_channel(controller.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await controller.stub(channel).RebalanceExperts(router_pb2.RebalanceExpertsRequest(),
                                                            metadata=auth_metadata(controller.token))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.details() == ("cannot rebalance the experts now: operation 'op-7' is running; retry when it "
                                     "has ended")
    assert not controller.router.received.is_set() and controller.reconfigurer.running == "op-7"


async def test_reconfigure_is_refused_while_a_rebalance_runs(controller):
    controller.router.hold = asyncio.Event()
    metadata = auth_metadata(controller.token)
    async with grpc.aio.insecure_channel(controller.address) as channel:
        stub = controller.stub(channel)
        rebalance = asyncio.ensure_future(stub.RebalanceExperts(router_pb2.RebalanceExpertsRequest(),
                                                                metadata=metadata))
        await asyncio.wait_for(controller.router.received.wait(), 30)
        running = controller.reconfigurer.running
        assert running.startswith(REBALANCE_OPERATION_PREFIX)
        # A TP layout of the same model: tp2pp1 -> tp1pp2 passes validation, only the running rebalance refuses it.
        controller.reconfigurer.state.topology = Topology.parse("tp2pp1")
        for call in (stub.Reconfigure(controller_pb2.ReconfigureRequest(topology="tp1pp2"), metadata=metadata),
                     stub.RebalanceExperts(router_pb2.RebalanceExpertsRequest(), metadata=metadata)):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"operation {running!r} is running" in error.value.details()
        controller.router.hold.set()
        assert await rebalance == REBALANCED
    assert controller.reconfigurer.running is None


async def test_a_caller_that_gives_up_does_not_cancel_the_routers_rebalance(controller):
    """The slot stays held, and the router's call runs to its end, after the caller is cancelled."""
    controller.router.hold = asyncio.Event()
    experts: ExpertOperations = controller.servicer.experts
    caller = asyncio.ensure_future(experts.rebalance())
    await asyncio.wait_for(controller.router.received.wait(), 30)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert controller.reconfigurer.running.startswith(REBALANCE_OPERATION_PREFIX)
    controller.router.hold.set()
    await until(lambda: controller.reconfigurer.running is None, what="the rebalance to release the slot")
    assert controller.router.outcome == "returned"


async def test_no_router_is_a_failed_precondition():
    state = ControllerState(ControllerConfig(token="t", worker_addresses=("h:1",), topology="ep2pp1"))
    experts = ExpertOperations.for_state(state, None)
    servicer = ControllerServicer(state, None, experts=experts)

    class Context:
        async def abort(self, code, details):
            raise RuntimeError(code, details)

    for method in (servicer.ExpertStatus, servicer.RebalanceExperts):
        with pytest.raises(RuntimeError) as error:
            await method(None, Context())
        assert error.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert "this controller has no router" in error.value.args[1]


# ---- reconfigctl against the controller: output and exit codes --------------------------------------------------
async def _reconfigctl(controller: Controller, *argv: str) -> int:
    flags = ("--controller", controller.address, "--token-file", controller.token_file)
    return await asyncio.to_thread(main, [*argv, *flags])  # this loop serves the controller meanwhile


def _json_out(stdout: str) -> dict:
    """The JSON document printed on stdout (among any log lines of the in-process controller)."""
    return json.JSONDecoder().raw_decode(stdout, stdout.index("{\n"))[0]


def _printed(text: str, stdout: str) -> bool:
    """`text` printed as whole lines of stdout (log lines of the in-process controller may come before or after:
    it logs on its own loop while the CLI runs in a thread)."""
    return "\n" + text + "\n" in "\n" + stdout


async def test_eplb_status_and_rebalance_exit_0(controller, capsys):
    assert await _reconfigctl(controller, "eplb", "status") == 0
    assert _printed(format_expert_status(expert_status()), capsys.readouterr().out)
    assert await _reconfigctl(controller, "eplb", "status", "--json") == 0
    assert _json_out(capsys.readouterr().out) == message_to_json(expert_status())
    assert await _reconfigctl(controller, "eplb", "rebalance") == 0
    assert _printed(format_rebalance(REBALANCED), capsys.readouterr().out)
    assert await _reconfigctl(controller, "eplb", "rebalance", "--json") == 0
    assert _json_out(capsys.readouterr().out)["epoch"] == 4


@pytest.mark.parametrize(("code", "exit_code", "message"), [
    (grpc.StatusCode.FAILED_PRECONDITION, 2, "refused (FAILED_PRECONDITION): router at {router}: EPLB needs an "
                                             "expert-parallel layout"),
    (grpc.StatusCode.ABORTED, 1, "ABORTED from the router at {router}: EPLB needs an expert-parallel layout"),
    (grpc.StatusCode.UNAVAILABLE, 1, "UNAVAILABLE from the router at {router}: EPLB needs an expert-parallel layout"),
])
async def test_rebalance_exit_codes(controller, capsys, code, exit_code, message):
    controller.router.error = (code, "EPLB needs an expert-parallel layout")
    assert await _reconfigctl(controller, "eplb", "rebalance") == exit_code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"reconfigctl eplb rebalance: {message.format(router=controller.router_address)}\n"


async def test_rebalance_refused_by_the_controller_exits_2(controller, capsys):
    controller.reconfigurer.claim("op-7")
    assert await _reconfigctl(controller, "eplb", "rebalance") == 2
    err = capsys.readouterr().err
    assert "refused (FAILED_PRECONDITION): cannot rebalance the experts now: operation 'op-7'" in err


async def test_status_of_an_ep_layout_shows_the_balance(controller, capsys):
    assert await _reconfigctl(controller, "status") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["topology:", "ep2pp1"]
    assert balance_line(expert_status()) in lines
    assert lines[lines.index(balance_line(expert_status())) + 1] == "last operation: none"
    assert await _reconfigctl(controller, "status", "--json") == 0
    assert json.loads(capsys.readouterr().out)["experts"]["balancedness"] == 0.75
    controller.router.error = (grpc.StatusCode.UNAVAILABLE, "a worker did not report its expert load")
    assert await _reconfigctl(controller, "status") == 0  # the rest of the status is still worth showing
    assert (f"experts: unknown (UNAVAILABLE from the router at {controller.router_address}: a worker did not report "
            "its expert load)") in capsys.readouterr().out.splitlines()
