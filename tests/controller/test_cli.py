"""`reconfigctl status` against the package's real stack: the table, --json, finding the stack by itself, and its
exit codes (in process, plus one run of the module as a command)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from services.controller import (
    OperationState,
    OperationStatus,
    StackState,
    StackStatus,
    WorkerState,
    WorkerStatus,
)
from services.controller.cli import format_table
from services.ctl import main
from services.router.contracts import EngineStats
from services.rpc.auth import write_token_file
from services.runtime.stackfile import StackFile
from services.runtime.stacks import StackClaim
from tests.controller.conftest import MODEL, NUM_WORKERS, TOPOLOGY, closed_port, frozen_router


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No stack of the developer's, no controller from the environment."""
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("RECONFIG_CONTROLLER", raising=False)
    monkeypatch.delenv("RECONFIG_TOKEN_FILE", raising=False)


async def _reconfigctl(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))  # this test's loop keeps serving its gRPC calls meanwhile


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f}"


@pytest.mark.multiprocess
async def test_table_of_a_frozen_stack_with_requests(stack, capsys):
    async with frozen_router(stack, num_running=1, num_waiting=1) as router:
        code = await _reconfigctl("status", "--controller", stack.controller_address, "--token-file",
                                  stack.token_file)
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["topology:", TOPOLOGY, "state:", "FROZEN", "model:", MODEL, "numerics:", "fast,",
                                "float32", "[blas]"]
    assert lines[1] == "reason: the router is frozen: no step is scheduled"
    header = lines[3].split()
    assert header[:4] == ["RANK", "PID", "STATE", "DEVICE"] and "ADDRESS" in header
    rows = [line.split() for line in lines[4:4 + NUM_WORKERS]]
    infos, pids, addresses = stack.worker_infos(), stack.cluster.worker_pids, stack.worker_addresses
    used, total = router.num_kv_blocks_used, router.num_kv_blocks_total
    assert rows[0] == ["0", str(pids[0]), "ACTIVE", "cpu", "0", "0", "0-2", "0-0", f"{used}/{infos[0].num_kv_blocks}",
                       _mib(infos[0].param_bytes), "MiB", addresses[0]]
    assert rows[1] == ["1", str(pids[1]), "ACTIVE", "cpu", "0", "1", "0-2", "1-1", f"{used}/{infos[1].num_kv_blocks}",
                       _mib(infos[1].param_bytes), "MiB", addresses[1]]
    assert rows[2] == ["2", str(pids[2]), "STANDBY", "cpu", "-", "-", "-", "-", "0/0", "0.0", "MiB", addresses[2]]
    assert "requests: 1 running, 1 waiting" in lines[8]
    assert f"KV cache: {used}/{total} blocks ({used / total:.1%})" in lines[8] and used >= 3
    assert lines[9] == "last operation: none"


@pytest.mark.multiprocess
async def test_json_is_the_same_status(stack, capsys):
    argv = ("status", "--json", "--controller", stack.controller_address, "--token-file", stack.token_file)
    assert await _reconfigctl(*argv) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["topology"], status["state"], status["model"], status["reason"]) == (TOPOLOGY, "SERVING", MODEL, "")
    assert [w["state"] for w in status["workers"]] == ["ACTIVE", "ACTIVE", "STANDBY"]
    assert [w["pid"] for w in status["workers"]] == stack.cluster.worker_pids
    assert [w["address"] for w in status["workers"]] == stack.worker_addresses
    assert [w["kv_head_start"] for w in status["workers"]][:2] == [0, 1]
    assert [w["param_bytes"] for w in status["workers"]] == [i.param_bytes for i in stack.worker_infos()]
    router = status["router"]
    assert (router["num_running"], router["num_waiting"], router["num_kv_blocks_used"]) == (0, 0, 0)
    assert router["num_kv_blocks_total"] == status["workers"][0]["num_kv_blocks_total"] > 0
    assert status["router_address"] == stack.router_address and status["last_operation"] is None


