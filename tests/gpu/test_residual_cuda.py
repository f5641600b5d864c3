"""tests/test_residual.py on CUDA (the `device` fixture of tests/gpu/conftest.py): the residual in the
cuBLASLt FP8 GEMM's epilogue."""
from tests.test_residual import *  # noqa: F401,F403
