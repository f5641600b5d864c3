from tests.test_fused_mlp import *  # noqa: F401,F403
