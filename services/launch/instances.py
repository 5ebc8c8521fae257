"""`reconfig up --instances N`: N instances (each its workers, router and controller, one weight store shared by
all) behind one front router that places requests with a MELL-family policy and moves them live between instances.

An instance that dies loses only its own requests' KV (the front router places them again); the front router
dying stops the stack. Each instance keeps its own controller: `reconfigctl --controller ADDRESS reconfigure ...`
switches its layout (`reconfigctl instances` lists the addresses).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import structlog

from services.launch.cluster import ClusterConfig, ClusterError, LocalCluster
from services.topology import Topology

log = structlog.get_logger(__name__)


def instance_topologies(topology: str, instances: int, per_instance: str = "") -> list[str]:
    """The layout of each instance: `per_instance` ("tp1pp2,tp2pp1") or `topology` for every one."""
    layouts = [t.strip() for t in per_instance.split(",") if t.strip()] if per_instance else [topology] * instances
    if len(layouts) != instances:
        raise ValueError(f"{len(layouts)} instance topologies for {instances} instances")
    for layout in layouts:
        Topology.parse(layout)
    return layouts


def up_instances(config) -> int:
    """Start the instances and the front router; supervise until Ctrl-C/SIGTERM (0) or the front dies (1)."""
    from services.controller.server import ControllerConfig, run_controller
    from services.front.server import FrontConfig, run_front
    from services.launch.stackfile import StackFile, run_dir
    from services.launch.up import StopRequested, raise_stop
    from services.model.converted import ConsoleProgress
    from services.model.presets import resolve_model
    from services.router.main import RouterConfig, run_router
    from services.rpc.auth import generate_token, write_token_file

    layouts = instance_topologies(config.topology, config.instances, config.instance_topologies)
    resolve_model(config.model, progress=ConsoleProgress())
    token = generate_token()
    token_file = run_dir() / "token"
    write_token_file(token_file, token)
    threads = max(1, (os.cpu_count() or 1) // (config.instances * config.workers))
    previous = {sig: signal.signal(sig, raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    clusters: list[LocalCluster] = []
    entries: list[dict] = []
    stack_file = None
    started = time.perf_counter()
    try:
        for index, layout in enumerate(layouts):
            name = f"i{index}"
            cluster = LocalCluster(ClusterConfig(
                model=config.model, num_workers=config.workers, topology=layout, device=config.device,
                kv_cache_bytes=config.kv_cache_mb << 20, block_size=config.block_size, host=config.host, token=token,
                num_threads=threads, weightstore_address=clusters[0].weightstore_address if clusters else ""))
            clusters.append(cluster)
            cluster.start()
            router = cluster.spawn_service("router", run_router, RouterConfig(
                worker_addresses=tuple(cluster.worker_addresses), model_dir=str(cluster.model_dir),
                model_name=config.model if not os.path.isdir(config.model) else cluster.model_dir.name,
                host=config.host, http_port=0, grpc_port=0, token=token, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, max_waiting=config.max_waiting))
            router_grpc = f"{config.host}:{router['grpc_port']}"
            controller = cluster.spawn_service("controller", run_controller, ControllerConfig(
                host=config.host, port=0, token=token, worker_addresses=tuple(cluster.worker_addresses),
                router_grpc_address=router_grpc, topology=layout, model=config.model,
                model_dir=str(cluster.model_dir), state_file=str(run_dir() / f"controller-state-{name}.json"),
                metrics_port=None))
            entries.append({"name": name, "router_grpc": router_grpc, "topology": layout,
                            "controller": f"{config.host}:{controller['port']}"})
            print(f"reconfig up: instance {name} ({layout}, {config.workers} workers) is up: router {router_grpc}, "
                  f"controller {entries[-1]['controller']}", flush=True)
        front = clusters[0].spawn_service("front", run_front, FrontConfig(
            instance_addresses=tuple(e["router_grpc"] for e in entries), model_dir=str(clusters[0].model_dir),
            model_name=config.model if not os.path.isdir(config.model) else clusters[0].model_dir.name,
            host=config.host, http_port=config.http_port, grpc_port=config.front_grpc_port, token=token,
            api_key=config.api_key, policy=config.policy, http_keep_alive_s=config.http_keep_alive_s,
            shutdown_grace_s=config.shutdown_grace_s))
        http = f"http://{config.host}:{front['http_port']}"
        stack_file = StackFile(
            controller_address=entries[0]["controller"], router_http_address=http,
            router_grpc_address=entries[0]["router_grpc"], token_file=str(token_file),
            pids={"launcher": os.getpid(), **{f"{e['name']}-{n}": pid for e, c in zip(entries, clusters)
                                               for n, pid in c.pids.items()}},
            model=config.model, topology=",".join(layouts), started_at=time.time(),
            front_grpc_address=f"{config.host}:{front['grpc_port']}", instances=entries)
        stack_file.write()
        print(f"reconfig is up in {time.perf_counter() - started:.1f}s: {config.instances} instances of "
              f"{config.model} ({', '.join(layouts)}) behind one front router (policy {config.policy})\n"
              f"  OpenAI API   {http}/v1   (metrics {http}/metrics)\n"
              f"  instances    reconfigctl instances   (drain: reconfigctl instances drain NAME)\n"
              f"Ctrl-C stops the stack.", flush=True)
        return _supervise(clusters, entries)
    except StopRequested as stop:
        print(f"reconfig up: {stop} received; stopping the stack", file=sys.stderr, flush=True)
        return 0
    except ClusterError as exc:
        print(f"reconfig up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if clusters:
            clusters[0].stop_services(("front",), timeout_s=config.shutdown_grace_s + 10.0)  # it drains first
        for cluster in reversed(clusters):  # the first holds the shared weight store: it stops last
            cluster.stop(timeout_s=config.shutdown_grace_s + 10.0)
        if stack_file is not None:
            stack_file.remove()
        token_file.unlink(missing_ok=True)
        for entry in entries:
            (run_dir() / f"controller-state-{entry['name']}.json").unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(clusters: list[LocalCluster], entries: list[dict]) -> int:
    """Report what dies; an instance's death is the front router's to absorb, the front's ends the stack."""
    while True:
        if (lost := clusters[0].reap_dead_service("front")) is not None:
            print(f"reconfig up: the front router ({lost}) exited; stopping the stack", file=sys.stderr, flush=True)
            return 1
        for cluster, entry in zip(clusters, entries):
            gone = [*cluster.reap_dead_workers(),
                    *(lost for service in ("router", "controller") if (lost := cluster.reap_dead_service(service)))]
            if gone:
                print(f"reconfig up: instance {entry['name']} lost {', '.join(gone)}; the front router places its "
                      "requests on the other instances", file=sys.stderr, flush=True)
        time.sleep(0.25)
