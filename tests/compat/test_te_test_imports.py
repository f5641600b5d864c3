"""The names TE's own PyTorch test modules (test_sanity, test_numerics, test_recipe, test_quantized_tensor,
test_cuda_graphs and their utils.py / references/) import, from TE's paths: `transformer_engine_torch`,
`constants.TE_DType_To_Torch`, `_extra_state`, `module.is_module_grouped_tensor_path_supported`,
`module.base.get_dummy_wgrad`, `attention.dot_product_attention._attention_backends` and `.utils`,
`cpp_extensions.fused_attn.FusedAttnBackend`; what works works, the rest raises one line naming what is missing."""
from tests.compat import stand_in

stand_in.require()

import importlib
import pickle

import pytest
import torch

import te_parallel
import transformer_engine.pytorch as te
from te_parallel.fp8 import quantizers as Q
from transformer_engine.common import recipe


def test_tex_gives_dtype_codes_and_names_what_is_missing():
    import transformer_engine_torch as tex

    assert tex.DType is Q.DType is te.DType
    assert int(tex.DType.kFloat8E4M3) == 7 and int(tex.DType.kFloat4E2M1) == 10  # TE's codes
    assert not hasattr(tex, "generic_gemm")  # clients probing with hasattr see it absent
    with pytest.raises(AttributeError, match="transformer_engine_torch.generic_gemm: TE's compiled extension"):
        tex.generic_gemm
    with pytest.raises(NotImplementedError, match="context parallelism"):  # Megatron's only use (cp_size > 1)
        tex.thd_get_partitioned_indices(torch.tensor([0, 8]), 8, 2, 0)
    with pytest.raises(NotImplementedError, match="transformer_engine_torch.FP8TensorMeta"):
        tex.FP8TensorMeta()


def test_constants_map_dtype_codes_both_ways():
    from transformer_engine.pytorch.constants import DType, TE_DType, TE_DType_To_Torch

    assert DType is Q.DType
    assert TE_DType_To_Torch[DType.kFloat8E4M3] is torch.float8_e4m3fn
    assert TE_DType[torch.bfloat16] is DType.kBFloat16
    assert all(TE_DType[dtype] is code for code, dtype in TE_DType_To_Torch.items())


# --- _extra_state: TE's decision on pickled extra state ----------------------------------------------
def _payload(recipe_obj, delayed_state: bool = False) -> bytes:
    state = {"recipe": recipe_obj, "extra_fp8_variables": {}}
    if delayed_state:
        state.update(scale_fwd=torch.ones(1), amax_history_fwd=torch.zeros(1, 1))
    return pickle.dumps(state)


def test_extra_state_policy_covers_every_recipe():
    from transformer_engine.pytorch._extra_state import _RECIPE_POLICIES, CheckpointExtraStatePolicy

    classes = [recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.MXFP8BlockScaling,
               recipe.Float8BlockScaling, recipe.NVFP4BlockScaling, recipe.CustomRecipe]
    assert {("transformer_engine.common.recipe", c.__name__) for c in classes} == set(_RECIPE_POLICIES)
    assert _RECIPE_POLICIES[("transformer_engine.common.recipe", "DelayedScaling")] is \
        CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING


@pytest.mark.parametrize("payload", [b"", pickle.dumps({}), _payload(recipe.Float8CurrentScaling()),
                                     _payload(recipe.Float8BlockScaling())])
def test_stateless_extra_state_is_ignored(payload):
    from transformer_engine.pytorch._extra_state import should_load_extra_state_pickle

    assert should_load_extra_state_pickle(payload, "test") is False


@pytest.mark.parametrize("payload", [_payload(recipe.DelayedScaling(), delayed_state=True),
                                     pickle.dumps({"recipe": object()}), b"not a pickle"])
def test_stateful_or_unknown_extra_state_needs_the_opt_in(payload, monkeypatch):
    from transformer_engine.pytorch._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV, should_load_extra_state_pickle

    monkeypatch.delenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=UNSAFE_PICKLE_EXTRA_STATE_ENV):
        should_load_extra_state_pickle(payload, "test")
    monkeypatch.setenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "1")
    assert should_load_extra_state_pickle(payload, "test") is True


