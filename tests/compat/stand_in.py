"""The compat tests need te_parallel's `transformer_engine` stand-in installed (`pip install ./compat`, done by
.ci/install_clients.sh); `require()` skips the calling test module, with the reason, when it is not."""
import pytest


def require() -> None:
    try:
        import transformer_engine
    except ImportError as e:
        pytest.skip(f"transformer_engine is not importable ({e}); install the stand-in: pip install ./compat",
                    allow_module_level=True)
    version = getattr(transformer_engine, "__version__", "")
    if "teparallel" not in version:
        pytest.skip(f"transformer_engine {version} is NVIDIA's TE, not te_parallel's stand-in", allow_module_level=True)
