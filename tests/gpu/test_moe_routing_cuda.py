"""tests/test_moe_routing.py on CUDA: the permutation, chunk sorting, router and FP8 padding helpers with their
inputs on the GPU (the `device` fixture of tests/gpu/conftest.py), against the same fp64 references."""
from tests.test_moe_routing import *  # noqa: F401,F403
