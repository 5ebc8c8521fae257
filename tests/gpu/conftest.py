"""tests/gpu: run by hand on a machine with CUDA (`python3 -m pytest -m gpu tests/gpu`, ../shared/gpu/README.md);
every test here is marked `gpu` and skipped where CUDA is absent (CI)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.multiprocess)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
