"""Names that exist in TE and are imported by its clients at load time, but that te_parallel does not
implement (MoE grouped GEMMs and permutations, context parallelism, MXFP8 / NVFP4 / block-scaled
tensors, TE's fused optimizers' kernels, ...). Importing them works; using them raises
NotImplementedError naming what is missing."""
from __future__ import annotations

__all__ = ["missing_class", "missing_function", "not_implemented"]


_PACKAGE = "transformer_engine.pytorch"


def not_implemented(name: str, what: str, package: str = _PACKAGE):
    raise NotImplementedError(f"{package}.{name}: {what} is not implemented in te_parallel "
                              f"(docs/compat.md lists what the stand-in provides)")


def missing_class(name: str, what: str, base: type = object, package: str = _PACKAGE) -> type:
    """A class that can be imported, subclassed and used in isinstance checks; constructing one raises."""

    def __init__(self, *args, **kwargs):
        not_implemented(name, what, package)

    short = name.rsplit(".", 1)[-1]
    return type(short, (base,), {"__init__": __init__, "__doc__": f"Import-only: {what} (not implemented)."})


def missing_function(name: str, what: str, package: str = _PACKAGE):
    """A function that can be imported; calling it raises."""

    def function(*args, **kwargs):
        not_implemented(name, what, package)

    function.__name__ = function.__qualname__ = name.rsplit(".", 1)[-1]
    function.__doc__ = f"Import-only: {what} (not implemented)."
    return function
