"""deploy/k8s/reconfig-lws.yaml, one instance over several hosts as a LeaderWorkerSet: every container's command, as the
kubelet and the shell would expand it in each pod of the group, parses with its service's own argument parser, and
the pods point at each other (ranks and world, the leader's TCPStore, the worker lists, the TLS files and the token
from the Secrets, the probes). Every document of both Kubernetes manifests validates against its schema: the built-in
kinds against the Kubernetes schemas (kubernetes-validate), the LeaderWorkerSet against its CRD's (jsonschema)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import jsonschema
import pytest

from services.topology import Topology
from tests.deploy.manifests import (K8S, argv, container_env, expand, kubernetes_versions, load_documents, parse,
                                    validate)

MANIFEST = K8S / "reconfig-lws.yaml"
TOKEN_DIR = "/run/secrets/reconfig"
TLS_DIR = "/run/secrets/reconfig-tls"
NAMESPACE = "default"
SERVICES = ("weightstore", "worker-", "router", "controller", "front")


@dataclass(frozen=True)
class Pod:
    """One pod of a group as LWS makes it: its name, its LWS_WORKER_INDEX, its template's spec and the variables LWS
    prepends to every container's environment."""

    name: str
    index: int
    spec: dict
    injected: dict[str, str]

    def env(self, container: dict) -> dict[str, str]:
        return container_env(container, self.injected, {"metadata.name": self.name, "metadata.namespace": NAMESPACE})

    def containers(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.spec["containers"]}

    def argv(self, name: str) -> list[str]:
        container = self.containers()[name]
        return argv(container, self.env(container))


def group(lws: dict, size: int | None = None, index: int = 0) -> list[Pod]:
    """Group `index`'s pods (leader first, then workers 1 .. size-1), `size` defaulting to the manifest's."""
    name, template = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size = template["size"] if size is None else size
    leader = f"{name}-{index}"
    # Subdomain policy Shared: every pod's subdomain is the LWS's headless Service, named as the LWS.
    variables = {"LWS_LEADER_ADDRESS": f"{leader}.{name}.{NAMESPACE}", "LWS_GROUP_SIZE": str(size)}
    return [Pod(leader, 0, template["leaderTemplate"]["spec"], {**variables, "LWS_WORKER_INDEX": "0"}),
            *(Pod(f"{leader}-{i}", i, template["workerTemplate"]["spec"], {**variables, "LWS_WORKER_INDEX": str(i)})
              for i in range(1, size))]


def workers(pod: Pod) -> list:
    """The pod's workers' parsed flags, by container name (worker-0, worker-1, ...)."""
    return [parse(pod.argv(name)) for name in sorted(pod.containers()) if name.startswith("worker-")]


@pytest.fixture(scope="module")
def docs():
    return load_documents(MANIFEST)


@pytest.fixture(scope="module")
def lws(docs):
    return docs["LeaderWorkerSet/reconfig"]


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    """The TLS Secret's files as the header's commands make them (`reconfig certs`, then the CA's key moved away)."""
    from services.rpc.certs import CA_KEY, write_dev_certs

    header = MANIFEST.read_text()
    hosts, out = re.search(r"reconfig certs --hosts (\S+) --out (\S+)", header).groups()
    assert f"mv {out}/{CA_KEY} " in header  # the CA's key is not in the Secret
    assert f"kubectl create secret generic reconfig-tls --from-file={out}/" in header
    assert "kubectl create secret generic reconfig-control-token " in header
    directory = tmp_path_factory.mktemp("reconfig-tls")
    write_dev_certs(hosts.split(","), directory)
    (directory / CA_KEY).unlink()
    return directory


@dataclass(frozen=True)
class Running:
    """One container as it runs: where, the host name its peers dial (its certificate's), its pod's spec, its
    environment and its command."""

    where: str
    host: str
    spec: dict
    container: dict
    env: dict[str, str]
    command: list[str]


def every_container(docs, lws) -> list[Running]:
    """Every container of the group's pods and of the front (whose certificate names its Service)."""
    running = [Running(f"{pod.name}/{name}", f"{pod.name}.{lws['metadata']['name']}", pod.spec, container,
                       pod.env(container), pod.argv(name))
               for pod in group(lws) for name, container in pod.containers().items()]
    front = docs["Deployment/reconfig-front"]["spec"]["template"]["spec"]
    for container in front["containers"]:
        env = container_env(container, {}, {})
        running.append(Running(f"front/{container['name']}", docs["Service/reconfig-front"]["metadata"]["name"],
                               front, container, env, argv(container, env)))
    return running


