"""tests/test_seed_quickstart.py on CUDA (the `device` fixture of tests/gpu/conftest.py)."""
from tests.test_seed_quickstart import *  # noqa: F401,F403
