"""tests/test_errors.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_errors import *  # noqa: F401,F403
