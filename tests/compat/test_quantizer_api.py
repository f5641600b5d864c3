"""TE's quantizer API through the stand-in: TE's import paths give te_parallel's quantizers and quantized tensors,
te_parallel's FP8 weights are TE's Float8Tensor, TE-style recipes of block scaling convert and run."""
from tests.compat import stand_in

stand_in.require()

import importlib

import pytest
import torch

import te_parallel
import transformer_engine.pytorch as te
from te_parallel.fp8 import quantizers as Q
from transformer_engine.common import recipe

# (module path, name) -> te_parallel's object of the same name
TE_PATHS = {
    "transformer_engine.pytorch": ["Quantizer", "QuantizedTensor", "Float8Quantizer", "Float8CurrentScalingQuantizer",
                                   "Float8BlockQuantizer", "MXFP8Quantizer", "NVFP4Quantizer", "Float8Tensor",
                                   "Float8BlockwiseQTensor", "MXFP8Tensor", "NVFP4Tensor", "DType", "QuantizerRole",
                                   "is_bf16_available", "get_device_compute_capability"],
    "transformer_engine.pytorch.tensor": ["Quantizer", "QuantizedTensor", "Float8Quantizer", "Float8Tensor",
                                          "Float8CurrentScalingQuantizer", "Float8BlockQuantizer",
                                          "Float8BlockwiseQTensor", "MXFP8Quantizer", "MXFP8Tensor", "NVFP4Quantizer",
                                          "NVFP4Tensor"],
    "transformer_engine.pytorch.tensor.quantized_tensor": ["Quantizer", "QuantizedTensor"],
    "transformer_engine.pytorch.tensor.float8_tensor": ["Float8Tensor", "Float8Quantizer",
                                                        "Float8CurrentScalingQuantizer"],
    "transformer_engine.pytorch.tensor.float8_blockwise_tensor": ["Float8BlockwiseQTensor", "Float8BlockQuantizer"],
    "transformer_engine.pytorch.tensor.mxfp8_tensor": ["MXFP8Tensor", "MXFP8Quantizer"],
    "transformer_engine.pytorch.tensor.nvfp4_tensor": ["NVFP4Tensor", "NVFP4Quantizer"],
    "transformer_engine.pytorch.float8_tensor": ["Float8Tensor"],
    "transformer_engine.pytorch.quantization": ["QuantizerRole"],
    "transformer_engine.pytorch.fp8": ["QuantizerRole"],
    "transformer_engine.pytorch.utils": ["is_bf16_available", "get_device_compute_capability"],
}


@pytest.mark.parametrize("path", sorted(TE_PATHS))
def test_te_paths_are_te_parallels_classes(path):
    module = importlib.import_module(path)
    for name in TE_PATHS[path]:
        assert getattr(module, name) is getattr(Q, name), f"{path}.{name}"


def test_common_recipe_names():
    for name in ("Float8BlockScaling", "QParams", "MXFP8BlockScaling", "NVFP4BlockScaling", "MMParams", "Format"):
        assert hasattr(recipe, name)
    r = recipe.Float8BlockScaling()
    assert r.fp8_quant_fwd_inp.power_2_scale is True and (r.x_block_scaling_dim, r.w_block_scaling_dim) == (1, 2)


def test_te_parallels_fp8_tensors_are_tes_types():
    with te.quantized_model_init(enabled=True, recipe=recipe.DelayedScaling()):
        m = te.Linear(32, 32, device="cpu")
    assert isinstance(m.weight, te_parallel.Float8Weight)
    for cls in (te.Float8Tensor, te.QuantizedTensor, te.Float8TensorStorage, te.QuantizedTensorStorage,
                importlib.import_module("transformer_engine.pytorch.tensor").QuantizedTensorBase):
        assert isinstance(m.weight, cls), cls.__name__
    assert not isinstance(m.weight, (te.Float8BlockwiseQTensor, te.MXFP8Tensor, te.MXFP8TensorStorage))
    operand = te_parallel.Float8Tensor(data=torch.zeros(2, 2, dtype=torch.float8_e4m3fn), scale_inv=torch.ones(()))
    assert isinstance(operand, te.Float8Tensor)
    assert not isinstance(torch.zeros(2), (te.QuantizedTensor, te.QuantizedTensorStorage))
    with pytest.raises(NotImplementedError, match="storage class"):
        te.Float8TensorStorage()


