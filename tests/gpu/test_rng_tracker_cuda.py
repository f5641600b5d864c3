"""tests/test_rng_tracker.py on CUDA (torch.cuda.get_rng_state / set_rng_state of the current device).

The RNG tracker needs CUDA but not FP8, so this file overrides tests/gpu/conftest.py's `device`
fixture (which also skips GPUs without FP8) with one that only needs a CUDA device.
"""
import pytest
import torch

from tests.test_rng_tracker import *  # noqa: F401,F403


@pytest.fixture
def device() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return "cuda"


def test_fork_leaves_the_cpu_generator_alone():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    from te_parallel.parallel.random import CudaRNGStatesTracker

    cpu_before = torch.get_rng_state().clone()
    tracker = CudaRNGStatesTracker()
    assert tracker.device.type == "cuda"
    tracker.add("model-parallel-rng", 9)
    with tracker.fork():
        torch.rand(8, device="cuda")
    assert torch.equal(torch.get_rng_state(), cpu_before)
