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