def test_tes_decision_on_the_stand_ins_checkpoints(monkeypatch):
    """TE reads a delayed-scaling module's extra state only with the opt-in, a norm's `{}` without; the
    stand-in loads both with no opt-in (it never executes pickled code)."""
    from transformer_engine.pytorch._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV, should_load_extra_state_pickle

    monkeypatch.delenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    m = te.Linear(16, 16, device="cpu")
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        m(torch.randn(16, 16)).sum().backward()
    blob = m.state_dict()["_extra_state"]
    with pytest.raises(RuntimeError, match=UNSAFE_PICKLE_EXTRA_STATE_ENV):
        should_load_extra_state_pickle(blob.numpy().tobytes(), "Linear")
    te.Linear(16, 16, device="cpu").load_state_dict(m.state_dict(), strict=True)
    norm_blob = te.LayerNorm(16).state_dict()["_extra_state"]
    assert should_load_extra_state_pickle(norm_blob.numpy().tobytes(), "LayerNorm") is False


# --- modules, attention, cpp_extensions ---------------------------------------------------------------
def test_module_names():
    from transformer_engine.pytorch.module import is_module_grouped_tensor_path_supported
    from transformer_engine.pytorch.module.base import get_dummy_wgrad

    # GroupedLinear's path without host split sizes: bf16 and the FP8 recipes te_parallel runs
    assert is_module_grouped_tensor_path_supported(None, torch.bfloat16) is True
    assert is_module_grouped_tensor_path_supported(None, torch.float32) is False
    assert is_module_grouped_tensor_path_supported(recipe.Float8CurrentScaling(), torch.bfloat16) is True
    dummy = get_dummy_wgrad([4, 8], torch.float32, zero=True)
    assert dummy.shape == (4, 8) and dummy.dtype == torch.float32 and not dummy.any()


def test_dot_product_attention_package_keeps_its_paths():
    dpa = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention")
    from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends

    assert dpa.DotProductAttention is te.DotProductAttention
    assert issubclass(te.DotProductAttention, te_parallel.DotProductAttention)
    assert _attention_backends["backend_selection_requires_update"] is False
    assert "use_fused_attention" in _attention_backends


def test_attention_utils():
    from transformer_engine.pytorch.attention.dot_product_attention.utils import (AttentionLogging, AttentionParams,
                                                                                  check_set_window_size,
                                                                                  get_attention_backend)

    assert check_set_window_size("causal") == (-1, 0)
    assert check_set_window_size("no_mask", (-1, -1)) == (-1, -1)
    assert check_set_window_size("padding_causal", (128, 0)) == (128, 0)
    with pytest.warns(UserWarning, match="window_size"):
        assert check_set_window_size("causal", (-1, -1)) == (-1, 0)
    with pytest.warns(UserWarning, match="window_size"):
        assert check_set_window_size("no_mask", (-1, 0)) == (-1, -1)
    with pytest.raises(ValueError, match="not valid for attn_mask_type=no_mask"):
        check_set_window_size("no_mask", (-2, 4))
    with pytest.raises(ValueError, match="attn_mask_type='sliding'"):
        check_set_window_size("sliding")
    AttentionLogging.setup_logging()
    assert AttentionLogging._is_logging_setup
    with pytest.raises(NotImplementedError, match="attention backend selection"):
        AttentionParams(qkv_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="attention backend selection"):
        get_attention_backend(None)


def test_cpp_extensions_package():
    cpp = importlib.import_module("transformer_engine.pytorch.cpp_extensions")
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend, fused_attn_fwd

    assert hasattr(cpp, "general_gemm") and hasattr(cpp, "cast_to_fp8")  # Megatron probes and patches these
    assert cpp.FusedAttnBackend is FusedAttnBackend
    assert FusedAttnBackend["FP8"] == 2 and FusedAttnBackend["F16_arbitrary_seqlen"] == 1
    assert FusedAttnBackend.cast(-1) is FusedAttnBackend.No_Backend
    with pytest.raises(NotImplementedError, match="fused attention"):
        fused_attn_fwd()


def test_parallel_attention_mlp_is_refused_in_one_line():
    import transformer_engine.pytorch as te

    with pytest.raises(NotImplementedError, match="parallel_attention_mlp=True .* not implemented in te_parallel"):
        te.TransformerLayer(64, 128, 4, parallel_attention_mlp=True, device="cpu")
    te.TransformerLayer(64, 128, 4, parallel_attention_mlp=False, device="cpu")
