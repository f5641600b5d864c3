"""tests/test_checkpoint.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_checkpoint import *  # noqa: F401,F403
