"""`reconfig up --instances N`: N instances (each its workers, router and controller, one weight store shared by
all) behind one front router that places requests with a MELL-family policy and moves them live between instances.

An instance that dies loses only its own requests' KV (the front router places them again); the front router
dying stops the stack. Each instance keeps its own controller: `reconfigctl --controller ADDRESS reconfigure ...`
switches its layout (`reconfigctl instances` lists the addresses).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

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


class InstanceSet:
    """The processes of each instance of one stack (its cluster of weight store and workers, its router and
    controller). The first cluster's weight store serves every instance: that instance is never stopped alone."""

    def __init__(self, config, token: str, threads: int, claim) -> None:
        self.config, self.token, self.threads, self.claim = config, token, threads, claim
        self.clusters: dict[str, LocalCluster] = {}
        self.entries: dict[str, dict] = {}  # name -> {name, router_grpc, controller, topology}

    @property
    def first(self) -> str:
        return next(iter(self.clusters))

    def start(self, layout: str) -> dict:
        """Start an instance of `layout` (its workers load their shards from the shared weight store); its entry.
        ClusterError if it did not start (whatever started is stopped)."""
        from services.controller.server import ControllerConfig, run_controller
        from services.front.instances import free_name
        from services.router.main import RouterConfig, run_router

        config, host = self.config, self.config.host
        name = free_name(self.clusters)
        Topology.parse(layout)
        cluster = LocalCluster(ClusterConfig(
            model=config.model, num_workers=config.workers, topology=layout, device=config.device,
            kv_cache_bytes=config.kv_cache_mb << 20, block_size=config.block_size, host=host, token=self.token,
            num_threads=self.threads, tls=config.tls, dtype=config.dtype, numerics=config.numerics,
            weightstore_address=self.clusters[self.first].weightstore_address if self.clusters else ""))
        self.clusters[name] = cluster
        try:
            cluster.start()
            router = cluster.spawn_service("router", run_router, RouterConfig(
                worker_addresses=tuple(cluster.worker_addresses), model_dir=str(cluster.model_dir),
                model_name=config.model if not os.path.isdir(config.model) else cluster.model_dir.name,
                host=host, http_port=0, grpc_port=0, token=self.token, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, max_waiting=config.max_waiting,
                spread_decodes=config.spread_decodes, async_scheduling=config.async_scheduling,
                api_servers=0, tls=config.tls))  # clients reach an instance through the front router's gRPC, not its HTTP
            router_grpc = f"{host}:{router['grpc_port']}"
            controller = cluster.spawn_service("controller", run_controller, ControllerConfig(
                host=host, port=0, token=self.token, worker_addresses=tuple(cluster.worker_addresses),
                router_grpc_address=router_grpc, topology=layout, model=config.model,
                model_dir=str(cluster.model_dir), state_file=str(self.claim.state_file(name)),
                metrics_port=None, tls=config.tls))
        except BaseException:
            if len(self.clusters) > 1:  # the first one's failure ends the stack: stop_all stops it
                self.clusters.pop(name).stop()
            raise
        self.entries[name] = {"name": name, "router_grpc": router_grpc, "topology": layout,
                              "controller": f"{host}:{controller['port']}"}
        print(f"reconfig up: instance {name} ({layout}, {config.workers} workers) is up: router {router_grpc}, "
              f"controller {self.entries[name]['controller']}", flush=True)
        return self.entries[name]

    def stop(self, name: str, timeout_s: float) -> None:
        """Stop one instance's processes (not the first: its weight store serves the others)."""
        if name not in self.clusters:
            raise KeyError(name)
        if name == self.first:
            raise ValueError(f"{name} hosts the weight store every instance reads")
        self._stop(name, timeout_s)
        print(f"reconfig up: instance {name} stopped", flush=True)

    def stop_all(self, timeout_s: float) -> None:
        for name in reversed(list(self.clusters)):  # the first holds the shared weight store: it stops last
            self._stop(name, timeout_s)

    def _stop(self, name: str, timeout_s: float) -> None:
        self.entries.pop(name, None)
        self.clusters.pop(name).stop(timeout_s=timeout_s)  # services first, then workers
        self.claim.state_file(name).unlink(missing_ok=True)

    def pids(self) -> dict[str, int]:
        return {f"{name}-{n}": pid for name, cluster in self.clusters.items() for n, pid in cluster.pids.items()}

    def serve(self, request: dict) -> dict:
        """One request of the front router's (services.front.launcher): start or stop an instance."""
        reply = {"id": request.get("id")}
        try:
            if request.get("op") == "start":
                entry = self.start(request.get("topology") or self.entries[self.first]["topology"])
                reply.update(name=entry["name"], address=entry["router_grpc"])
            elif request.get("op") == "stop":
                self.stop(request.get("name", ""), self.config.shutdown_grace_s + 10.0)
            else:
                reply["error"] = f"unknown request {request.get('op')!r}"
        except KeyError as exc:
            reply["error"] = f"no instance {exc.args[0]!r} was started by this stack"
        except (ValueError, ClusterError) as exc:
            reply["error"] = str(exc)
        return reply


