"""tests/test_autocast.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_autocast import *  # noqa: F401,F403
