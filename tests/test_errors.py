"""Bad input: a one-line error naming what was given and what is needed."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_wrong_in_features(device):
    with pytest.raises(ValueError) as e:
        te.Linear(32, 16, device=device)(torch.randn(4, 31, device=device))
    assert "last dim must be 32, got shape (4, 31)" in _one_line(e)
    with pytest.raises(ValueError) as e:
        te.LayerNormMLP(32, 64, device=device)(torch.randn(4, 30, device=device))
    assert "LayerNormMLP" in _one_line(e)


def test_features_not_multiple_of_16_under_fp8(device):
    m = te.Linear(32, 24, device=device)
    with pytest.raises(ValueError) as e:
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
            m(torch.randn(16, 32, device=device))
    assert "features that are multiples of 16" in _one_line(e) and "(24, 32)" in _one_line(e)
    assert m(torch.randn(3, 5, 32, device=device)).shape == (3, 5, 24)  # fine outside FP8


def test_unsupported_activation_and_normalization(device):
    with pytest.raises(ValueError) as e:
        te.LayerNormMLP(16, 32, activation="tanh", device=device)
    assert "activation must be one of" in _one_line(e) and "'tanh'" in str(e.value)
    with pytest.raises(ValueError) as e:
        te.LayerNormLinear(16, 32, normalization="BatchNorm", device=device)
    assert "'BatchNorm'" in _one_line(e)


def test_wrong_dtype(device):
    with pytest.raises(TypeError) as e:
        te.Linear(16, 16, device=device)(torch.ones(4, 16, dtype=torch.int64, device=device))
    assert "got torch.int64" in _one_line(e)
    with pytest.raises(ValueError) as e:
        te.Linear(16, 16, params_dtype=torch.int8, device=device)
    assert "params_dtype" in _one_line(e)
    m = te.Linear(16, 16, params_dtype=torch.float64, device=device)
    with pytest.raises(TypeError) as e:
        with te.fp8_autocast():
            m(torch.randn(16, 16, dtype=torch.float64, device=device))
    assert "got float64" in _one_line(e)


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=0, out_features=4), "in_features must be a positive int, got 0"),
    (dict(in_features=16, out_features=48, parameters_split=("a", "b", "c", "d", "e")), "not divisible into 5"),
    (dict(in_features=16, out_features=48, parameters_split={"a": 16, "b": 16}), "add up to 32"),
    (dict(in_features=16, out_features=16, parallel_mode="diagonal"), "parallel_mode"),
    (dict(in_features=16, out_features=16, tp_size=3, parallel_mode="column"), "out_features=16 is not divisible by tp_size=3"),
    (dict(in_features=16, out_features=16, tp_size=3, parallel_mode="row"), "in_features=16 is not divisible by tp_size=3"),
    (dict(in_features=16, out_features=16, tp_size=0), "tp_size must be a positive int, got 0"),
    (dict(in_features=16, out_features=16, ub_overlap_ag=True), "no ub_comm was given"),
])
def test_bad_constructor_args(kwargs, match, device):
    with pytest.raises((ValueError, NotImplementedError)) as e:
        te.Linear(device=device, **kwargs)
    assert match in _one_line(e)


def test_tp_without_group_errors_at_forward(device):
    m = te.Linear(16, 16, tp_size=2, parallel_mode="column", device=device)
    with pytest.raises(RuntimeError) as e:
        m(torch.randn(4, 16, device=device))
    assert "tp_size=2 but has no tp_group; call set_tensor_parallel_group" in _one_line(e)


@pytest.mark.parametrize("shape", [(8, 64), (64,), (2, 8, 2, 64)], ids=["2-D", "1-D", "4-D"])
def test_transformer_layer_wants_3d_hidden_states(shape, device):
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device=device)
    mha = te.MultiheadAttention(64, 4, device=device)
    for owner, module in (("TransformerLayer", layer), ("MultiheadAttention", mha)):
        with pytest.raises(ValueError) as e:
            module(torch.randn(*shape, device=device))
        msg = _one_line(e)
        assert f"{owner}: hidden_states must be 3-D [seq, batch, hidden]" in msg and f"got shape {shape}" in msg, msg
    bshd = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device=device,
                               attn_input_format="bshd")
    with pytest.raises(ValueError) as e:
        bshd(torch.randn(8, 64, device=device))
    assert "[batch, seq, hidden]" in _one_line(e) and "unsqueeze(0)" in str(e.value)


def _modules(device):
    h = 64
    kw = dict(device=device)
    return {"Linear": (te.Linear(h, h, **kw), (16, h)), "LayerNorm": (te.LayerNorm(h, **kw), (16, h)),
            "RMSNorm": (te.RMSNorm(h, **kw), (16, h)), "LayerNormLinear": (te.LayerNormLinear(h, h, **kw), (16, h)),
            "LayerNormMLP": (te.LayerNormMLP(h, 2 * h, **kw), (16, h)),
            "MultiheadAttention": (te.MultiheadAttention(h, 4, **kw), (16, 2, h)),
            "TransformerLayer": (te.TransformerLayer(h, 2 * h, 4, hidden_dropout=0.0, attention_dropout=0.0, **kw),
                                 (16, 2, h))}


@pytest.mark.parametrize("in_dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_output_dtype_is_the_activation_dtype_for_every_module(in_dtype, params_dtype, device):
    """Every module returns its activation dtype (the parameters') whatever the input's float dtype,
    float64 included, and so does its input gradient's source: one rule, no module-specific result."""
    for name, (module, shape) in _modules(device).items():
        module = module.to(params_dtype)
        x = torch.randn(*shape, device=device, dtype=in_dtype, requires_grad=True)
        out = module(x)
        assert out.dtype == params_dtype, f"{name}: {in_dtype} in, {out.dtype} out, params {params_dtype}"
        out.float().sum().backward()
        assert x.grad is not None and x.grad.dtype == in_dtype, name


def test_float64_parameters_work_outside_fp8_and_fail_clearly_inside(device):
    lin = te.Linear(32, 32, device=device, params_dtype=torch.float64)
    x = torch.randn(16, 32, device=device, dtype=torch.float64)
    assert lin(x).dtype == torch.float64
    with pytest.raises(TypeError) as e:
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
            lin(x)
    assert "FP8 GEMMs need float32/bfloat16/float16 parameters, got float64" in _one_line(e)
