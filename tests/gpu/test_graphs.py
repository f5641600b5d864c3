"""make_graphed_callables on FP8 layers: replays match eager steps, scales keep updating (CUDA only)."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from tests.reference import rel_err

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)


def _layer():
    torch.manual_seed(0)
    return te.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                               device="cuda")


@pytest.mark.parametrize("recipe", [R.DelayedScaling(amax_history_len=8), R.Float8CurrentScaling(), R.Float8BlockScaling()],
                         ids=["delayed", "current", "block"])
def test_graphed_fp8_layer_matches_eager(recipe):
    eager, graphed_layer = _layer(), _layer()
    x = torch.randn(128, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed_layer, (x,), fp8_enabled=True, fp8_recipe=recipe)
    # Warm-up iterations moved the graphed copy's scales; start both from the same state.
    eager.load_state_dict(graphed_layer.state_dict())
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(graphed_layer.parameters(), lr=0.01)
    for step in range(3):
        inp = torch.randn_like(x)
        dy = torch.randn_like(x)
        xe, xg = inp.clone().requires_grad_(True), inp.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=recipe):
            ye = eager(xe)
        ye.backward(dy)
        yg = graphed(xg)
        yg.backward(dy)
        assert rel_err(yg, ye) < 1e-5, f"step {step} output"
        assert rel_err(xg.grad, xe.grad) < 1e-5, f"step {step} input grad"
        for (n, pe), pg in zip(eager.named_parameters(), graphed_layer.parameters()):
            assert rel_err(pg.grad, pe.grad) < 1e-5, f"step {step} grad {n}"
        opt_e.step()
        opt_g.step()
        # set_to_none: autograd hands the graph's static grad buffers to p.grad; zeroing them in place
        # would make the next replay accumulate onto its own output (torch's graphed-callables rule).
        opt_e.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)
    for (k, a), b in zip(eager.state_dict().items(), graphed_layer.state_dict().values()):
        if "fp8_state" in k and "update_count" not in k:
            assert rel_err(b.float(), a.float()) < 1e-6, k  # scales and histories kept updating in the replays
