"""tests/test_modules.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_modules import *  # noqa: F401,F403
