"""`reconfig up`: the whole stack (weightstore, workers, router, controller) as local processes on loopback; its
settings and flags are services/launch/up_config.py's."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.session import StackSession
from services.launch.up_config import UpConfig
from services.rpc.auth import read_token_file
from services.runtime.stacks import StackClaim
from services.topology import parse_gpus


def _metrics_address(config: UpConfig) -> str:
    port = config.controller_metrics_port
    return f"http://{config.host}:{port}/metrics" if port else "on a free port, in the controller's log"


def up(config: UpConfig) -> int:
    """Start the stack and supervise it. 0 after Ctrl-C/SIGTERM; 1 if the weightstore or the router died (named on
    stderr). A lost worker does not stop it: the controller recovers, and a replacement is started in join mode; a
    dead controller is started again. Refused (StackConflict) before anything loads when a running stack has its
    name or one of its ports, or another program holds one of its ports."""
    from services.model.converted import ConsoleProgress
    from services.model.presets import resolve_model

    if config.node_rank > 0:  # a follower: its weight store and workers, in the leader's instance
        from services.launch.node import up_node

        return up_node(config, cluster_config(config, read_token_file(config.token_file)))
    with StackClaim.take(config.stack_name, config.host, config.listen_ports()) as claim:
        if config.fronted:
            from services.launch.instances import up_instances

            return up_instances(config, claim)
        resolve_model(config.model, progress=ConsoleProgress())  # a preset's first use: fetch and convert
        session = StackSession(claim, read_token_file(config.token_file) if config.token_file else None)
        cluster = LocalCluster(cluster_config(config, session.token))  # checks the layout and the GPU placement
        stop = functools.partial(cluster.stop, timeout_s=config.shutdown_grace_s + 10.0)  # the router drains first
        return session.run(lambda: _serve(config, cluster, session), stop)


def cluster_config(config: UpConfig, token: str | None) -> ClusterConfig:
    """This host's weight store and workers (every node's, the leader's too)."""
    return ClusterConfig(
        model=config.model, num_workers=config.workers, topology=config.topology, device=config.device,
        gpus=parse_gpus(config.gpus), gpu_sharing=config.gpu_sharing, enforce_eager=config.enforce_eager,
        dtype=config.dtype, numerics=config.numerics, kernels=config.kernels,
        kv_cache_bytes=config.kv_cache_mb << 20,
        block_size=config.block_size, host=config.host, token=token,
        num_redundant_experts=config.num_redundant_experts, eplb_window=config.eplb_window, tls=config.tls,
        nodes=config.nodes, node_rank=config.node_rank, dist_addr=config.dist_addr,
    )


def _serve(config: UpConfig, cluster: LocalCluster, session: StackSession) -> int:
    """Start the stack's processes and supervise them (see up)."""
    from services.controller.server import ControllerConfig, run_controller
    from services.router.main import RouterConfig, run_router
    from services.runtime.stackfile import StackFile

    token, token_file = session.token, session.token_file
    started = time.perf_counter()
    cluster.start()
    router = cluster.spawn_service("router", run_router, RouterConfig(
        worker_addresses=tuple(cluster.worker_addresses), model_dir=str(cluster.model_dir),
        model_name=config.model if not os.path.isdir(config.model) else cluster.model_dir.name,
        host=config.host, http_port=config.http_port, grpc_port=config.grpc_port, token=token,
        api_key=config.api_key, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_waiting=config.max_waiting,
        http_keep_alive_s=config.http_keep_alive_s, shutdown_grace_s=config.shutdown_grace_s,
        eplb=config.eplb, eplb_step_interval=config.eplb_step_interval, spread_decodes=config.spread_decodes,
        async_scheduling=config.async_scheduling, api_servers=config.api_servers, tls=config.tls,
    ))
    router_grpc = f"{config.host}:{router['grpc_port']}"

    def pids() -> dict[str, int]:  # the stack file's: every process of the stack (the API servers' the router's)
        return {"launcher": os.getpid(), **cluster.pids, **router.get("pids", {})}

    controller_config = ControllerConfig(
        host=config.host, port=config.controller_port, token=token,
        worker_addresses=tuple(cluster.worker_addresses), router_grpc_address=router_grpc,
        topology=config.topology, model=config.model, model_dir=str(cluster.model_dir),
        state_file=str(session.claim.state_file()), staging_budget_mb=config.staging_budget_mb,
        staging_duty=config.staging_duty,
        autopilot=config.autopilot, intents_file=config.intents, metrics_port=config.controller_metrics_port,
        autopilot_policy=config.autopilot_policy, profile_file=config.profile, tls=config.tls,
    )
    controller = cluster.spawn_service("controller", run_controller, controller_config)
    http = f"http://{config.host}:{router['http_port']}"
    stack_file = session.publish(StackFile(
        controller_address=f"{config.host}:{controller['port']}", router_http_address=http,
        router_grpc_address=router_grpc, token_file=str(token_file), pids=pids(),
        model=config.model, topology=config.topology, started_at=time.time(), name=session.name,
    ))
    context = f"{router['max_model_len']} tokens a request" + (
        f" ({router['context_note']})" if router["context_note"] else "")
    hosts = f" on {config.nodes} hosts" if config.nodes > 1 else ""
    print(f"reconfig is up in {time.perf_counter() - started:.1f}s: stack {session.name!r}, {config.model} on "
          f"{len(cluster.worker_addresses)} {config.device} workers{hosts} in {config.topology}\n"
          f"  OpenAI API   {http}/v1   (health {http}/health, ready {http}/ready, metrics {http}/metrics)\n"
          f"  context      {context}\n"
          f"  router gRPC  {router_grpc}\n"
          f"  controller   {config.host}:{controller['port']}   (reconfigctl status; autopilot {config.autopilot}: "
          f"reconfigctl autopilot status; metrics {_metrics_address(config)})\n"
          f"Ctrl-C stops the stack.", flush=True)
    while True:
        for lost in cluster.reap_dead_workers():  # the controller recovers onto the survivors
            print(f"reconfig up: {lost} exited; the controller moves the stack onto the other workers",
                  file=sys.stderr, flush=True)
            if config.replace_lost_workers:
                address = cluster.start_joiner()
                stack_file = session.publish(dataclasses.replace(
                    stack_file, pids=pids(),
                    replacements=[*stack_file.replacements, address]))
                print(f"reconfig up: a replacement worker is ready at {address}; bring it in with "
                      f"`reconfigctl add-worker {address} --topology {config.topology}`", file=sys.stderr,
                      flush=True)
        if (lost := cluster.reap_dead_service("controller")) is not None:
            # Stateless but for its state file: a new one recovers the members, layout and last operation (a
            # router it left frozen resumes when the freeze's lease runs out, or by the new one's recovery).
            print(f"reconfig up: {lost} exited; starting it again", file=sys.stderr, flush=True)
            controller = cluster.spawn_service("controller", run_controller, controller_config)
            stack_file = session.publish(dataclasses.replace(
                stack_file, controller_address=f"{config.host}:{controller['port']}",
                pids=pids()))
        dead = cluster.dead_processes()
        if dead:
            print(f"reconfig up: {', '.join(dead)} exited; stopping the stack", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.25)