def test_the_expansion_is_kubernetes():
    """expand() as Kubernetes expands a command and env values (third_party/forked/golang/expansion)."""
    env = {"VAR_A": "A", "VAR_B": "B"}
    cases = {"$(VAR_A)": "A", "___$(VAR_B)___": "___B___", "$(VAR_A)-$(VAR_B)": "A-B", "$(VAR_DNE)": "$(VAR_DNE)",
             "$$(VAR_A)": "$(VAR_A)", "$$$(VAR_A)": "$A", "$$$$$$(VAR_A)": "$$$(VAR_A)", "$(VAR_A": "$(VAR_A",
             "$": "$", "$VAR_A": "$VAR_A", "$()": "$()", '"$((2 * VAR_A + 1))"': '"$((2 * VAR_A + 1))"'}
    assert {text: expand(text, env) for text in cases} == cases


def test_every_command_parses_with_its_services_parser(docs, lws, secret):
    for each in every_container(docs, lws):
        try:
            parse(each.command, {TLS_DIR: secret})
        except SystemExit as exc:  # argparse's way of refusing a flag
            pytest.fail(f"{each.where}: {each.command} does not parse ({exc})")


@pytest.mark.parametrize("size", [None, 3, 4])
def test_ranks_fill_the_world_once_whatever_the_group_size(lws, size):
    pods = group(lws, size)
    per_pod = {len(workers(pod)) for pod in pods}
    assert len(per_pod) == 1, per_pod
    everyone = [w for pod in pods for w in workers(pod)]
    world = per_pod.pop() * len(pods)
    assert sorted(w.rank for w in everyone) == list(range(world))
    assert {w.world_size for w in everyone} == {world}
    topologies = {w.topology for w in everyone}
    assert len(topologies) == 1 and Topology.parse(topologies.pop()).num_workers == world
    # Pod i holds consecutive ranks: a TP group inside a pod, the pipeline across pods.
    for pod in pods:
        ranks = [w.rank for w in workers(pod)]
        assert ranks == list(range(pod.index * len(ranks), (pod.index + 1) * len(ranks))), pod.name


def test_the_workers_meet_at_the_leaders_store_and_map_their_own_pods_weights(lws, secret):
    leader, *others = pods = group(lws)
    store = parse(leader.argv("weightstore"), {TLS_DIR: secret})
    assert store.store_port, "the leader's weight store hosts the TCPStore (it outlives any worker)"
    leader_address = f"{leader.name}.{lws['metadata']['name']}.{NAMESPACE}"  # what LWS_LEADER_ADDRESS is
    for pod in pods:
        own = parse(pod.argv("weightstore"), {TLS_DIR: secret})
        assert own.host == "127.0.0.1"
        if pod in others:
            assert own.store_port == 0, f"{pod.name}: one TCPStore per world, the leader's"
        for worker in workers(pod):
            assert (worker.store_host, worker.store_port) == (leader_address, store.store_port), pod.name
            assert worker.weightstore == f"127.0.0.1:{own.port}", pod.name
        # Before anything dials the leader by name, the pod waits until the Service names it.
        assert "$LWS_LEADER_ADDRESS" in " ".join(pod.spec["initContainers"][0]["command"])


def test_the_router_and_the_controller_name_every_worker_in_rank_order(lws):
    pods = group(lws)
    subdomain = lws["metadata"]["name"]
    assert lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared") == "Shared"
    by_rank = {}
    for pod in pods:
        ours = workers(pod)
        assert len({w.port for w in ours} | {w.step_port for w in ours}) == 2 * len(ours), f"{pod.name}: a port each"
        for worker in ours:
            assert worker.host == "0.0.0.0", "the router dials every worker from the leader pod"
            by_rank[worker.rank] = f"{pod.name}.{subdomain}:{worker.port}"  # its stable name in the headless Service
    addresses = [by_rank[rank] for rank in sorted(by_rank)]
    leader = pods[0]
    router, controller = parse(leader.argv("router")), parse(leader.argv("controller"))
    assert router.workers.split(",") == addresses
    assert list(controller.workers) == addresses
    assert controller.router_grpc == f"127.0.0.1:{router.grpc_port}"
    assert {controller.topology} == {w.topology for pod in pods for w in workers(pod)}


