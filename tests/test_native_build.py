"""The native extension builds and imports on a machine without a GPU (CPU CI).

Where nvcc is on PATH (and TE_PARALLEL_SKIP_NATIVE is unset), `pip install -e .` must have built
te_parallel._C with cudart linked statically, so it imports with no driver and no libcudart.so.
Argument checks of the C API run before any CUDA call, so they are testable here too (this file and
tests/test_native_norm.py call the extension itself for that; te_parallel's own code reaches it only
through te_parallel.native).
"""
import importlib
import os
import shutil
import sys
import warnings

import pytest
import torch

from te_parallel import native
from te_parallel.native import scaling as native_scaling


def _native_expected_reason():
    if os.environ.get("TE_PARALLEL_SKIP_NATIVE"):
        return "TE_PARALLEL_SKIP_NATIVE is set, so no native build is expected"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH, so no native build is expected"
    return None


def _gpu_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


needs_native = pytest.mark.skipif(_native_expected_reason() is not None,
                                  reason=_native_expected_reason() or "")


@pytest.fixture
def C():
    return importlib.import_module("te_parallel._C")


@needs_native
def test_extension_imports_and_reports_version(C):
    assert C.version() == "0.1.0"
    assert C.__version__ == "0.1.0"
    assert C.cuda_runtime_version() >= 12000
    archs = C.built_archs()
    assert archs and all(isinstance(a, str) and a[:2].isdigit() for a in archs), archs


@needs_native
def test_device_count_never_crashes(C):
    count = C.device_count()
    assert count >= 0
    if not _gpu_present():
        assert count == 0


@needs_native
@pytest.mark.parametrize(
    "state, algo, match",
    [
        ((0, 0, 0, 4, 2), 0, "states\\[0\\] has a NULL pointer"),
        ((8, 8, 8, 0, 2), 0, "history_len = 0"),
        ((8, 8, 8, 4, 0), 0, "num_tensors = 0"),
        ((8, 8, 8, 4, 2), 2, "amax_algo = 2"),
    ],
)
def test_invalid_arguments_raise_before_any_cuda_call(C, state, algo, match):
    with pytest.raises(RuntimeError, match=match):
        C.delayed_scaling_update([state], 448.0, 1.0, algo, True, 0)


@needs_native
def test_empty_state_list_is_a_no_op(C):
    assert C.delayed_scaling_update([], 448.0, 1.0, 0, True, 0) is None


@needs_native
def test_launch_without_gpu_raises_cuda_error(C):
    if C.device_count() > 0:
        pytest.skip("a GPU is present: a launch on fake pointers would fault, not fail cleanly")
    # Valid-looking (never dereferenced) pointers: the launch itself fails for lack of a device.
    with pytest.raises(RuntimeError, match="launch for states \\[0, 1\\) of 1 failed: cuda"):
        C.delayed_scaling_update([(256, 512, 768, 4, 2)], 448.0, 1.0, 0, True, 0)


@needs_native
def test_wrapper_rejects_cpu_tensors():
    assert native.available()
    hist, scale, scale_inv = torch.rand(4, 2), torch.rand(2), torch.rand(2)
    assert not native_scaling.usable([(hist, scale, scale_inv)])  # CPU states take the torch update
    with pytest.raises(ValueError, match="amax_history is \\(4, 2\\) torch.float32 .* on cpu"):
        native_scaling.fused_delayed_scaling_update([(hist, scale, scale_inv)], fp8_max=448.0,
                                                    scale_divisor=1.0, algo="max", update_scale=True)
    with pytest.raises(ValueError, match="algo='mean'; need one of \\('max', 'most_recent'\\)"):
        native_scaling.fused_delayed_scaling_update([], fp8_max=448.0, scale_divisor=1.0, algo="mean",
                                                    update_scale=True)


def test_missing_extension_warns_once(monkeypatch):
    """Without _C, load() returns None and warns exactly once per process."""
    monkeypatch.setitem(sys.modules, "te_parallel._C", None)  # makes the import fail
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_load_attempted", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.load() is None
        assert not native.available()
    absent = [w for w in caught if issubclass(w.category, native.NativeKernelsAbsentWarning)]
    assert len(absent) == 1, [str(w.message) for w in caught]
    assert "native kernels are absent" in str(absent[0].message)
