"""GPU tests: real NCCL process groups, CUDA kernels, bf16 on the device. Skipped, with the reason, without a GPU.

    python -m pytest -q tests/gpu          # on a machine with at least one NVIDIA GPU
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # run_utils, forked (the suite's helpers)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"))
