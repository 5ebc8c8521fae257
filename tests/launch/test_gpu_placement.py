"""The launcher places workers on GPUs before anything starts, and refuses two NCCL ranks on one GPU (issue 18)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.up_config import UpConfig
from services.topology import DevicePlacementError
from tests.conftest import make_checkpoint


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one visible GPU, as far as the launcher can tell (nothing touches CUDA)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_four_nccl_workers_on_one_gpu_are_refused_before_start(one_gpu):
    """The issue's case: `reconfig up --device cuda` with 4 workers on a one-GPU machine."""
    with pytest.raises(DevicePlacementError, match="4 workers on 1 GPU .* --gpu-sharing"):
        LocalCluster(ClusterConfig(model="no-such-model", num_workers=4, topology="tp2pp2", device="cuda"))


def test_shared_gpu_places_every_rank_on_it(one_gpu, tmp_path):
    model = make_checkpoint(tmp_path / "llama-gpus", "llama")
    cluster = LocalCluster(ClusterConfig(model=str(model), num_workers=2, topology="tp1pp2", device="cuda",
                                         gpu_sharing=True))
    assert cluster.gpus == (0, 0)


def test_gpu_flags_need_cuda():
    with pytest.raises(ValueError, match="need --device cuda"):
        LocalCluster(ClusterConfig(num_workers=1, gpus=(0,)))
    with pytest.raises(ValueError, match="count"):
        UpConfig.load(None, {"gpus": "all of them"})


def test_reconfig_up_without_a_visible_gpu_exits_2_before_starting(tmp_path):
    any_ports = ("--http-port", "0", "--grpc-port", "0", "--controller-port", "0", "--controller-metrics-port", "0")
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--device", "cuda", "--gpus", "1", *any_ports],
                            capture_output=True, text=True, timeout=120,
                            env={"PATH": "", "CUDA_VISIBLE_DEVICES": "", "RECONFIG_RUN_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert "no GPU is visible" in result.stderr and "reconfig is up" not in result.stdout
    assert not list(tmp_path.glob("stacks/*/*"))  # refused before the stack wrote anything it leaves