def up_instances(config, claim) -> int:
    """Start the instances and the front router (`claim`: the stack's name and ports, taken by the caller);
    supervise until Ctrl-C/SIGTERM (0) or the front dies (1); start and stop instances when the front router asks
    (`reconfigctl instances start|stop`)."""
    from services.launch.session import StackSession
    from services.model.converted import ConsoleProgress
    from services.model.presets import resolve_model

    layouts = instance_topologies(config.topology, config.instances, config.instance_topologies)
    resolve_model(config.model, progress=ConsoleProgress())
    session = StackSession(claim)
    threads = max(1, (os.cpu_count() or 1) // (max(config.instances, config.max_instances) * config.workers))
    instances = InstanceSet(config, session.token, threads, claim)

    def stop() -> None:
        timeout_s = config.shutdown_grace_s + 10.0
        if instances.clusters:  # the front drains first
            instances.clusters[instances.first].stop_services(("front",), timeout_s=timeout_s)
        instances.stop_all(timeout_s=timeout_s)

    return session.run(lambda: _serve(config, layouts, instances, session), stop)


def _serve(config, layouts: list[str], instances: InstanceSet, session) -> int:
    from services.front.server import FrontConfig, run_front
    from services.runtime.stackfile import StackFile

    started = time.perf_counter()
    for layout in layouts:
        instances.start(layout)
    first = instances.clusters[instances.first]
    launcher_end, front_end = mp.Pipe()
    front = first.spawn_service("front", run_front, FrontConfig(
        instance_addresses=tuple(e["router_grpc"] for e in instances.entries.values()),
        model_dir=str(first.model_dir),
        model_name=config.model if not os.path.isdir(config.model) else first.model_dir.name,
        host=config.host, http_port=config.http_port, grpc_port=config.front_grpc_port, token=session.token,
        api_key=config.api_key, policy=config.policy, http_keep_alive_s=config.http_keep_alive_s,
        shutdown_grace_s=config.shutdown_grace_s, autoscale=config.autoscale_settings(), tls=config.tls),
        front_end, (instances.first,))
    http = f"http://{config.host}:{front['http_port']}"
    entry = instances.entries[instances.first]
    stack_file = _write_stack(session, StackFile(
        controller_address=entry["controller"], router_http_address=http, router_grpc_address=entry["router_grpc"],
        token_file=str(session.token_file), model=config.model, started_at=time.time(), name=session.name,
        front_grpc_address=f"{config.host}:{front['grpc_port']}"), instances)
    scaling = f", up to {config.max_instances} by itself" if config.max_instances else ""
    print(f"reconfig is up in {time.perf_counter() - started:.1f}s: {config.instances} instances of "
          f"{config.model} ({', '.join(layouts)}{scaling}) behind one front router (policy {config.policy})\n"
          f"  OpenAI API   {http}/v1   (metrics {http}/metrics)\n"
          f"  instances    reconfigctl instances   (drain: reconfigctl instances drain NAME; more: start)\n"
          f"Ctrl-C stops the stack.", flush=True)
    return _supervise(instances, launcher_end, session, stack_file)


def _write_stack(session, stack_file, instances: InstanceSet):
    """The stack file with the instances of now (their processes, addresses, layouts), published."""
    entries = list(instances.entries.values())
    return session.publish(dataclasses.replace(stack_file, pids={"launcher": os.getpid(), **instances.pids()},
                                               instances=entries, topology=",".join(e["topology"] for e in entries)))


def _supervise(instances: InstanceSet, requests: Connection | None, session, stack_file) -> int:
    """Serve the front router's start/stop requests and report what dies; an instance's death is the front
    router's to absorb, the front's ends the stack."""
    first = instances.clusters[instances.first]
    while True:
        if (lost := first.reap_dead_service("front")) is not None:
            print(f"reconfig up: the front router ({lost}) exited; stopping the stack", file=sys.stderr, flush=True)
            return 1
        for name, cluster in instances.clusters.items():
            gone = [*cluster.reap_dead_workers(),
                    *(lost for service in ("router", "controller") if (lost := cluster.reap_dead_service(service)))]
            if gone:
                print(f"reconfig up: instance {name} lost {', '.join(gone)}; the front router places its "
                      "requests on the other instances", file=sys.stderr, flush=True)
        if requests is None:
            time.sleep(0.25)  # the supervision's pace
        elif requests.poll(0.25):  # the same pace, answering the front router meanwhile
            try:
                request = requests.recv()
            except EOFError:  # the front is gone: reaped above on the next pass
                requests = None
                continue
            requests.send(instances.serve(request))
            stack_file = _write_stack(session, stack_file, instances)
