"""te_parallel's stand-in for NVIDIA Transformer Engine's Python API (`transformer_engine`).

For libraries that import TE and cannot change that import (Megatron-core, accelerate, Lightning):
`transformer_engine.pytorch` and `transformer_engine.common.recipe` are backed by te_parallel. What is
mapped, what works and what exists only for import: docs/compat.md. It refuses to load where NVIDIA's
TE is installed too (it would shadow it).
"""
import sys

from transformer_engine._real_te import find_real_te

__version__ = "2.9.0+teparallel.0.1.0"  # the TE release whose client code paths this serves (docs/compat.md)
IS_TE_PARALLEL_COMPAT = True  # how a tool that times NVIDIA's TE beside te_parallel tells the two apart

_found = find_real_te(p for p in sys.path if isinstance(p, str))
if _found is not None:
    raise ImportError(f"transformer_engine: te_parallel's stand-in is installed beside NVIDIA's Transformer Engine "
                      f"({_found}); remove one of them (pip uninstall transformer-engine)")

from transformer_engine import common  # noqa: E402
from transformer_engine import pytorch  # noqa: E402

__all__ = ["common", "pytorch", "__version__"]
