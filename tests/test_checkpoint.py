"""state_dict carries the FP8 state as plain tensors; a resumed run is bit-identical."""
import io

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R

RECIPE = R.DelayedScaling(amax_history_len=8)


def _model(device):
    torch.manual_seed(7)
    return torch.nn.Sequential(
        te.LayerNormLinear(32, 64, device=device),
        te.LayerNormMLP(64, 128, activation="swiglu", device=device),
        te.Linear(64, 32, device=device),
    )


def _train(model, opt, data, steps):
    losses = []
    for i in range(steps):
        x, t = data[i]
        with te.fp8_autocast(fp8_recipe=RECIPE):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y, t)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _data(device, n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 32, generator=g).to(device), torch.randn(16, 32, generator=g).to(device)) for _ in range(n)]


def test_state_dict_is_plain_tensors(device):
    sd = _model(device).state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    assert "0.fp8_state.fwd_amax_history" in sd and "1.fp8_state.bwd_scale" in sd
    assert sd["1.fp8_state.fwd_scale"].shape == (4,) and sd["1.fp8_state.bwd_scale"].shape == (2,)


def test_resume_is_bit_identical(device):
    data = _data(device, 6)
    model = _model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, data, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    full = _train(model, opt, data[3:], 3)  # uninterrupted

    resumed = _model(device)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-3)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # no pickled objects needed
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    again = _train(resumed, opt2, data[3:], 3)
    for a, b in zip(full, again):
        assert torch.equal(a, b)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), resumed.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert any(v.abs().sum() > 0 for k, v in model.state_dict().items() if "amax_history" in k)


def test_missing_fp8_state_keeps_fresh_state_with_warning(device):
    plain = torch.nn.Linear(32, 16)
    m = te.Linear(32, 16, device=device)
    m.fp8_state.fwd_scale.fill_(5.0)
    with pytest.warns(UserWarning, match="no FP8 scaling state"):
        result = m.load_state_dict(plain.state_dict())  # strict: FP8 keys are optional
    assert not result.missing_keys
    assert torch.equal(m.weight.cpu(), plain.weight) and torch.all(m.fp8_state.fwd_scale == 1)


def test_history_length_is_adopted_then_resized(device):
    src = te.Linear(32, 16, device=device)
    src.fp8_state.ensure_history_len(16)
    src.fp8_state.fwd_amax_history[1].fill_(3.0)
    dst = te.Linear(32, 16, device=device)
    dst.load_state_dict(src.state_dict())
    assert dst.fp8_state.fwd_amax_history.shape == (16, 2) and dst.fp8_state.fwd_amax_history[1, 0] == 3.0
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling(amax_history_len=4)):
        dst(torch.randn(16, 32, device=device))
    assert dst.fp8_state.fwd_amax_history.shape == (4, 2)


def test_mismatched_checkpoints_error(device):
    mlp = te.LayerNormMLP(32, 64, device=device)
    lin = te.LayerNormLinear(32, 64, device=device)
    sd = mlp.state_dict()
    sd = {k.replace("fc1_", ""): v for k, v in sd.items() if not k.startswith("fc2")}
    with pytest.raises(RuntimeError, match="2 fwd slots|4 fwd slots"):
        lin.load_state_dict(sd)
    partial = te.Linear(32, 16, device=device).state_dict()
    del partial["fp8_state.bwd_scale"]
    with pytest.raises(RuntimeError, match="incomplete: missing"):
        te.Linear(32, 16, device=device).load_state_dict(partial)
    wrong = te.Linear(32, 17, device=device).state_dict()
    with pytest.raises(RuntimeError, match="size mismatch"):
        te.Linear(32, 16, device=device).load_state_dict(wrong)
