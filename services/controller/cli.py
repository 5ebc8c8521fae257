"""The controller's commands of `reconfigctl` (services.ctl puts them beside the front router's): `status`, `plan`,
`reconfigure`, `add-worker`, `eplb status|rebalance` (MoE expert load balancing), `autopilot status|set`,
`calibrate` and `intent check|draft` (SLO intents)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from services.controller.autopilot import cli as autopilot_cli
from services.controller.autopilot.intent_cli import add_intent_parser, intent_command
from services.controller.client import (
    EXIT_OK,
    CommandFailed,
    Target,
    fetch_expert_status,
    fetch_plan,
    fetch_status,
    resolve_target,
    run_add_worker,
    run_rebalance,
    run_reconfigure,
    tls_from_args,
)
from services.controller.eplb_view import balance_line, format_expert_status, format_rebalance, message_to_json
from services.controller.progress import PhaseDisplay, format_bytes, operation_lines, ordered_phases, outcome_line
from services.controller.status import OperationState, OperationStatus, StackStatus, WorkerState, WorkerStatus
from services.rpc.reconfig.v1 import controller_pb2, router_pb2
from services.rpc.tls import add_tls_arguments

DEFAULT_TIMEOUT_S = 10.0   # status and plan; reconfigure waits for the operation (the controller has a deadline)
STACK_HELP = ("the stack to talk to, by name or by one of its ports, when several run (before or after the command; "
              "default: $RECONFIG_STACK, else the only one; `reconfigctl stacks` lists them)")
LAYOUT_HELP = """layouts: tpXppY (X-way tensor parallel in each of Y pipeline stages), epXppY for a mixture-of-experts model;
case-insensitive, a missing degree is 1 (tp3 = tp3pp1, pp4 = tp1pp4). Which ones a model allows depends on its heads
and layers and on the workers: `reconfigctl status` lists the running stack's. The default model (smollm2-135m: 9
heads, 3 KV heads, 30 layers) on 4 workers allows tp1pp1, tp1pp2, tp1pp3, tp1pp4 and tp3pp1."""


def _layer_partition(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layers per stage like 2,1, got {text!r}") from None
    if any(n < 1 for n in layers):
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer, got {text!r}")
    return layers


# A command another layer adds (services.ctl: the front router's `instances`): its sub-parser, and what runs it.
ExtraCommand = tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]


def build_parser(extra: Sequence[ExtraCommand] = ()) -> argparse.ArgumentParser:
    """Command-line flags."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--controller", default=os.environ.get("RECONFIG_CONTROLLER"),
                        help="controller address host:port (default: $RECONFIG_CONTROLLER, else the stack file)")
    common.add_argument("--token-file", type=Path, default=os.environ.get("RECONFIG_TOKEN_FILE"),
                        help="control-plane token file (default: $RECONFIG_TOKEN_FILE, else the stack file)")
    common.add_argument("--stack", default=argparse.SUPPRESS, metavar="NAME|PORT", help=STACK_HELP)
    add_tls_arguments(common, from_environment=True)
    common.add_argument("--timeout", type=float, default=None,
                        help=f"seconds to wait for the controller (default: {DEFAULT_TIMEOUT_S:g}; reconfigure and "
                             "eplb rebalance: until the operation ends)")
    parser = argparse.ArgumentParser(prog="reconfigctl", description="Inspect and steer a running reconfig stack.",
                                     epilog=LAYOUT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default=os.environ.get("RECONFIG_STACK"), metavar="NAME|PORT", help=STACK_HELP)
    commands = parser.add_subparsers(dest="command", required=True)
    stacks = commands.add_parser("stacks", help="the stacks running on this machine (this user's): name, launcher, "
                                                "addresses, model, layout")
    stacks.add_argument("--json", action="store_true", help="print them as JSON")
    status = commands.add_parser("status", parents=[common],
                                 help="topology, workers, requests and the last operation")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    plan = commands.add_parser("plan", parents=[common], help="what a switch to TOPOLOGY would move; changes nothing")
    reconfigure = commands.add_parser("reconfigure", parents=[common],
                                      help="switch the live layout to TOPOLOGY (exit 0 done, 1 failed, 2 refused)")
    for command in (plan, reconfigure):
        command.epilog = LAYOUT_HELP
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        command.add_argument("topology", metavar="TOPOLOGY", help="target layout, e.g. tp3pp1 (see below)")
        command.add_argument("--layer-partition", type=_layer_partition, default=(), metavar="N,N,...",
                             help="layers per pipeline stage of the target (default: even split)")
        command.add_argument("--json", action="store_true", help="print the result as JSON")
    reconfigure.add_argument("--wait", action="store_true", help="show each phase live while the switch runs")
    reconfigure.add_argument("--operation-id", default="", help="idempotency key (default: a new one)")
    reconfigure.add_argument("--deadline", type=float, default=0.0, metavar="S",
                             help="give up and restore the old layout after S seconds (default: the controller's)")
    reconfigure.add_argument("--dry-run", action="store_true", help="only say what the switch would move")
    reconfigure.add_argument("--strategy", choices=("staged", "in-place"), default="staged",
                             help="staged: build the target's shards while serving, then freeze only to move KV and "
                                  "swap (default); in-place: all of it inside the freeze")
    add = commands.add_parser("add-worker", parents=[common],
                              help="bring a worker started in join mode (a replacement) into the stack")
    add.add_argument("address", metavar="ADDRESS", help="the joining worker's host:port")
    add.add_argument("--topology", default="", help="switch into this layout once it has joined (e.g. tp1pp4)")
    add.add_argument("--operation-id", default="", help="idempotency key (default: a new one)")
    add.add_argument("--json", action="store_true", help="print the result as JSON")
    eplb = commands.add_parser("eplb", help="MoE expert load balancing (EP layouts): its status, or a rebalance now")
    eplb_commands = eplb.add_subparsers(dest="eplb_command", required=True)
    eplb_status = eplb_commands.add_parser(
        "status", parents=[common], help="per sparse layer: balancedness, rank loads and the physical -> logical map")
    rebalance = eplb_commands.add_parser(
        "rebalance", parents=[common], help="rebalance the experts now, while serving (exit 0 done, 1 failed, "
                                            "2 refused); waits until the new map is live")
    for command in (eplb_status, rebalance):
        command.add_argument("--json", action="store_true", help="print the result as JSON")
    autopilot_cli.add_parsers(commands, common)
    add_intent_parser(commands)
    for add_parser, _ in extra:
        add_parser(commands)
    return parser


