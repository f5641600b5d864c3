"""tests/test_compile.py on CUDA: compiled te_parallel modules against eager, where eager runs the native
kernels and the compiled graph their traced torch paths and the te_parallel::fp8_gemm op."""
from tests.test_compile import *  # noqa: F401,F403
