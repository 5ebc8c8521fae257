"""Shared helpers for the weightstore tests: tiny checkpoints and a leftover-segment guard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.weightstore.shm import SEGMENT_PREFIX, list_segments

CONFIG = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}


def make_tensors(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two files' worth of tensors; odd sizes so that 64-byte alignment needs padding."""
    generator = torch.Generator().manual_seed(seed)
    first = {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=generator),  # F32, 140 bytes
        "model.layers.0.self_attn.q_proj.weight": torch.randn(3, 11, generator=generator).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(3, generator=generator).to(torch.float16),
        "model.norm.weight": torch.randn(13, generator=generator).to(torch.bfloat16),
    }
    second = {
        "lm_head.weight": torch.randn(9, 3, generator=generator).to(torch.float16),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(2, 2, 2, generator=generator),
        "rotary.inv_freq": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5, dtype=torch.float64),  # 0-dim
        "empty": torch.zeros(0, 4),
    }
    return first, second


def make_checkpoint(directory: Path, *, with_index: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write config.json and two safetensors files into `directory`; return every tensor by name."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    first, second = make_tensors(seed)
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for file_name, tensors in files.items():
        save_file(tensors, str(directory / file_name))
    if with_index:
        weight_map = {name: file_name for file_name, tensors in files.items() for name in tensors}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {**first, **second}


def segments_of(pid: int) -> list[str]:
    """Existing segments named for process `pid`."""
    return list_segments(f"{SEGMENT_PREFIX}{pid}-")


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order, whatever its dtype."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="session")
def no_leftover_segments():
    """Fails the session if this test process leaves any store segment behind."""
    yield
    assert segments_of(os.getpid()) == [], "this test process left shared-memory segments behind"
