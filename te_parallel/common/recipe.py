"""Alias of `te_parallel.recipe` under TE's path `transformer_engine.common.recipe`."""
from te_parallel.recipe import *  # noqa: F401,F403
from te_parallel.recipe import __all__  # noqa: F401
