"""TE 2.9's name of `transformer_engine.pytorch.fp8`."""
from transformer_engine.pytorch.fp8 import *  # noqa: F401,F403
from transformer_engine.pytorch.fp8 import __all__  # noqa: F401
