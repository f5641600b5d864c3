"""Seed 003's tutorial at full size on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_seed_tutorial import *  # noqa: F401,F403
