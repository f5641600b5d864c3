"""tests/test_fp8_params.py on CUDA (the `device` fixture of tests/gpu/conftest.py), and moving an FP8
model from the CPU to the GPU."""
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.params import Float8Weight
from tests.test_fp8_params import *  # noqa: F401,F403


def test_module_to_cuda_keeps_fp8_weights(device):
    """module.to(device) moves the bytes and the shared scale (nn.Module._apply assigns `.data`)."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=R.Float8CurrentScaling()):
        m = te.Linear(64, 96, parameters_split=("query", "key", "value"), device="cpu")
    before = {n: (p._data.view(torch.uint8).clone(), p._scales.clone()) for n, p in m.named_parameters()
              if isinstance(p, Float8Weight)}
    m.to(device)
    pieces = [m.query_weight, m.key_weight, m.value_weight]
    for n, (data, scales) in before.items():
        p = m.get_parameter(n)
        assert isinstance(p, Float8Weight) and p.device.type == "cuda" and p._data.device.type == "cuda", n
        assert torch.equal(p._data.view(torch.uint8).cpu(), data) and torch.equal(p._scales.cpu(), scales), n
    assert pieces[0]._scales is pieces[1]._scales is pieces[2]._scales
    with te.fp8_autocast(fp8_recipe=R.Float8CurrentScaling()):
        y = m(torch.randn(16, 64, device=device))
    y.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in pieces)
