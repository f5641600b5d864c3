"""The stand-in's face: distribution metadata and version checks, TE's recipes (mutable, TE's keywords),
autocast / model-init names, FP8GlobalStateManager, support checks, import-only names, and the refusal
to shadow NVIDIA's TE."""
from tests.compat import stand_in

stand_in.require()

import importlib
import importlib.metadata
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

import te_parallel
import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

# Module paths TE's clients import at load time (Megatron-core 0.16, accelerate 1.15, Lightning 2.6).
CLIENT_MODULES = [
    "transformer_engine.common.recipe", "transformer_engine.pytorch", "transformer_engine.pytorch.fp8",
    "transformer_engine.pytorch.quantization", "transformer_engine.pytorch.distributed",
    "transformer_engine.pytorch.tensor", "transformer_engine.pytorch.tensor.float8_tensor",
    "transformer_engine.pytorch.tensor.mxfp8_tensor", "transformer_engine.pytorch.tensor.nvfp4_tensor",
    "transformer_engine.pytorch.tensor.float8_blockwise_tensor", "transformer_engine.pytorch.tensor.utils",
    "transformer_engine.pytorch.float8_tensor", "transformer_engine.pytorch.module.base",
    "transformer_engine.pytorch.module.linear", "transformer_engine.pytorch.module.layernorm_linear",
    "transformer_engine.pytorch.module.layernorm", "transformer_engine.pytorch.attention",
    "transformer_engine.pytorch.attention.rope", "transformer_engine.pytorch.cpu_offload",
    "transformer_engine.pytorch.cpp_extensions", "transformer_engine.pytorch.utils",
    "transformer_engine.pytorch.constants", "transformer_engine.pytorch.graph", "transformer_engine.pytorch.permutation",
    "transformer_engine.pytorch.router", "transformer_engine.pytorch.ops",
]


def test_version_metadata_and_checks():
    version = transformer_engine.__version__
    assert importlib.metadata.version("transformer_engine") == version
    assert importlib.metadata.version("transformer-engine") == version
    lightning_utilities = pytest.importorskip("lightning_utilities")
    assert bool(lightning_utilities.core.imports.RequirementCache("transformer_engine>=0.11.0"))


def test_megatron_sees_the_supported_te_version():
    utils = pytest.importorskip("megatron.core.utils")
    assert utils.is_te_min_version("2.9.0") and not utils.is_te_min_version("2.10.0")


@pytest.mark.parametrize("name", CLIENT_MODULES)
def test_client_module_paths_import(name):
    importlib.import_module(name)


def test_recipes_are_mutable_and_converted_at_use():
    r = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.E4M3, amax_history_len=16,
                              override_linear_precision=(False, False, False), reduce_amax=False)
    with te.fp8_autocast(fp8_recipe=r):
        first = FP8GlobalStateManager.get_fp8_recipe()
    r.amax_history_len, r.margin = 4, 1
    with te.autocast(recipe=r) as _:
        assert FP8GlobalStateManager.get_fp8_recipe() is r
    converted = recipe.to_te_parallel(r)
    assert first is r and converted.amax_history_len == 4 and converted.margin == 1
    assert converted.fp8_format == te_parallel.recipe.Format.E4M3 and converted.reduce_amax is False
    # TE's DelayedScaling has no GEMM fields: its modules run fprop with fast accumulation, dgrad / wgrad exact
    assert converted.fp8_gemm_fprop.use_split_accumulator is False
    assert converted.fp8_gemm_dgrad.use_split_accumulator is converted.fp8_gemm_wgrad.use_split_accumulator is True


def test_current_scaling_keeps_te_gemm_settings():
    r = recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    converted = recipe.to_te_parallel(r)
    assert isinstance(converted, te_parallel.recipe.Float8CurrentScaling)
    assert converted.fp8_gemm_fprop.use_split_accumulator is False  # TE's default for current scaling
    assert converted.fp8_gemm_wgrad.use_split_accumulator is True


def test_unknown_keywords_warn_once_naming_them():
    with pytest.warns(UserWarning, match="params_dtype"):
        recipe.DelayedScaling(params_dtype=torch.bfloat16, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe.DelayedScaling(params_dtype=torch.bfloat16, device="cpu")  # once is enough


def test_fp8_dpa_carries_over_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = recipe.to_te_parallel(recipe.DelayedScaling(fp8_dpa=True, amax_history_len=3))
    assert converted.fp8_dpa and not converted.fp8_mha
    with pytest.raises(ValueError, match="fp8_dpa / fp8_mha"):
        recipe.to_te_parallel(recipe.Float8BlockScaling(fp8_dpa=True))


def test_recipes_te_parallel_does_not_have_raise_at_use():
    for cls in (recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling):
        r = cls()  # construction works (clients build them from configs)
        assert not r.delayed() and not r.float8_per_tensor_scaling()
        with pytest.raises(NotImplementedError, match="not implemented in te_parallel"):
            te.fp8_autocast(fp8_recipe=r)
    import te_parallel.recipe as tp_recipe

    assert isinstance(recipe.to_te_parallel(recipe.Float8BlockScaling()), tp_recipe.Float8BlockScaling)
    with pytest.raises(NotImplementedError, match="override_linear_precision"):
        te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(override_linear_precision=(False, False, True)))
    with pytest.raises(ValueError, match="E5M2"):
        recipe.DelayedScaling(fp8_format=recipe.Format.E5M2)


