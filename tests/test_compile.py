"""te_parallel modules under torch.compile: same numerics as eager, in fp32 and FP8.

Graph breaks: the FP8 region bookkeeping (recording a module's scaling state for the update at the
autocast exit) and the native-kernel call are Python side effects that dynamo leaves outside the
graph; the GEMMs, casts and norms compile. TransformerLayer / MultiheadAttention need
`torch.compile(..., dynamic=False)` with torch 2.13's inductor (dynamic shapes fail its code
generation with "name 'sNN' is not defined"); Linear, LayerNormLinear and LayerNormMLP compile
either way. See docs/compile.md.
"""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from tests.reference import fp8_chain_tol, rel_err

CASES = {
    "linear": (lambda d: te.Linear(64, 32, device=d), None),
    "layernorm_mlp": (lambda d: te.LayerNormMLP(64, 128, activation="swiglu", device=d), None),
    "transformer_layer": (lambda d: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device=d), False),
}


@pytest.mark.parametrize("recipe", [None, R.DelayedScaling(amax_history_len=4)], ids=["fp32", "fp8"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_matches_eager(name, recipe, device):
    make, dynamic = CASES[name]
    torch.manual_seed(0)
    eager, comp = make(device), make(device)
    comp.load_state_dict(eager.state_dict())
    compiled = torch.compile(comp, dynamic=dynamic)
    tol = 1e-5 if recipe is None else fp8_chain_tol(device)
    for step in range(2):
        x = torch.randn(16, 2, 64, device=device)
        outs = []
        for m in (eager, compiled):
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = m(x)
            y.backward(torch.ones_like(y))
            outs.append(y)
        assert rel_err(outs[1], outs[0]) < tol, f"step {step} output"
        for (n, p), q in zip(eager.named_parameters(), comp.parameters()):
            if n.endswith("key_bias"):  # zero in exact arithmetic: both are rounding noise
                assert q.grad.abs().max() < 1e-6 and p.grad.abs().max() < 1e-6
                continue
            assert rel_err(q.grad, p.grad) < max(tol, 1e-4), f"step {step} grad {n}"
    for (k, a), b in zip(eager.state_dict().items(), comp.state_dict().values()):
        if "fp8_state" in k:
            assert rel_err(b.float(), a.float()) < 1e-5, k  # scales updated by the compiled module too
