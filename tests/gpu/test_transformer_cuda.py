"""tests/test_transformer.py on CUDA."""
from tests.test_transformer import *  # noqa: F401,F403
