"""Shared fixtures. `device` is "cpu" here; tests/gpu/conftest.py overrides it with "cuda" so the
same test functions run there (tests/gpu re-exports them)."""
import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
