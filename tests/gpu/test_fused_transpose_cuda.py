from tests.test_fused_transpose import *  # noqa: F401,F403
