"""tests/gpu: the CPU suite's numerics tests again, on CUDA (cuBLASLt `_scaled_mm`, device casts).

Skipped with the reason where there is no CUDA GPU or it cannot run FP8.
"""
import pytest
import torch


@pytest.fixture
def device() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip(f"needs compute capability >= 8.9 for FP8, this GPU has {major}.{minor}")
    return "cuda"

