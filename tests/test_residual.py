"""`residual=` of Linear, LayerNormMLP and MultiheadAttention (out + residual, added in the FP8 output GEMM's
epilogue on one rank) and TransformerLayer's use of it for its residual connections.

Each case runs two copies of one module from the same state: `module(x, residual=r)` and `module(x) + r`.
Their gradients are equal bit for bit (backward is the same; r's gradient is the output's). Their outputs
are equal bit for bit in fp32 on the CPU (the epilogue's fp32 sum is the add's; on a GPU cuBLASLt may pick
another kernel for a GEMM with a C operand, which sums the products in another order: equal to fp32
rounding) and within one rounding of each other in bf16 (the epilogue rounds once, the add twice), where
the fused one is the closer to the exact sum.
"""
import copy

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.ops import gemm as gemm_ops
from tests.reference import fp8_chain_tol, rel_err

RECIPES = {"delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling()}


@pytest.fixture
def epilogue_adds(monkeypatch):
    """How many FP8 forward GEMMs were given a residual (`accumulate`) since the fixture was made."""
    calls = []
    fprop = gemm_ops.fprop

    def spy(x, w, out_dtype, bias=None, out=None, accumulate=None, mm=gemm_ops.EXACT):
        calls.append(accumulate is not None)
        return fprop(x, w, out_dtype, bias, out, accumulate, mm)

    monkeypatch.setattr(gemm_ops, "fprop", spy)
    return calls


def _run(module, x, r, dy, recipe, fused: bool, **fwd):
    """(out, x grad, r grad, param grads) of one step: module(x, residual=r) or module(x) + r."""
    x, r = x.detach().clone().requires_grad_(True), r.detach().clone().requires_grad_(True)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = module(x, residual=r, **fwd) if fused else module(x, **fwd) + r
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, r.grad, grads


def _equal(a, b):
    """Bit for bit on the CPU; to fp32 rounding on a GPU (another GEMM kernel may sum in another order)."""
    if a.is_cuda:
        torch.testing.assert_close(a, b)
    else:
        assert torch.equal(a, b)


def _compare(module, x, r, dy, recipe, dtype, **fwd):
    """Both forms from the same state, over two steps (the second with delayed scales from the first)."""
    a, b = module, copy.deepcopy(module)
    for _ in range(2):
        out_a, dx_a, dr_a, g_a = _run(a, x, r, dy, recipe, True, **fwd)
        out_b, dx_b, dr_b, g_b = _run(b, x, r, dy, recipe, False, **fwd)
        assert torch.equal(dr_a, dy) and torch.equal(dr_b, dy)
        assert torch.equal(dx_a, dx_b)
        assert g_a.keys() == g_b.keys() and all(torch.equal(g_a[n], g_b[n]) for n in g_a)
        if dtype == torch.float32:
            _equal(out_a, out_b)
        else:  # one rounding against two: within a bf16 step of each other
            torch.testing.assert_close(out_a, out_b, rtol=2 ** -7, atol=2 ** -7)
        for m in (a, b):
            m.zero_grad(set_to_none=True)
    return out_a, out_b


@pytest.mark.parametrize("recipe_name", [None, *RECIPES])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_residual(recipe_name, bias, dtype, device, epilogue_adds):
    recipe = RECIPES.get(recipe_name)
    m = te.Linear(64, 48, bias=bias, device=device, params_dtype=dtype)
    x = torch.randn(3, 16, 64, device=device, dtype=dtype)
    r, dy = torch.randn(3, 16, 48, device=device, dtype=dtype), torch.randn(3, 16, 48, device=device, dtype=dtype)
    _compare(m, x, r, dy, recipe, dtype)
    assert sum(epilogue_adds) == (2 if recipe is not None else 0)  # the fused form's two FP8 forwards


@pytest.mark.parametrize("recipe_name", [None, *RECIPES])
@pytest.mark.parametrize("activation, normalization", [("swiglu", "RMSNorm"), ("gelu", "LayerNorm")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_mlp_residual(recipe_name, activation, normalization, dtype, device, epilogue_adds):
    recipe = RECIPES.get(recipe_name)
    m = te.LayerNormMLP(64, 96, activation=activation, normalization=normalization, device=device,
                        params_dtype=dtype)
    x, r, dy = (torch.randn(16, 2, 64, device=device, dtype=dtype) for _ in range(3))
    _compare(m, x, r, dy, recipe, dtype)
    assert sum(epilogue_adds) == (2 if recipe is not None else 0)  # fc2 of the fused form's two FP8 forwards


def test_bf16_epilogue_is_one_rounding(device):
    """The FP8 GEMM's epilogue sums in fp32 and rounds once: closer to the exact sum than the add after a
    bf16 output. Exact: the same FP8 operands' product in fp32 (an fp32 copy of the layer: under current
    scaling its casts give the same bytes) plus r, in fp64."""
    m = te.Linear(256, 256, bias=False, device=device, params_dtype=torch.bfloat16)
    m32 = te.Linear(256, 256, bias=False, device=device)
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    r = (torch.randn(64, 256, device=device) * 30).to(torch.bfloat16)
    with te.fp8_autocast(fp8_recipe=R.Float8CurrentScaling()), torch.no_grad():
        m32.weight.copy_(m.weight.float())
        fused, added = m(x, residual=r), m(x) + r
        exact = m32(x.float()).double() + r.double()
    assert rel_err(fused.double(), exact) < rel_err(added.double(), exact)


def _llama_layer(device, **kw):
    return te.TransformerLayer(64, 96, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu",
                               bias=False, attention_dropout=0.0, device=device, **kw)


@pytest.mark.parametrize("recipe_name", [None, *RECIPES])
def test_transformer_layer_residuals_in_gemms(recipe_name, device, epilogue_adds):
    """Without dropout between a block and its residual add, the layer hands x to the block, which adds it
    in its output GEMM: the layer equals x1 = x + attention(x), x1 + mlp(x1) (fp32 on the CPU: bit for bit)."""
    recipe = RECIPES.get(recipe_name)
    layer = _llama_layer(device, hidden_dropout=0.0)
    x, dy = torch.randn(16, 2, 64, device=device), torch.randn(16, 2, 64, device=device)
    twin = copy.deepcopy(layer)
    outs, grads, adds = [], [], []
    for form in ("layer", "composed"):
        m = layer if form == "layer" else twin
        epilogue_adds.clear()
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            if form == "layer":
                out = m(xi)
            else:
                x1 = xi + m.self_attention(xi)
                out = x1 + m.layernorm_mlp(x1)
        out.backward(dy)
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
        adds.append(sum(epilogue_adds))
    if x.is_cuda:  # a last-bit difference in x1 may move an FP8 code of the MLP's input by a step
        assert all(rel_err(a, b) < fp8_chain_tol(device) for a, b in zip([outs[0], *grads[0]], [outs[1], *grads[1]]))
    else:
        assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
    # proj and fc2 of the layer's forward took the residual; none of the composed forward's GEMMs did
    assert adds == [2 if recipe is not None else 0, 0]


def test_transformer_layer_dropout_keeps_its_add(device, epilogue_adds):
    """With hidden dropout the block's output is dropped out before the add: the layer adds it (training);
    in eval mode dropout is off and the GEMMs add the residual again."""
    layer = _llama_layer(device, hidden_dropout=0.1)
    x = torch.randn(16, 2, 64, device=device)
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        layer(x)
        assert not any(epilogue_adds)
        layer.eval()
        with torch.no_grad():
            layer(x)
    assert sum(epilogue_adds) == 2


def test_residual_errors(device):
    m = te.Linear(64, 48, device=device)
    mlp = te.LayerNormMLP(64, 96, device=device)
    x = torch.randn(8, 64, device=device)
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        with pytest.raises(ValueError, match=r"Linear: residual must have the output's shape \(8, 48\), got \(8, 64\)"):
            m(x, residual=torch.randn(8, 64, device=device))
        with pytest.raises(ValueError, match=r"residual must have the output's shape \(8, 48\), got \(48,\)"):
            m(x, residual=torch.randn(48, device=device))  # (no broadcasting)
        with pytest.raises(TypeError, match=r"Linear: residual must have the output's dtype torch.float32, got "
                                            r"torch.bfloat16"):
            m(x, residual=torch.randn(8, 48, device=device, dtype=torch.bfloat16))
        with pytest.raises(TypeError, match="LayerNormMLP: residual must be a torch.Tensor or None, got float"):
            mlp(x, residual=1.0)
        with pytest.raises(ValueError, match=r"LayerNormMLP: residual must have the output's shape \(8, 64\)"):
            mlp(x, residual=torch.randn(4, 2, 64, device=device))
    with pytest.raises(ValueError, match=r"Linear: residual must have the output's shape \(8, 48\), got \(2, 4, 48\)"):
        m(x, residual=torch.randn(2, 4, 48, device=device))  # (high precision: the add's own check)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_layernorm_mlp_checkpoint_residual(recipe_name, device):
    """LayerNormMLP(checkpoint=True) recomputes its forward, the residual among its inputs, bit for bit."""
    recipe = RECIPES[recipe_name]
    kw = dict(activation="swiglu", normalization="RMSNorm", device=device)
    plain = te.LayerNormMLP(64, 96, **kw)
    recomputed = te.LayerNormMLP(64, 96, checkpoint=True, **kw)
    recomputed.load_state_dict(plain.state_dict())
    x, r, dy = (torch.randn(16, 2, 64, device=device) for _ in range(3))
    for _ in range(2):
        got = [_run(m, x, r, dy, recipe, True) for m in (plain, recomputed)]
        (out_a, dx_a, dr_a, g_a), (out_b, dx_b, dr_b, g_b) = got
        assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b) and torch.equal(dr_b, dy)
        assert all(torch.equal(g_a[n], g_b[n]) for n in g_a)
        for m in (plain, recomputed):
            m.zero_grad(set_to_none=True)