def _layers(worker: WorkerStatus) -> str:
    return f"{worker.layer_start}-{worker.layer_end - 1}" if worker.state is WorkerState.ACTIVE else "-"


def _kv_heads(worker: WorkerStatus) -> str:
    if worker.state is not WorkerState.ACTIVE:
        return "-"
    return f"{worker.kv_head_start}-{worker.kv_head_end - 1}"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _operation_line(op: OperationStatus | None) -> str:
    if op is None:
        return "last operation: none"
    line = f"last operation: {op.kind} {op.operation_id} {op.state.name}"
    if op.from_topology or op.to_topology:
        line += f" ({op.from_topology} -> {op.to_topology})"
    line += f", started {_when(op.started_at)}"
    if op.ended_at:
        line += f", took {op.ended_at - op.started_at:.3f} s"
    elif op.state is OperationState.RUNNING and op.phase:
        line += f", now {op.phase}"
    if op.phase_seconds:
        line += "; " + ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in ordered_phases(op.phase_seconds))
    if op.built_groups:
        line += "; slow path: the target's process groups were built during the switch"
    if op.lost_workers:
        line += f"; lost {', '.join(op.lost_workers)}"
    if op.kv_dropped:
        line += "; KV dropped: the running requests re-prefilled"
    if op.error:
        line += f"; error: {op.error}"
    return line