def test_every_service_speaks_mutual_tls_and_reads_the_token_from_the_secrets(docs, lws, secret):
    assert "RECONFIG_ALLOW_PLAINTEXT_TOKEN" not in MANIFEST.read_text(), "the token crosses pods: TLS, not plaintext"
    for each in every_container(docs, lws):
        assert each.container["name"].startswith(SERVICES), each.where
        secrets = {v["name"]: v["secret"]["secretName"] for v in each.spec["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in each.container["volumeMounts"]}
        args = parse(each.command, {TLS_DIR: secret})
        # Its certificate names the host its peers dial it at; all three files are the TLS Secret's.
        files = {"cert": f"{each.host}.pem", "key": f"{each.host}-key.pem", "ca": "ca.pem"}
        for kind, file in files.items():
            assert getattr(args, f"tls_{kind}") == str(secret / file), f"{each.where}: --tls-{kind}"
            # The same files for `kubectl exec ... python -m services.ctl` and the probes.
            assert each.env[f"RECONFIG_TLS_{kind.upper()}"] == f"{TLS_DIR}/{file}", each.where
        assert secrets[mounts[TLS_DIR]] == "reconfig-tls", each.where
        if each.container["name"] != "weightstore":  # it takes no token: it serves weights, no control RPC
            assert str(args.token_file) == f"{TOKEN_DIR}/token", each.where
            assert secrets[mounts[TOKEN_DIR]] == "reconfig-control-token", each.where


def test_shared_memory_and_gloo_in_each_pod(lws):
    for pod in group(lws):
        shm = next(v["name"] for v in pod.spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
        for name, container in pod.containers().items():
            if name == "weightstore" or name.startswith("worker-"):
                assert {"name": shm, "mountPath": "/dev/shm"} in container["volumeMounts"], f"{pod.name}/{name}"
            if name.startswith("worker-"):
                assert pod.env(container)["GLOO_SOCKET_IFNAME"] == "eth0", f"{pod.name}/{name}"


def _exec_probe(container: dict) -> str:
    command = container["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    compile(command[2], container["name"], "exec")  # at least valid Python
    return command[2]


def test_the_group_is_one_unit_ready_when_its_router_is(lws, secret):
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated", "the leader's readiness needs them"
    leader, *_ = pods = group(lws)
    router = parse(leader.argv("router"))
    probes = leader.containers()["router"]
    assert probes["readinessProbe"]["httpGet"] == {"path": "/ready", "port": router.http_port}
    assert probes["livenessProbe"]["httpGet"] == {"path": "/health", "port": router.http_port}
    for pod in pods:
        for name, container in pod.containers().items():
            if name == "weightstore" or name.startswith("worker-"):
                port = parse(pod.argv(name), {TLS_DIR: secret}).port
                code = _exec_probe(container)
                assert f"sync_channel('127.0.0.1:{port}', from_env())" in code, f"{pod.name}/{name}"
        labels = (lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"] if pod.index == 0 else
                  lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])["metadata"]["labels"]
        anti = pod.spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"].items() <= labels.items(), "one pod of the group per node"


def test_the_front_reaches_each_instances_router(docs, lws):
    name = lws["metadata"]["name"]
    router = parse(group(lws)[0].argv("router"))
    front = next(parse(each.command) for each in every_container(docs, lws) if each.where.startswith("front/"))
    assert front.instances.split(",") == [f"{name}-{g}.{name}:{router.grpc_port}"
                                          for g in range(lws["spec"]["replicas"])]
    ports = [p["port"] for p in docs["Service/reconfig-front"]["spec"]["ports"]]
    assert front.http_port in ports and front.grpc_port in ports
    # The network policy admits the instance's own pods, and the front only to the routers.
    policy = docs["NetworkPolicy/reconfig"]["spec"]
    labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    front_labels = docs["Deployment/reconfig-front"]["spec"]["template"]["metadata"]["labels"]
    front_rule = next(r for r in policy["ingress"]
                      if r["from"][0]["podSelector"]["matchLabels"].items() <= front_labels.items())
    assert front_rule["ports"] == [{"protocol": "TCP", "port": router.grpc_port}]


@pytest.mark.parametrize("version", kubernetes_versions())
@pytest.mark.parametrize("manifest", ["reconfig.yaml", "reconfig-lws.yaml"])
def test_every_document_matches_its_schema(manifest, version):
    for where, document in load_documents(K8S / manifest).items():
        try:
            validate(document, version)
        except jsonschema.ValidationError as error:
            pytest.fail(f"{manifest} {where} (Kubernetes {version}): {'.'.join(map(str, error.path))}: "
                        f"{error.message}")


def _broken(document: dict, path: str, value) -> dict:
    broken = copy.deepcopy(document)
    *parents, last = path.split(".")
    node = broken
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return broken


@pytest.mark.parametrize("path, value, refusal", [
    ("spec.leaderWorkerTemplate.sizes", 2, "'sizes' was unexpected"),                        # an unknown field
    ("spec.leaderWorkerTemplate.size", "2", "'2' is not of type 'integer'"),                 # a wrong type
    ("spec.leaderWorkerTemplate.restartPolicy", "RecreateGroupOnFailure", "is not one of"),  # not one of its values
    ("spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.commands", ["sh"],          # unknown, in a pod
     "'commands' was unexpected"),
])
def test_a_wrong_leaderworkerset_is_refused(lws, path, value, refusal):
    with pytest.raises(jsonschema.ValidationError, match=refusal):
        validate(_broken(lws, path, value), kubernetes_versions()[0])


def test_a_wrong_builtin_document_is_refused(docs):
    with pytest.raises(jsonschema.ValidationError, match="is not of type"):  # kubernetes_validate's are jsonschema's
        validate(_broken(docs["Deployment/reconfig-front"], "spec.replicas", "1"), kubernetes_versions()[0])
    with pytest.raises(jsonschema.ValidationError, match="'selectors' was unexpected"):
        validate(_broken(docs["Service/reconfig-front"], "spec.selectors", {"app": "x"}), kubernetes_versions()[0])
