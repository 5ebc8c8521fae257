"""deploy/k8s/reconfig.yaml: every container's command parses with its service's own argument parser, and the pieces
point at each other (workers' ranks and ports, the router's and controller's worker lists, the front's instances,
the shared memory and the token)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "k8s" / "reconfig.yaml"
TOKEN_DIR = "/run/secrets/reconfig"


def _documents() -> dict[str, dict]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in documents}


def _parse(command: list[str]):
    """The container's `python -m services.X ...` parsed by services.X's own parser (SystemExit on a bad flag)."""
    assert command[:2] == ["python", "-m"], command
    module, argv = command[2], [str(a) for a in command[3:]]
    if module == "services.weightstore":
        from services.weightstore.__main__ import parse_args

        return parse_args(argv)
    parsers = {"services.worker": "services.worker.__main__", "services.router": "services.router.__main__",
               "services.controller": "services.controller.__main__", "services.front": "services.front.__main__"}
    build_parser = __import__(parsers[module], fromlist=["build_parser"]).build_parser
    return build_parser().parse_args(argv)


@pytest.fixture(scope="module")
def instance():
    docs = _documents()
    pod = docs["StatefulSet/reconfig-instance"]["spec"]["template"]["spec"]
    return docs, pod, {c["name"]: c for c in pod["containers"]}


def test_every_command_parses_with_its_services_parser(instance):
    docs, _, containers = instance
    front = docs["Deployment/reconfig-front"]["spec"]["template"]["spec"]["containers"]
    for container in [*containers.values(), *front]:
        try:
            _parse(container["command"])
        except SystemExit as exc:  # argparse's way of refusing a flag
            pytest.fail(f"{container['name']}: {container['command']} does not parse ({exc})")


def test_one_instance_per_pod_wired_together(instance):
    docs, pod, containers = instance
    workers = [_parse(c["command"]) for name, c in sorted(containers.items()) if name.startswith("worker-")]
    assert [w.rank for w in workers] == list(range(len(workers))) and {w.world_size for w in workers} == {len(workers)}
    addresses = [f"127.0.0.1:{w.port}" for w in workers]
    assert len(set(addresses)) == len(workers)  # one network namespace: a port each
    store = _parse(containers["weightstore"]["command"])
    assert all(w.store_port == store.store_port and w.weightstore == f"127.0.0.1:{store.port}" for w in workers)
    router, controller = _parse(containers["router"]["command"]), _parse(containers["controller"]["command"])
    assert router.workers.split(",") == addresses and list(controller.workers) == addresses
    assert controller.router_grpc == f"127.0.0.1:{router.grpc_port}"
    assert {w.topology for w in workers} == {controller.topology}
    # The weight store's shared memory is the pod's memory-backed /dev/shm, mounted where the workers map it.
    shm = next(v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
    for name in ["weightstore", *(n for n in containers if n.startswith("worker-"))]:
        assert {"name": shm, "mountPath": "/dev/shm"} in containers[name]["volumeMounts"], name
    # Every control-plane client and server reads the token from the mounted secret.
    for name, container in containers.items():
        if "--token-file" in container["command"]:
            token_file = container["command"][container["command"].index("--token-file") + 1]
            assert token_file.startswith(TOKEN_DIR + "/")
            assert any(m["mountPath"] == TOKEN_DIR for m in container["volumeMounts"]), name
    # One instance per node.
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"


def test_the_front_reaches_every_instances_router(instance):
    docs, _, containers = instance
    statefulset = docs["StatefulSet/reconfig-instance"]
    service = docs["Service/reconfig-instance"]
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == "reconfig-instance"
    router = _parse(containers["router"]["command"])
    assert router.host == "0.0.0.0" and router.grpc_port in [p["port"] for p in service["spec"]["ports"]]
    front = _parse(docs["Deployment/reconfig-front"]["spec"]["template"]["spec"]["containers"][0]["command"])
    expected = [f"reconfig-instance-{i}.reconfig-instance:{router.grpc_port}"
                for i in range(statefulset["spec"]["replicas"])]
    assert front.instances.split(",") == expected
    front_service = docs["Service/reconfig-front"]["spec"]
    assert front.http_port in [p["port"] for p in front_service["ports"]]