def _numerics(status: StackStatus) -> str:
    """'    numerics: invariant, bfloat16 [ordered (avx512)]' (mode, dtype, what computes the products and, when they
    are not torch's, the layers' fused kernels: '[blas; triton kernels]') from the workers that answered ('' when
    none did); hosts that differ each add theirs."""
    modes = sorted({(w.numerics, w.dtype, w.gemm, w.kernels) for w in status.workers if w.numerics})

    def how(gemm: str, kernels: str) -> str:
        parts = [p for p in (gemm, f"{kernels} kernels" if kernels not in ("", "torch") else "") if p]
        return f" [{'; '.join(parts)}]" if parts else ""

    return "    numerics: " + " / ".join(f"{mode}, {dtype}" + how(gemm, kernels)
                                       for mode, dtype, gemm, kernels in modes) if modes else ""


def format_table(status: StackStatus, experts_line: str = "") -> str:
    """The human view of a status: header, one row per worker, requests, the experts' balance (EP layouts) and
    the last operation."""
    lines = [f"topology: {status.topology}    state: {status.state.name}    model: {status.model or '-'}"
             + _numerics(status)]
    if status.reason:
        lines.append(f"reason: {status.reason}")
    if status.layouts:
        lines.append(f"layouts this model allows on {len(status.workers)} workers: {', '.join(status.layouts)}")
    header = ("RANK", "PID", "STATE", "DEVICE", "STAGE", "TP", "LAYERS", "KV HEADS", "KV BLOCKS", "PARAMS",
              "ADDRESS")
    rows = [header]
    for w in status.workers:
        reachable = w.state is not WorkerState.UNREACHABLE
        rows.append((
            str(w.rank), str(w.pid) if reachable else "-", w.state.name, w.device or "-",
            str(w.pp_rank) if w.state is WorkerState.ACTIVE else "-",
            str(w.tp_rank) if w.state is WorkerState.ACTIVE else "-",
            _layers(w), _kv_heads(w),
            f"{w.num_kv_blocks_used}/{w.num_kv_blocks_total}" if reachable else "-",
            _mib(w.param_bytes) if reachable else "-", w.address,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    router = status.router
    if router is None:
        where = status.router_address or "none"
        lines.append(f"requests: unknown (router {where} did not answer)" if status.router_address
                     else "requests: unknown (no router)")
    else:
        usage = router.num_kv_blocks_used / router.num_kv_blocks_total if router.num_kv_blocks_total else 0.0
        lines.append(f"requests: {router.num_running} running, {router.num_waiting} waiting    "
                     f"KV cache: {router.num_kv_blocks_used}/{router.num_kv_blocks_total} blocks ({usage:.1%})    "
                     f"preemptions: {router.num_preemptions}")
    if experts_line:
        lines.append(experts_line)
    lines.append(_operation_line(status.last_operation))
    if status.last_operation is not None:
        lines += operation_lines(status.last_operation)
    return "\n".join(lines)


def format_plan(plan: controller_pb2.PlanResponse) -> str:
    """The human view of a plan: per worker its role before and after and what it moves, then the totals."""
    lines = [f"plan: {plan.from_topology} -> {plan.to_topology}    KV blocks in use: {plan.num_used_blocks}    "
             f"blocks per worker after: {plan.num_kv_blocks_after}    fits: {'yes' if plan.fits else 'no'}    "
             f"candidate: {'yes' if plan.is_candidate else 'no (process groups are built during the switch)'}"]
    if plan.num_requests_preempted:
        lines.append(f"requests preempted: {plan.num_requests_preempted}")
    header = ("RANK", "STATE", "KV IN", "KV LOCAL", "WEIGHTS LOAD", "WEIGHTS KEEP", "PEAK EXTRA", "BLOCKS AFTER")
    rows = [header]
    for w in plan.workers:
        rows.append((str(w.rank), f"{w.state_before} -> {w.state_after}", format_bytes(w.kv_bytes_in),
                     format_bytes(w.kv_bytes_local), format_bytes(w.weight_bytes_load),
                     format_bytes(w.weight_bytes_keep), format_bytes(w.peak_extra_bytes), str(w.num_kv_blocks_after)))
    workers = plan.workers
    rows.append(("total", "", *(format_bytes(sum(getattr(w, name) for w in workers)) for name in (
        "kv_bytes_in", "kv_bytes_local", "weight_bytes_load", "weight_bytes_keep")),
        f"max {format_bytes(max((w.peak_extra_bytes for w in workers), default=0))}", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("staging: " + ("yes, each worker builds its WEIGHTS LOAD beside the live shard while serving"
                                if plan.stages else f"no ({plan.staging_note}): in place, inside the freeze"))
    if reshard := sum(w.weight_bytes_reshard for w in workers):
        lines.append(f"of the weights loaded, {format_bytes(reshard)} of experts can change view by all-to-all with "
                     "the stage's peers instead (TP <-> EP; over NCCL by default)")
    if len(plan.pools) > 1 or any(p.src_pool for p in plan.placements):  # to, from or between EP layouts
        lines.append("running requests' KV after: " + ", ".join(
            f"pool {p.pool}: {p.num_requests} requests / {p.num_blocks} blocks" for p in plan.pools))
    if experts := max((w.expert_peak_extra_bytes for w in workers), default=0):
        lines.append(f"in place, experts need at most {format_bytes(experts)} beyond the larger shard on a worker "
                     "(each sparse layer's old experts go as its new ones arrive; a rollback reads them from the store)")
    return "\n".join(lines)


def plan_to_json(plan: controller_pb2.PlanResponse) -> dict:
    """JSON-ready form of a plan (integers stay integers)."""

    def scalars(pb) -> dict:
        return {f.name: getattr(pb, f.name) for f in pb.DESCRIPTOR.fields if f.message_type is None}

    return {**scalars(plan), "workers": [scalars(w) for w in plan.workers],
            "pools": [scalars(p) for p in plan.pools], "placements": [scalars(p) for p in plan.placements]}


def _is_expert_parallel(topology: str) -> bool:
    return topology.startswith("ep")  # the controller's canonical form (str(Topology)): epXppY for an EP layout


def _status_command(args: argparse.Namespace, target: Target) -> int:
    timeout_s = args.timeout or DEFAULT_TIMEOUT_S
    status = fetch_status(target, timeout_s)
    experts: router_pb2.ExpertStatusResponse | str | None = None  # asked only in EP layouts (it asks every worker)
    if _is_expert_parallel(status.topology):
        try:
            experts = fetch_expert_status(target, timeout_s)
        except CommandFailed as exc:  # the status itself is still worth showing
            experts = str(exc)
    if args.json:
        out = status.to_json()
        if experts is not None:
            out["experts"] = {"error": experts} if isinstance(experts, str) else message_to_json(experts)
        print(json.dumps({"stack": target.stack, **out}, indent=2))
    else:
        if target.stack:  # found through its stack file: say which one
            print(f"stack {target.stack!r}, controller {target.controller_address}")
        print(format_table(status, _experts_line(experts)))
    return EXIT_OK


def _experts_line(experts: router_pb2.ExpertStatusResponse | str | None) -> str:
    if experts is None:
        return ""
    return f"experts: unknown ({experts})" if isinstance(experts, str) else balance_line(experts)


def _plan_command(args: argparse.Namespace, target: Target) -> int:
    plan = fetch_plan(target, args.topology, args.layer_partition, args.timeout or DEFAULT_TIMEOUT_S)
    print(json.dumps(plan_to_json(plan), indent=2) if args.json else format_plan(plan))
    return EXIT_OK


def _reconfigure_command(args: argparse.Namespace, target: Target) -> int:
    request = controller_pb2.ReconfigureRequest(
        topology=args.topology, operation_id=args.operation_id or uuid.uuid4().hex[:12],
        deadline_seconds=args.deadline, dry_run=args.dry_run, layer_partition=args.layer_partition,
        strategy=args.strategy,
    )
    # With --json stdout is only the JSON: the live display goes to stderr.
    display = PhaseDisplay(sys.stderr if args.json else sys.stdout) if args.wait and not args.dry_run else None
    try:
        op = run_reconfigure(target, request, args.timeout, display)
    except KeyboardInterrupt:
        raise CommandFailed(f"interrupted; operation {request.operation_id} goes on in the controller "
                            "(`reconfigctl status` follows it)") from None
    if args.json:
        print(json.dumps(op.to_json(), indent=2))
    elif args.dry_run:
        print(f"dry run: {op.from_topology} -> {op.to_topology} would move {format_bytes(op.kv_bytes_moved)} of KV "
              f"and load {format_bytes(op.weight_bytes_loaded)} of weights; nothing changed "
              f"(`reconfigctl plan {args.topology}` shows each worker)")
    elif display is not None:
        display.finish(op)
    else:
        print("\n".join([outcome_line(op), *operation_lines(op)]))
    if op.state is not OperationState.SUCCEEDED:
        raise CommandFailed(f"operation {op.operation_id} {op.state.name}: {op.error or 'no reason given'}")
    return EXIT_OK


def _add_worker_command(args: argparse.Namespace, target: Target) -> int:
    request = controller_pb2.AddWorkerRequest(address=args.address, topology=args.topology,
                                              operation_id=args.operation_id or uuid.uuid4().hex[:12])
    op = run_add_worker(target, request, args.timeout)
    print(json.dumps(op.to_json(), indent=2) if args.json else "\n".join([outcome_line(op), *operation_lines(op)]))
    if op.state is not OperationState.SUCCEEDED:
        raise CommandFailed(f"operation {op.operation_id} {op.state.name}: {op.error or 'no reason given'}")
    return EXIT_OK


def _eplb_command(args: argparse.Namespace, target: Target) -> int:
    if args.eplb_command == "status":
        response = fetch_expert_status(target, args.timeout or DEFAULT_TIMEOUT_S)
        print(json.dumps(message_to_json(response), indent=2) if args.json else format_expert_status(response))
    else:  # rebalance: like reconfigure, it waits for the operation unless --timeout says otherwise
        response = run_rebalance(target, args.timeout)
        print(json.dumps(message_to_json(response), indent=2) if args.json else format_rebalance(response))
    return EXIT_OK


_COMMANDS = {"status": _status_command, "plan": _plan_command, "reconfigure": _reconfigure_command,
             "add-worker": _add_worker_command, "eplb": _eplb_command,
             "autopilot": autopilot_cli.autopilot_command, "calibrate": autopilot_cli.calibrate_command}


def _stacks_command(args: argparse.Namespace) -> int:
    from services.runtime.stacks import list_stacks

    stacks = list_stacks()
    rows = [{"name": s.name, "launcher_pid": s.claim.pid, "state": "up" if s.stack else "starting",
             "http": s.stack.router_http_address if s.stack else "", "controller":
             s.stack.controller_address if s.stack else "", "model": s.stack.model if s.stack else "",
             "topology": s.stack.topology if s.stack else ""} for s in stacks]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no stack is running (start one with `reconfig up`)")
    else:
        header = {key: key.upper().replace("_", " ") for key in rows[0]}
        widths = {key: max(len(str(row[key])) for row in [header, *rows]) for key in header}
        for row in [header, *rows]:
            print("  ".join(str(row[key]).ljust(widths[key]) for key in header).rstrip())
    return EXIT_OK


def main(argv: list[str] | None = None, extra: Mapping[str, ExtraCommand] | None = None) -> int:
    """Run one command: 0 ok; 1 unreachable or failed; 2 usage, or a refused request. `extra`: commands of other
    layers, by name, that need no controller."""
    extra = extra or {}
    args = build_parser(tuple(extra.values())).parse_args(argv)  # exits 2 on a usage error
    if args.command == "intent":  # needs no controller
        return intent_command(args)
    if args.command == "stacks":
        return _stacks_command(args)
    if args.command in extra:
        return extra[args.command][1](args)
    try:
        target = resolve_target(args.controller, args.token_file, args.stack, tls_from_args(args))
        return _COMMANDS[args.command](args, target)
    except CommandFailed as exc:
        name = " ".join(filter(None, (args.command, getattr(args, "eplb_command", None),
                                      getattr(args, "autopilot_command", None))))
        print(f"reconfigctl {name}: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
