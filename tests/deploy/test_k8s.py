"""deploy/k8s/reconfig.yaml: every container's command parses with its service's own argument parser, and the pieces
point at each other (workers' ranks and ports, the router's and controller's worker lists, the front's instances,
the shared memory and the token). Its schema validation: tests/deploy/test_k8s_lws.py, with the LeaderWorkerSet's."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import K8S, load_documents, parse

MANIFEST = K8S / "reconfig.yaml"
TOKEN_DIR = "/run/secrets/reconfig"


@pytest.fixture(scope="module")
def instance():
    docs = load_documents(MANIFEST)
    pod = docs["StatefulSet/reconfig-instance"]["spec"]["template"]["spec"]
    return docs, pod, {c["name"]: c for c in pod["containers"]}


def test_every_command_parses_with_its_services_parser(instance):
    docs, _, containers = instance
    front = docs["Deployment/reconfig-front"]["spec"]["template"]["spec"]["containers"]
    for container in [*containers.values(), *front]:
        try:
            parse(container["command"])
        except SystemExit as exc:  # argparse's way of refusing a flag
            pytest.fail(f"{container['name']}: {container['command']} does not parse ({exc})")


def test_one_instance_per_pod_wired_together(instance):
    docs, pod, containers = instance
    workers = [parse(c["command"]) for name, c in sorted(containers.items()) if name.startswith("worker-")]
    assert [w.rank for w in workers] == list(range(len(workers))) and {w.world_size for w in workers} == {len(workers)}
    addresses = [f"127.0.0.1:{w.port}" for w in workers]
    assert len(set(addresses)) == len(workers)  # one network namespace: a port each
    store = parse(containers["weightstore"]["command"])
    assert all(w.store_port == store.store_port and w.weightstore == f"127.0.0.1:{store.port}" for w in workers)
    router, controller = parse(containers["router"]["command"]), parse(containers["controller"]["command"])
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
    router = parse(containers["router"]["command"])
    assert router.host == "0.0.0.0" and router.grpc_port in [p["port"] for p in service["spec"]["ports"]]
    front = parse(docs["Deployment/reconfig-front"]["spec"]["template"]["spec"]["containers"][0]["command"])
    expected = [f"reconfig-instance-{i}.reconfig-instance:{router.grpc_port}"
                for i in range(statefulset["spec"]["replicas"])]
    assert front.instances.split(",") == expected
    front_service = docs["Service/reconfig-front"]["spec"]
    assert front.http_port in [p["port"] for p in front_service["ports"]]
