"""Every module: outputs and all gradients vs fp64 references, in high precision and in FP8.

Stated tolerances (relative Frobenius error ‖out − ref‖ / ‖ref‖):
* fp32, no FP8, vs the fp64 math: 1e-5.
* FP8 vs quantize→dequantize→fp64 with the same scales: for Linear 1e-5 on CPU (same operands, only
  fp32 accumulation differs), 5e-4 on CUDA (Hopper's FP8 MMA accumulation, see reference.fp8_gemm_tol); for the norm-fused modules 5e-3 on CPU and
  1.2e-2 on CUDA: their FP8 operands are intermediates, which the reference computes in fp64, so a
  few elements round to a neighbouring FP8 value (reference.fp8_chain_tol).
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

import te_parallel as te
from te_parallel import recipe as R
from tests.module_reference import dparams, grads_close, ref_linear, ref_mlp, ref_norm, scales_of
from tests.reference import fp8_chain_tol, fp8_gemm_tol, rel_err

RECIPES = {
    "delayed-hybrid": R.DelayedScaling(amax_history_len=4),
    "delayed-e4m3": R.DelayedScaling(fp8_format=R.Format.E4M3, margin=1, amax_compute_algo="most_recent"),
    "current-hybrid": R.Float8CurrentScaling(),
    "block": R.Float8BlockScaling(),
    "block-fp32-scales-hybrid": R.Float8BlockScaling(fp8_format=R.Format.HYBRID, fp8_quant_fwd_inp=R.QParams(power_2_scale=False),
                                                     fp8_quant_bwd_grad=R.QParams(power_2_scale=False),
                                                     fp8_quant_fwd_weight=R.QParams(power_2_scale=False)),
    "block-1d-weights": R.Float8BlockScaling(w_block_scaling_dim=1),
}


def _block(recipe):
    return recipe if recipe is not None and recipe.float8_block_scaling() else None


def _row_magnitudes(t):
    """A power of two in [2^-6, 2^6] per row of t ([..., features]), so that under block scaling the 1x128 tiles
    along a row and those down a column get different scales."""
    return 2.0 ** torch.randint(-6, 7, (*t.shape[:-1], 1), device=t.device).to(t.dtype)


def _step(module, x, recipe, dy, **fwd):
    """One forward (under fp8_autocast when recipe is given) and backward with upstream grad dy."""
    x = x.detach().clone().requires_grad_(True)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = module(x, **fwd)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return x, out


def _warmup(module, x, recipe, dy):
    """A first FP8 step so delayed scales come from real amaxes, then an "optimizer step" (an in-place
    update, which makes the module recast its weights with the new scales); grads are cleared."""
    if recipe is not None:
        _step(module, x, recipe, dy)
        module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for prm in module.parameters():
                prm.mul_(1.01)


LINEAR_PARAMS = ("weight", "bias")


@pytest.mark.parametrize("recipe_name", [None, *RECIPES])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(recipe_name, bias, device):
    recipe = RECIPES.get(recipe_name)
    m = te.Linear(64, 48, bias=bias, device=device)
    x, dy = torch.randn(3, 16, 64, device=device), torch.randn(3, 16, 48, device=device)
    if _block(recipe) is not None:  # rows of different magnitudes: a row's tile and a column's differ in scale
        x, dy = x * _row_magnitudes(x), dy * _row_magnitudes(dy)
    _warmup(m, x, recipe, dy)
    scales = None if recipe is None else scales_of(m, 0, recipe.fp8_format, recipe.delayed(), _block(recipe))
    xi, out = _step(m, x, recipe, dy)
    p = dparams(m, LINEAR_PARAMS)
    xr = x.double().cpu().requires_grad_(True)
    ref = ref_linear(xr, p["weight"], p["bias"], scales)
    ref.backward(dy.double().cpu())
    tol = 1e-5 if recipe is None else fp8_gemm_tol(device)
    assert out.dtype == torch.float32 and out.shape == (3, 16, 48)
    assert rel_err(out.cpu(), ref) < tol
    assert rel_err(xi.grad.cpu(), xr.grad) < tol
    grads_close(m, p, LINEAR_PARAMS, tol, rel_err)


NORM_LINEAR_PARAMS = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")


@pytest.mark.parametrize("recipe_name", [None, *RECIPES])
@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_layernorm_linear(recipe_name, normalization, zero_centered, device):
    recipe = RECIPES.get(recipe_name)
    m = te.LayerNormLinear(64, 32, normalization=normalization, zero_centered_gamma=zero_centered,
                           return_layernorm_output=True, device=device)
    with torch.no_grad():  # non-trivial norm parameters
        m.layer_norm_weight.normal_(0.1 if zero_centered else 1.0, 0.2)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.normal_(0.0, 0.2)
    x, dy = torch.randn(32, 64, device=device) * 3 + 1, torch.randn(32, 32, device=device)
    _warmup(m, x, recipe, dy)
    scales = None if recipe is None else scales_of(m, 0, recipe.fp8_format, recipe.delayed(), _block(recipe))
    xi = x.detach().clone().requires_grad_(True)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out, ln_out = m(xi)
    out.backward(dy)
    p = dparams(m, NORM_LINEAR_PARAMS)
    xr = x.double().cpu().requires_grad_(True)
    ln_ref = ref_norm(normalization, xr, p["layer_norm_weight"], p["layer_norm_bias"], m.eps, zero_centered)
    ref = ref_linear(ln_ref, p["weight"], p["bias"], scales)
    ref.backward(dy.double().cpu())
    tol = 1e-5 if recipe is None else fp8_chain_tol(device)
    assert rel_err(ln_out.cpu(), ln_ref) < 1e-5
    assert rel_err(out.cpu(), ref) < tol
    assert rel_err(xi.grad.cpu(), xr.grad) < tol
    grads_close(m, p, NORM_LINEAR_PARAMS, tol, rel_err)


MLP_PARAMS = ("layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")
ACTS = ["gelu", "relu", "qgelu", "srelu", "geglu", "reglu", "swiglu", "silu", "qgeglu", "sreglu"]


def _mlp_case(activation, recipe, normalization, device, bias=True):
    m = te.LayerNormMLP(32, 48, activation=activation, normalization=normalization, bias=bias, device=device,
                        init_method=lambda w: torch.nn.init.normal_(w, 0, 0.2))
    x, dy = torch.randn(2, 16, 32, device=device), torch.randn(2, 16, 32, device=device)
    _warmup(m, x, recipe, dy)
    scales = [None, None] if recipe is None else [scales_of(m, g, recipe.fp8_format, recipe.delayed(), _block(recipe)) for g in (0, 1)]
    xi, out = _step(m, x, recipe, dy)
    p = dparams(m, MLP_PARAMS)
    xr = x.double().cpu().requires_grad_(True)
    ref, _ = ref_mlp(p, xr, m, scales)
    ref.backward(dy.double().cpu())
    tol = 1e-5 if recipe is None else fp8_chain_tol(device)
    assert rel_err(out.cpu(), ref) < tol
    assert rel_err(xi.grad.cpu(), xr.grad) < tol
    grads_close(m, p, MLP_PARAMS, tol, rel_err)


@pytest.mark.parametrize("activation", ACTS)
def test_layernorm_mlp_activations_fp32(activation, device):
    _mlp_case(activation, None, "LayerNorm", device)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("activation, normalization, bias", [("gelu", "LayerNorm", True), ("swiglu", "RMSNorm", False)])
def test_layernorm_mlp_fp8(recipe_name, activation, normalization, bias, device):
    _mlp_case(activation, RECIPES[recipe_name], normalization, device, bias)


@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_modules(cls, zero_centered, device):
    m = cls(40, eps=1e-3, zero_centered_gamma=zero_centered, device=device)
    with torch.no_grad():
        for prm in m.parameters():
            prm.normal_(0.5, 0.3)
    x, dy = torch.randn(5, 7, 40, device=device) * 2, torch.randn(5, 7, 40, device=device)
    xi, out = _step(m, x, None, dy)
    names = ("weight", "bias") if cls is te.LayerNorm else ("weight",)
    p = dparams(m, names)
    xr = x.double().cpu().requires_grad_(True)
    ref = ref_norm("LayerNorm" if cls is te.LayerNorm else "RMSNorm", xr, p["weight"], p.get("bias"), 1e-3, zero_centered)
    ref.backward(dy.double().cpu())
    assert rel_err(out.cpu(), ref) < 1e-5 and rel_err(xi.grad.cpu(), xr.grad) < 1e-5
    grads_close(m, p, names, 1e-5, rel_err)


def test_te_defaults_and_names(device):
    m = te.Linear(16, 32, device=device)
    assert m.weight.shape == (32, 16) and m.bias.shape == (32,) and torch.all(m.bias == 0)
    assert abs(m.weight.std().item() - 0.023) < 0.01  # TE's default init N(0, 0.023²)
    ln = te.LayerNormMLP(16, 64, activation="geglu", device=device)
    assert ln.fc1_weight.shape == (128, 16) and ln.fc2_weight.shape == (16, 64)
    assert {n for n, _ in ln.named_parameters()} == set(MLP_PARAMS)
    assert te.LayerNormLinear(16, 16, normalization="RMSNorm", device=device).layer_norm_bias is None
    assert torch.all(te.LayerNorm(8, zero_centered_gamma=True, device=device).weight == 0)


def test_return_bias_and_layernorm_output(device):
    m = te.LayerNormMLP(16, 32, return_bias=True, return_layernorm_output=True, device=device)
    with torch.no_grad():
        m.fc2_bias.normal_()
    x = torch.randn(4, 16, device=device)
    out, bias, ln_out = m(x)
    m.return_bias, m.return_layernorm_output = False, False
    full = m(x)
    assert torch.equal(bias, m.fc2_bias) and torch.allclose(out + bias, full)
    assert ln_out.shape == x.shape
    lin = te.Linear(16, 8, return_bias=True, device=device)
    out, b = lin(x)
    assert b is lin.bias or torch.equal(b, lin.bias)


def test_parameters_split(device):
    m = te.Linear(16, 48, parameters_split=("query", "key", "value"), device=device)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["query_weight", "query_bias", "key_weight", "key_bias", "value_weight", "value_bias"]
    m2 = te.Linear(16, 48, parameters_split={"a": 16, "b": 32}, device=device)
    assert m2.a_weight.shape == (16, 16) and m2.b_weight.shape == (32, 16)
    x, dy = torch.randn(16, 16, device=device), torch.randn(16, 48, device=device)
    for recipe in (None, R.Float8CurrentScaling()):
        m.zero_grad(set_to_none=True)
        _step(m, x, recipe, dy)
        full_w = torch.cat([m.query_weight, m.key_weight, m.value_weight]).detach().double().cpu()
        ref = ref_linear(x.double().cpu(), full_w, None, None)
        assert m.key_weight.grad.shape == (16, 16)
        if recipe is None:
            dw_ref = dy.double().cpu().t() @ x.double().cpu()
            assert rel_err(m.key_weight.grad.cpu(), dw_ref[16:32]) < 1e-6
            with torch.no_grad():
                assert rel_err(m(x).cpu() - m.query_bias.new_zeros(1).cpu(), ref) < 1e-5


@pytest.mark.parametrize("bias, return_bias, split, shape", [
    (True, False, None, (5, 3, 24)), (False, False, None, (7, 24)), (True, True, None, (2, 4, 24)),
    (True, False, ("a", "b"), (6, 24)), (True, False, None, (24,))])
def test_plain_linear_is_torch_linear(bias, return_bias, split, shape, device):
    """A one-rank Linear with no FP8 runs torch's own linear (the host-time short path): its output and
    every gradient are torch's bit for bit, and the graph holds no te_parallel Function."""
    m = te.Linear(24, 20, bias=bias, return_bias=return_bias, parameters_split=split, device=device)
    x = torch.randn(*shape, device=device, requires_grad=True)
    dy = torch.randn(*shape[:-1], 20, device=device)
    out = m(x)
    out, b = out if return_bias else (out, None)
    assert "LinearFunction" not in type(out.grad_fn).__name__
    out.backward(dy)
    params = list(m.parameters())
    w = torch.cat([p for n, p in m.named_parameters() if n.endswith("weight")]).detach().requires_grad_(True)
    bias_ref = torch.cat([p for n, p in m.named_parameters() if n.endswith("bias")]).detach().requires_grad_(True) \
        if bias else None
    xr = x.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.linear(xr, w, None if return_bias else bias_ref)
    ref.backward(dy)
    assert torch.equal(out, ref) and torch.equal(x.grad, xr.grad)
    got_w = torch.cat([p.grad for n, p in m.named_parameters() if n.endswith("weight")])
    assert torch.equal(got_w, w.grad)
    if bias and not return_bias:
        assert torch.equal(torch.cat([p.grad for n, p in m.named_parameters() if n.endswith("bias")]), bias_ref.grad)
    if return_bias:
        assert torch.equal(b, m.bias)
    assert all(p.grad is not None for p in params if not (return_bias and p is m.bias))