def test_te_style_quantization_on_cpu():
    """What TE's tests do (tests/pytorch/test_quantized_tensor.py's to_float8 and make_quantizer), on the CPU."""
    x = torch.randn(7, 5, 3)
    q = te.Float8Quantizer(scale=torch.full([1], 3.5), amax=torch.empty([1]).fill_(0), fp8_dtype=te.DType.kFloat8E4M3)
    t = q(x)
    assert isinstance(t, te.Float8Tensor) and isinstance(t, te.QuantizedTensor) and t.dtype == torch.float32
    assert t._data.dtype == torch.uint8 and t._data.shape == x.shape and q.amax.item() == x.abs().max().item()
    torch.testing.assert_close(t.dequantize(), x, rtol=0.125, atol=0.0675)
    cs = te.Float8CurrentScalingQuantizer(fp8_dtype=te.DType.kFloat8E5M2, device="cpu", force_pow_2_scales=True)
    cs.set_usage(rowwise=True, columnwise=False)
    u = cs(x)
    assert u._transpose is None and u._fp8_dtype == te.DType.kFloat8E5M2
    b = te.Float8BlockQuantizer(fp8_dtype=te.DType.kFloat8E4M3, rowwise=True, columnwise=True, force_pow_2_scales=True,
                                amax_epsilon=0.0, block_scaling_dim=1)
    w = b(torch.randn(128, 130, dtype=torch.bfloat16))
    assert isinstance(w, te.Float8BlockwiseQTensor) and w.dtype == torch.bfloat16 and not w._is_2D_scaled
    assert w._rowwise_scale_inv.shape == b.get_scale_shape((128, 130), columnwise=False) == (2, 128)
    assert w._columnwise_scale_inv.shape == b.get_scale_shape((128, 130), columnwise=True) == (1, 132)
    mx = te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E4M3)  # made (TE's tests build them in parameter lists)
    with pytest.raises(NotImplementedError, match="Blackwell"):
        mx(torch.randn(4, 128))


def test_block_scaling_recipe_converts_and_runs():
    r = recipe.Float8BlockScaling(fp8_quant_fwd_weight=recipe.QParams(power_2_scale=False, amax_epsilon=1e-4))
    converted = recipe.to_te_parallel(r)
    assert isinstance(converted, te_parallel.recipe.Float8BlockScaling)
    assert converted.fp8_quant_fwd_weight == te_parallel.recipe.QParams(power_2_scale=False, amax_epsilon=1e-4)
    assert converted.fp8_quant_fwd_inp.power_2_scale is True and converted.w_block_scaling_dim == 2
    assert te.fp8.check_fp8_block_scaling_support() == te_parallel.is_fp8_block_scaling_available(return_reason=True)
    torch.manual_seed(0)
    m = te.Linear(256, 128, device="cpu")
    x = torch.randn(128, 256)
    with te.autocast(recipe=r):
        y = m(x)
    ref = x @ m.weight.t() + m.bias
    assert 0 < ((y - ref).norm() / ref.norm()).item() < 0.06
    with pytest.raises(NotImplementedError, match="stochastic_rounding"):
        recipe.to_te_parallel(recipe.Float8BlockScaling(fp8_quant_bwd_grad=recipe.QParams(stochastic_rounding=True)))
    for cls in (recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling):
        with pytest.raises(NotImplementedError, match="not implemented in te_parallel"):
            te.autocast(recipe=cls())
        with pytest.raises(RuntimeError, match="Blackwell"):
            te.fp8.check_recipe_support(cls())


def test_quantizer_role_and_recipe_quantizers():
    role = te.QuantizerRole(module_type="linear", tensor_type="weight", name="fc1")
    assert str(role) == "module_type=linear|tensor_type=weight|name=fc1"
    q = te_parallel.make_quantizer(recipe.to_te_parallel(recipe.Float8BlockScaling()), role)
    assert isinstance(q, te.Float8BlockQuantizer) and q.block_scaling_dim == 2
