"""TE's PyTorch quick start (te.Linear under fp8_autocast with DelayedScaling), with only the import
changed (and the device chosen)."""
import pytest
import torch

import te_parallel as te
from te_parallel.common import recipe


def test_te_quickstart(device):
    # Set dimensions.
    in_features = 768
    out_features = 3072
    hidden_size = 2048

    # Initialize model and inputs.
    model = te.Linear(in_features, out_features, bias=True, device=device)
    inp = torch.randn(hidden_size, in_features, device=device)

    # Create an FP8 recipe. Note: All input args are optional.
    fp8_recipe = recipe.DelayedScaling(margin=0, interval=1, fp8_format=recipe.Format.E4M3)

    # Enable autocasting for the forward pass
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out = model(inp)

    loss = out.sum()
    loss.backward()
    assert out.shape == (hidden_size, out_features) and model.weight.grad.shape == (out_features, in_features)
    assert torch.isfinite(model.weight.grad).all()
    # After the step the scales come from real amaxes: input and weight, E4M3 (max 448).
    assert model.fp8_state.fwd_scale[0].item() == pytest.approx(448.0 / inp.abs().max().item(), rel=1e-6)


def test_te_quickstart_gemms_run_in_fp8(device, monkeypatch):
    """Under fp8_autocast the quick start's 2048x768->3072 Linear runs all three GEMMs in FP8 (TE's
    semantics: no size below which a GEMM silently stays in high precision)."""
    from te_parallel.ops import gemm

    seen = []
    real = gemm.fp8_mm

    def spy(a, *args, **kwargs):
        seen.append((args[5] if len(args) > 5 else kwargs.get("what"), a.dtype))
        return real(a, *args, **kwargs)

    monkeypatch.setattr(gemm, "fp8_mm", spy)
    model = te.Linear(768, 3072, bias=True, device=device)
    inp = torch.randn(2048, 768, device=device, requires_grad=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(fp8_format=recipe.Format.E4M3)):
        out = model(inp)
    out.sum().backward()
    assert sorted(w for w, _ in seen) == ["dgrad", "fprop", "wgrad"]
    assert all(dt in (torch.float8_e4m3fn, torch.float8_e5m2) for _, dt in seen)
