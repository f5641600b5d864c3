"""tests/test_te_tutorial.py (TE's getting-started tutorial) at full size on CUDA (the `device`
fixture of tests/gpu/conftest.py)."""
from tests.test_te_tutorial import *  # noqa: F401,F403