@pytest.mark.multiprocess
async def test_finds_the_stack_by_itself(stack, capsys):
    with StackClaim.take("test", "127.0.0.1", {}) as claim:  # as `reconfig up` holds its stack
        StackFile(controller_address=stack.controller_address, router_http_address="http://127.0.0.1:1",
                  router_grpc_address=stack.router_address, token_file=stack.token_file,
                  pids={"launcher": os.getpid()}, name="test").write(claim.stack_file)
        assert await _reconfigctl("status", "--json") == 0
        status = json.loads(capsys.readouterr().out)
        assert (status["stack"], status["state"]) == ("test", "SERVING")
        assert await _reconfigctl("status") == 0
        table = capsys.readouterr().out
        assert table.startswith(f"stack 'test', controller {stack.controller_address}\ntopology: {TOPOLOGY}")
    assert await _reconfigctl("status") == 1  # its launcher let go: no stack


@pytest.mark.multiprocess
def test_the_module_runs_as_a_command(stack, tmp_path):
    """`python -m services.ctl status --json`, finding the stack through $RECONFIG_RUN_DIR."""
    with StackClaim.take("test", "127.0.0.1", {}) as claim:
        StackFile(controller_address=stack.controller_address, router_http_address="", token_file=stack.token_file,
                  router_grpc_address=stack.router_address, pids={"test": os.getpid()}, model=MODEL,
                  topology=TOPOLOGY, started_at=time.time()).write(claim.stack_file)
        result = subprocess.run([sys.executable, "-m", "services.ctl", "status", "--json"],
                                capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert (status["topology"], status["state"]) == (TOPOLOGY, "SERVING")
    assert [w["pid"] for w in status["workers"]] == stack.cluster.worker_pids


@pytest.mark.multiprocess
async def test_wrong_token_exits_1(stack, tmp_path, capsys):
    other = tmp_path / "other-token"
    write_token_file(other)
    assert await _reconfigctl("status", "--controller", stack.controller_address, "--token-file", str(other)) == 1
    assert f"the controller at {stack.controller_address} refused the token" in capsys.readouterr().err


async def test_unreachable_controller_exits_1(tmp_path, capsys):
    token_file = tmp_path / "token"
    write_token_file(token_file)
    address = f"127.0.0.1:{closed_port()}"
    argv = ("status", "--controller", address, "--token-file", str(token_file), "--timeout", "2")
    assert await _reconfigctl(*argv) == 1
    assert f"cannot reach the controller at {address}: UNAVAILABLE" in capsys.readouterr().err


def test_no_stack_exits_1(tmp_path, capsys):
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert f"no running reconfig stack found (looked in {tmp_path / 'run' / 'stacks'})" in err
    assert "start one with `reconfig up`" in err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["status", "--bogus"], ["status", "--timeout", "soon"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: reconfigctl" in capsys.readouterr().err


def test_table_of_a_degraded_stack_after_an_operation():
    status = StackStatus(
        topology="tp1pp2", state=StackState.DEGRADED, model="tiny", reason="worker 1 (h:2) unreachable: UNAVAILABLE",
        workers=(
            WorkerStatus(rank=0, address="h:1", state=WorkerState.ACTIVE, pid=7, device="cuda:0", pp_rank=0,
                         layer_start=0, layer_end=2, kv_head_start=0, kv_head_end=2, num_kv_blocks_used=3,
                         num_kv_blocks_total=10, param_bytes=3 << 20),
            WorkerStatus(rank=1, address="h:2", state=WorkerState.UNREACHABLE, error="unreachable: UNAVAILABLE"),
        ),
        router_address="h:9", router=None,
        last_operation=OperationStatus("op-7", "reconfigure", OperationState.ROLLED_BACK, started_at=100.0,
                                       ended_at=101.25, error="worker 1 gone", phase_seconds={"QUIESCING": 0.5},
                                       from_topology="tp2pp1", to_topology="tp1pp2"),
    )
    lines = format_table(status).splitlines()
    assert lines[1] == "reason: worker 1 (h:2) unreachable: UNAVAILABLE"
    assert lines[4].split() == ["0", "7", "ACTIVE", "cuda:0", "0", "0", "0-1", "0-1", "3/10", "3.0", "MiB", "h:1"]
    assert lines[5].split() == ["1", "-", "UNREACHABLE", "-", "-", "-", "-", "-", "-", "-", "h:2"]
    assert lines[7] == "requests: unknown (router h:9 did not answer)"
    assert lines[8].startswith("last operation: reconfigure op-7 ROLLED_BACK (tp2pp1 -> tp1pp2), started ")
    assert lines[8].endswith("took 1.250 s; QUIESCING 0.500 s; error: worker 1 gone")
    assert StackStatus.from_pb(status.to_pb()) == status
    assert json.loads(json.dumps(status.to_json()))["last_operation"]["state"] == "ROLLED_BACK"


def test_the_header_says_how_the_workers_compute():
    worker = WorkerStatus(rank=0, address="h:1", state=WorkerState.ACTIVE, numerics="invariant", dtype="bfloat16",
                          gemm="ordered (avx512)")
    status = StackStatus(topology="tp1pp1", state=StackState.SERVING, model="tiny", workers=(worker,))
    assert format_table(status).splitlines()[0] == ("topology: tp1pp1    state: SERVING    model: tiny    "
                                                    "numerics: invariant, bfloat16 [ordered (avx512)]")
    assert StackStatus.from_pb(status.to_pb()) == status
    fused = WorkerStatus(rank=0, address="h:1", state=WorkerState.ACTIVE, numerics="fast", dtype="bfloat16",
                         gemm="blas", kernels="triton")
    status = StackStatus(topology="tp1pp1", state=StackState.SERVING, model="tiny", workers=(fused,))
    assert format_table(status).splitlines()[0].endswith("numerics: fast, bfloat16 [blas; triton kernels]")
    assert StackStatus.from_pb(status.to_pb()) == status


def test_router_stats_in_json_keep_their_counters():
    status = StackStatus(topology="tp1pp1", state=StackState.SERVING,
                         router=EngineStats(num_preemptions=4, extra={"num_step_errors": 1.0}))
    assert status.to_json()["router"]["num_preemptions"] == 4
    assert status.to_json()["router"]["extra"] == {"num_step_errors": 1.0}


def test_a_status_whose_only_change_is_the_routers_load_window_is_the_same_for_watch_status():
    """The window's rates over the last minute drift as time passes alone: not a change WatchStatus pushes early
    (they go out at its interval); a change of what the router runs is one."""
    import dataclasses

    from services.controller import StackState, StackStatus
    from services.router.contracts import EngineStats
    from services.router.load_window import LoadSnapshot

    before = StackStatus("tp1pp1", StackState.SERVING, router=EngineStats(num_running=2), updated_at=1.0)
    drifted = dataclasses.replace(before, updated_at=2.0, router=dataclasses.replace(
        before.router, window=LoadSnapshot(arrival_rate=0.5, num_requests=30)))
    assert drifted.same_as(before) and before.same_as(drifted)
    assert not dataclasses.replace(drifted, router=EngineStats(num_running=3)).same_as(before)
    assert not dataclasses.replace(before, router=None).same_as(before) and not before.same_as(None)


def test_a_plan_to_an_ep_layout_shows_where_the_running_requests_kv_goes():
    from services.controller.cli import format_plan, plan_to_json
    from services.rpc.reconfig.v1 import controller_pb2, router_pb2

    plan = controller_pb2.PlanResponse(
        from_topology="tp4pp1", to_topology="ep2pp1", workers=[controller_pb2.WorkerPlan(rank=0)],
        placements=[router_pb2.RequestPlacement(request_id="a", src_pool=0, dst_pool=1, num_blocks=3),
                    router_pb2.RequestPlacement(request_id="b", src_pool=0, dst_pool=-1, num_blocks=9)],
        pools=[controller_pb2.PoolPlan(pool=0), controller_pb2.PoolPlan(pool=1, num_requests=1, num_blocks=3)],
        num_requests_preempted=1)
    text = format_plan(plan)
    assert "requests preempted: 1" in text
    assert "running requests' KV after: pool 0: 0 requests / 0 blocks, pool 1: 1 requests / 3 blocks" in text
    data = plan_to_json(plan)
    assert data["placements"][1] == {"request_id": "b", "src_pool": 0, "dst_pool": -1, "num_blocks": 9}
    assert [p["num_blocks"] for p in data["pools"]] == [0, 3]
    dense = controller_pb2.PlanResponse(from_topology="tp2pp2", to_topology="tp2pp1",
                                        pools=[controller_pb2.PoolPlan(pool=0, num_requests=2, num_blocks=5)])
    assert "KV after" not in format_plan(dense)  # one pool on both sides: nothing to say


def test_reconfigctl_imports_no_torch():
    """Every call of the CLI pays its imports: torch alone took 2 s of each `reconfigctl status` and `--help`."""
    code = ("import sys; from services.ctl import build_parser, main; build_parser(); "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'scipy', 'statsmodels', 'pydantic', "
            "'transformers', 'fastapi'}); print(heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", (result.stdout, result.stderr)
