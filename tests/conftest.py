"""Shared test fixtures: tiny shapes so the suite fits a 2-core CI budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"

# Tiny shapes for the built-ins (same code paths as the defaults, a fraction of the time).
TINY = {
    "gpt": {"batch_size": 2, "seq_len": 16, "n_layer": 2, "d_model": 32, "n_head": 2, "vocab": 64},
    "cnn": {"batch_size": 4, "image_size": 8, "width": 8, "blocks_per_stage": 1},
    "mlp": {"batch_size": 8, "width": 32, "depth": 4, "d_in": 8},
}


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield


def cuda_only():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