def test_support_checks():
    assert te.fp8.check_fp8_support() == (True, "")
    assert te.fp8.check_fp8_block_scaling_support() == (True, "")  # (the CPU emulates it)
    for check in (te.fp8.check_mxfp8_support, te.fp8.check_nvfp4_support):
        ok, reason = check()
        assert ok is False and "Blackwell" in reason
    assert te.is_fp8_available() is True and te.is_mxfp8_available(return_reason=True)[0] is False


def test_state_manager_reports_the_region():
    assert not FP8GlobalStateManager.is_fp8_enabled()
    r = recipe.DelayedScaling()
    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is r
        assert FP8GlobalStateManager.is_first_fp8_module() and not FP8GlobalStateManager.is_first_fp8_module()
        with te.fp8_autocast(enabled=False):
            assert not FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_group() is None
    with pytest.raises(NotImplementedError, match="amax buffers"):
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)


def test_model_init_names_hold_fp8_weights():
    for init in (te.fp8_model_init, te.quantized_model_init):
        params = inspect.signature(init).parameters
        assert "recipe" in params and "preserve_high_precision_init_val" in params
        with init(enabled=True, recipe=recipe.DelayedScaling()):
            m = te.Linear(32, 32, device="cpu")
        assert isinstance(m.weight, te.QuantizedTensor) and isinstance(m.weight, te.Float8Tensor)
        assert not isinstance(torch.zeros(1), te.QuantizedTensor)


def test_import_only_names_raise_when_used():
    from transformer_engine.pytorch.tensor.utils import cast_master_weights_to_fp8

    for use in (lambda: te.ops.Sequential(), lambda: cast_master_weights_to_fp8([], [], [], None),
                lambda: te.tensor.MXFP8Tensor()):
        with pytest.raises(NotImplementedError, match="not implemented in te_parallel"):
            use()


def test_cpu_offload_context():
    ctx, sync = te.get_cpu_offload_context(enabled=False)
    with ctx:
        pass
    ctx, sync = te.get_cpu_offload_context(True, 1, 2, True, False, False)
    x = torch.randn(4, 4, requires_grad=True)
    with ctx:
        assert ctx.inside_context
        y = (x * x).sum()
    assert not ctx.inside_context and sync(y) is y
    y.backward()
    assert torch.equal(x.grad, 2 * x)
    with pytest.raises(NotImplementedError, match="offload_weights"):
        te.get_cpu_offload_context(True, 1, 2, True, True)


# --- refusing to shadow NVIDIA's TE -----------------------------------------------------------------
def _fake_site(tmp_path, entry: str):
    site = tmp_path / "site"
    site.mkdir()
    (site / entry).mkdir() if entry.endswith("-info") else (site / entry).write_bytes(b"")
    return site


@pytest.mark.parametrize("entry", ["transformer_engine_cu12-2.9.0.dist-info", "transformer_engine_torch-2.9.0.dist-info",
                                   "transformer_engine_torch.cpython-311-x86_64-linux-gnu.so"])
def test_real_te_is_detected(tmp_path, entry):
    from transformer_engine._real_te import find_real_te

    assert find_real_te([str(_fake_site(tmp_path, entry))]) is not None


def test_this_stand_in_is_not_mistaken_for_te():
    from transformer_engine._real_te import find_real_te

    dist = importlib.metadata.distribution("transformer-engine")
    assert find_real_te([str(dist.locate_file(""))]) is None


def test_import_refuses_beside_real_te(tmp_path):
    site = _fake_site(tmp_path, "transformer_engine_cu12-2.9.0.dist-info")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", "import transformer_engine"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "beside NVIDIA's Transformer Engine" in proc.stderr.splitlines()[-1]


def test_build_refuses_over_real_te(tmp_path, monkeypatch):
    root = os.path.join(os.path.dirname(__file__), "..", "..", "compat", "build_backend")
    if not os.path.isdir(root):
        pytest.skip("compat/ sources are not next to the tests")
    sys.path.insert(0, root)
    try:
        backend = importlib.import_module("te_compat_build")
    finally:
        sys.path.remove(root)
    site = str(_fake_site(tmp_path, "transformer_engine_cu12-2.9.0.dist-info"))
    monkeypatch.setattr(backend.sysconfig, "get_paths", lambda: {"purelib": site, "platlib": site})
    with pytest.raises(SystemExit, match="will not install over NVIDIA's Transformer Engine"):
        backend.get_requires_for_build_wheel()
