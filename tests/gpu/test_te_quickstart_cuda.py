"""tests/test_te_quickstart.py (TE's PyTorch quick start) on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_te_quickstart import *  # noqa: F401,F403
