"""tests/test_cast_gemm.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_cast_gemm import *  # noqa: F401,F403