@pytest.mark.parametrize("recipe_name", [None, "current-hybrid"])
def test_fuse_wgrad_accumulation(recipe_name, device):
    recipe = RECIPES.get(recipe_name)
    m = te.Linear(32, 16, fuse_wgrad_accumulation=True, device=device)
    ref_m = te.Linear(32, 16, device=device)
    ref_m.load_state_dict(m.state_dict())
    m.weight.main_grad = torch.full_like(m.weight, 0.5, dtype=torch.float32)
    x, dy = torch.randn(16, 32, device=device), torch.randn(16, 16, device=device)
    for _ in range(2):  # accumulates across micro-batches
        _step(m, x, recipe, dy)
        _step(ref_m, x, recipe, dy)
    assert m.weight.grad is None
    assert torch.allclose(m.weight.main_grad, ref_m.weight.grad + 0.5, rtol=1e-5, atol=1e-6)
    assert torch.equal(m.bias.grad, ref_m.bias.grad)


def test_fuse_wgrad_without_main_grad_errors(device):
    m = te.Linear(16, 16, fuse_wgrad_accumulation=True, device=device)
    x = torch.randn(16, 16, device=device)
    with pytest.raises(RuntimeError, match="main_grad"):
        m(x).sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(dtype, device):
    m = te.LayerNormMLP(32, 64, params_dtype=dtype, device=device)
    x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
    for recipe in (None, R.DelayedScaling()):
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = m(x)
        y.float().sum().backward()
        assert y.dtype == dtype and x.grad.dtype == dtype and m.fc1_weight.grad.dtype == dtype
        assert torch.isfinite(y).all() and torch.isfinite(m.fc1_weight.grad).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), log_mag=st.floats(-6, 6),
       current=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_linear_fp8_fuzz(tokens, k, n, log_mag, current, seed, device):
    """te.Linear in FP8 over shapes and magnitudes vs the quantize→dequantize→fp64 reference."""
    torch.manual_seed(seed)
    rec = R.Float8CurrentScaling() if current else R.DelayedScaling(amax_history_len=2)
    m = te.Linear(16 * k, 16 * n, device=device)
    x = torch.randn(16 * tokens, 16 * k, device=device) * 2.0**log_mag
    dy = torch.randn(16 * tokens, 16 * n, device=device) * 2.0**-log_mag
    _warmup(m, x, rec, dy)
    scales = scales_of(m, 0, rec.fp8_format, rec.delayed())
    xi, out = _step(m, x, rec, dy)
    p = dparams(m, LINEAR_PARAMS)
    xr = x.double().cpu().requires_grad_(True)
    ref = ref_linear(xr, p["weight"], p["bias"], scales)
    ref.backward(dy.double().cpu())
    tol = fp8_gemm_tol(device)
    assert rel_err(out.cpu(), ref) < tol and rel_err(xi.grad.cpu(), xr.grad) < tol
    grads_close(m, p, LINEAR_PARAMS, tol, rel_err)
