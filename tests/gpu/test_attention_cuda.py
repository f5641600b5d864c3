"""tests/test_attention.py on CUDA."""
from tests.test_attention import *  # noqa: F401,F403
