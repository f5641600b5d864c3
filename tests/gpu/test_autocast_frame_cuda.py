"""tests/test_autocast_frame.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_autocast_frame import *  # noqa: F401,F403
