"""LayerNormLinear and LayerNormMLP under FP8 delayed scaling on CUDA: the norm writes the first GEMM's FP8
input (and its transposed copy) in one native pass, and its gradient comes back through a carrier
(te_parallel.module.base.norm_to_fp8).

The fused path skips the norm output's rounding to bf16 before the cast, so it is not bit-equal to the
unfused path (torch's norm, then the cast); it must be as close to the high-precision layer as the
unfused path is, output and every gradient, step after step while the amax history moves, and it must
record the same amaxes (within the bf16 rounding it skips and the FP8 noise of the steps after).
"""
import copy

import pytest
import torch

import te_parallel as te
from te_parallel import recipe
from te_parallel.module import base, layernorm_linear, layernorm_mlp

STEPS = 3


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _make(kind, normalization, zero_centered, bias, device):
    torch.manual_seed(0)
    if kind == "LayerNormLinear":
        m = te.LayerNormLinear(256, 384, bias=bias, normalization=normalization, zero_centered_gamma=zero_centered,
                               params_dtype=torch.bfloat16, device=device)
    else:
        m = te.LayerNormMLP(256, 512, bias=bias, normalization=normalization, zero_centered_gamma=zero_centered,
                            activation="swiglu", params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():  # γ away from 1 (and β from 0): the kernel's affine part is exercised
        m.layer_norm_weight.add_(torch.randn_like(m.layer_norm_weight) * 0.3)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.add_(torch.randn_like(m.layer_norm_bias) * 0.3)
    return m


def _run(module, x, dy, rec, fuse, monkeypatch):
    """STEPS training steps (SGD between them); (what each produced, how many forwards took the fused norm)."""
    calls = []
    with monkeypatch.context() as mp:
        real = base.norm_to_fp8

        def spy(*args):
            got = real(*args) if fuse else None
            calls.append(got is not None)
            return got

        mp.setattr(layernorm_linear, "norm_to_fp8", spy)
        mp.setattr(layernorm_mlp, "norm_to_fp8", spy)
        seen = []
        for _ in range(STEPS):
            xi = x.clone().requires_grad_(True)
            with te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
                y = module(xi)
            y.backward(dy)
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
            state = module.fp8_state
            seen.append(dict(y=y.detach().clone(), dx=xi.grad.clone(), grads=grads,
                             fwd_amax=state.fwd_amax_history.clone(), bwd_amax=state.bwd_amax_history.clone()))
            with torch.no_grad():
                for p in module.parameters():
                    p.sub_(0.05 * p.grad.to(p.dtype))
                    p.grad = None
    return seen, sum(calls)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered, bias", [(False, False), (True, True)], ids=["plain", "zc-bias"])
def test_fused_norm_as_close_as_unfused(kind, normalization, zero_centered, bias, device, monkeypatch):
    module = _make(kind, normalization, zero_centered, bias, device)
    x = torch.randn(64, 3, 256, device=device, dtype=torch.bfloat16) * 2 + 0.5  # 192 tokens
    dy = torch.randn(64, 3, 384 if kind == "LayerNormLinear" else 256, device=device, dtype=torch.bfloat16)
    twin, ref = copy.deepcopy(module), copy.deepcopy(module)
    fused, n_fused = _run(module, x, dy, recipe.DelayedScaling(), True, monkeypatch)
    unfused, n_unfused = _run(twin, x, dy, recipe.DelayedScaling(), False, monkeypatch)
    high, _ = _run(ref, x, dy, None, False, monkeypatch)  # bf16, the same SGD steps
    assert (n_fused, n_unfused) == (STEPS, 0)
    for step, (f, u, h) in enumerate(zip(fused, unfused, high)):
        pairs = [("y", f["y"], u["y"], h["y"]), ("dx", f["dx"], u["dx"], h["dx"])]
        pairs += [(n, f["grads"][n], u["grads"][n], h["grads"][n]) for n in h["grads"]]
        for name, a, b, r in pairs:
            ea, eb = _rel(a, r), _rel(b, r)
            assert ea <= 1.25 * eb + 2e-3, f"step {step} {name}: fused {ea:.2e} vs unfused {eb:.2e} from bf16"
            # two FP8 paths a few roundings apart: no further from each other than FP8 noise
            assert _rel(a, b) <= 2 * eb + 2e-3, f"step {step} {name}: fused and unfused differ by {_rel(a, b):.2e}"
        # the recorded amaxes: the norm output's of the first forward within the bf16 rounding the fused
        # norm skips (fp32 y against bf16 y), the others within the FP8 noise of the steps
        if step == 0:  # column 0: the first GEMM's input, the norm output
            torch.testing.assert_close(f["fwd_amax"][:, 0], u["fwd_amax"][:, 0], rtol=1e-2, atol=0)
        torch.testing.assert_close(f["fwd_amax"], u["fwd_amax"], rtol=0.15, atol=0)
        torch.testing.assert_close(f["bwd_amax"], u["bwd_amax"], rtol=0.15, atol=0)


@pytest.mark.parametrize("why", ["current", "return_layernorm_output", "no_fp8"])
def test_cases_the_norm_does_not_cast(why, device, monkeypatch):
    kw = dict(return_layernorm_output=True) if why == "return_layernorm_output" else {}
    module = te.LayerNormLinear(256, 256, normalization="RMSNorm", params_dtype=torch.bfloat16, device=device, **kw)
    rec = recipe.Float8CurrentScaling() if why == "current" else recipe.DelayedScaling()
    x = torch.randn(32, 256, device=device, dtype=torch.bfloat16)
    calls = []
    real = base.norm_to_fp8
    monkeypatch.setattr(layernorm_linear, "norm_to_fp8", lambda *a: calls.append(real(*a)) or calls[-1])
    with te.fp8_autocast(enabled=why != "no_fp8", fp8_recipe=rec):
        out = module(x.requires_grad_(True))
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert calls == [None]  # asked, and declined
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_fused_norm_in_transformer_layer_checkpoint(device):
    """te.checkpoint's recompute replays the forward's scales: the recomputed fused norm gives the same
    gradients as the forward without checkpointing."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(256, 512, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu",
                                bias=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                                device=device)
    twin = copy.deepcopy(layer)
    x = torch.randn(64, 2, 256, device=device, dtype=torch.bfloat16)
    outs = []
    for m, ckpt in ((layer, False), (twin, True)):
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
            y = te.checkpoint(m, xi) if ckpt else m(xi)
        y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
