"""Under torch.autocast the modules' activations stay in the autocast dtype (TE's behaviour): fp32
parameters, bf16 outputs, fp32 gradients; no fp32 leak from the autocast policy of layer_norm."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("make", [
    lambda: te.Linear(32, 64),
    lambda: te.LayerNormLinear(32, 64),
    lambda: te.LayerNormLinear(32, 64, normalization="RMSNorm", return_layernorm_output=True),
    lambda: te.LayerNormMLP(32, 64),
    lambda: te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0),
], ids=["Linear", "LayerNormLinear", "LayerNormLinear-rms-ln_out", "LayerNormMLP", "TransformerLayer"])
def test_autocast_keeps_activation_dtype(make, fp8):
    torch.manual_seed(0)
    m = make().to("cpu")
    # TransformerLayer: the residual stream keeps the input's dtype, so feed it bf16
    dtype = torch.bfloat16 if isinstance(m, te.TransformerLayer) else torch.float32
    x = torch.randn(16, 2, 32).to(dtype).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling()):
        out = m(x)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.dtype == torch.bfloat16 for o in outs), [o.dtype for o in outs]
    outs[0].float().sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters() if p.requires_grad)
