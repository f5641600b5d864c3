"""TE's checkpoint layout for te_parallel models (te.to_te_state_dict / te.from_te_state_dict, and the
TE extra-state codec under them): round trips, TE's slot and history order, and the restricted reader."""
import pickle

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import te_extra_state as tex
from te_parallel.fp8.state import FP8ScalingState


def _trained_layer():
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    for _ in range(3):
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling(amax_history_len=6)):
            out = layer(torch.randn(16, 2, 32))
        out.sum().backward()
    return layer


def test_round_trip_through_tes_layout_is_exact():
    layer = _trained_layer()
    sd = layer.state_dict()
    te_sd = te.to_te_state_dict(sd, layer, R.DelayedScaling(amax_history_len=6))
    assert sorted(k for k in te_sd if k.endswith("_extra_state")) == [
        "layernorm_mlp._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.layernorm_qkv._extra_state", "self_attention.proj._extra_state"]
    assert not any("fp8_state" in k for k in te_sd)
    fresh = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    fresh.load_state_dict(te.from_te_state_dict(te_sd, fresh), strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, sd[key]), key


def test_slots_and_history_order():
    """te_parallel slots (input 2g, weight 2g+1; grad g) sit at TE's 3g, 3g+1 and 2g; TE keeps the pass just
    finished in its last history row, te_parallel in row 1."""
    state = FP8ScalingState(2)
    state.ensure_history_len(4)
    with torch.no_grad():
        state.fwd_scale.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        state.bwd_scale.copy_(torch.tensor([5.0, 6.0]))
        state.fwd_amax_history.copy_(torch.arange(16.0).reshape(4, 4))
    te_state = tex.state_to_te(tex.state_tensors(state), 2, R.DelayedScaling())
    assert te_state["scale_fwd"].tolist() == [1.0, 2.0, 1.0, 3.0, 4.0, 1.0]
    assert te_state["scale_bwd"].tolist() == [5.0, 1.0, 6.0, 1.0]
    hist = te_state["amax_history_fwd"]
    assert hist[:, 1].tolist() == [1.0, 13.0, 9.0, 5.0]  # rows 0, then 1..3 reversed
    assert hist[:, 2].tolist() == [0.0] * 4  # TE's output slot: no history here


def test_never_fp8_modules_write_an_empty_state():
    m = te.Linear(16, 16, device="cpu")
    te_sd = te.to_te_state_dict(m.state_dict(), m)
    assert te_sd["_extra_state"].numel() == 0
    m.load_state_dict(te.from_te_state_dict(te_sd, m), strict=True)


def test_wrong_module_type_is_one_line_error():
    mlp = te.LayerNormMLP(16, 32, device="cpu")
    with te.fp8_autocast():
        mlp(torch.randn(16, 16)).sum().backward()
    blob = te.to_te_state_dict(mlp.state_dict(), mlp)["_extra_state"]
    lin = te.Linear(16, 16, device="cpu")
    with pytest.raises(ValueError, match="6 forward slots .* another module type"):
        te.from_te_state_dict({**lin.state_dict(), "_extra_state": blob}, lin)


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo should-not-run",))


def test_restricted_reader_refuses_code():
    blob = torch.frombuffer(bytearray(pickle.dumps({"recipe": _Evil()})), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system|nt.system"):
        tex.decode(blob, 1)


def test_custom_amax_function_cannot_be_written():
    m = te.Linear(16, 16, device="cpu")
    r = R.DelayedScaling(amax_compute_algo=lambda h: h.amax(0))
    with te.fp8_autocast(fp8_recipe=r):
        m(torch.randn(16, 16)).sum().backward()
    with pytest.raises(ValueError, match="custom amax"):
        te.to_te_state_dict(m.state_dict(), m, r)


def test_fp8_attention_state_is_left_out_of_tes_layout_and_loads_fresh():
    """A layer that ran FP8 attention (fp8_dpa) has `fp8_attention_state`: TE's layout leaves it out with a warning,
    and that layout loads back strictly, the attention's scales fresh and everything else as saved."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")  # head dim 16
    rec = R.DelayedScaling(amax_history_len=4, fp8_dpa=True)
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=rec):
            out = layer(torch.randn(16, 2, 64))
        out.sum().backward()
    sd = layer.state_dict()
    att = [k for k in sd if ".fp8_attention_state." in k]
    assert att and any(sd[k].any() for k in att if k.endswith("amax_history"))
    with pytest.warns(UserWarning, match="FP8 attention scaling state"):
        te_sd = te.to_te_state_dict(sd, layer)
    assert not any(".fp8_attention_state." in k for k in te_sd)
    back = te.from_te_state_dict(te_sd, layer)
    layer.load_state_dict(back, strict=True)
    for k in att:
        want = torch.ones_like(sd[k]) if "scale" in k else torch.zeros_like(sd[k])
        assert torch.equal(layer.state_dict()[k].cpu(), want), k
    for k in sd:
        if k not in att and not k.endswith("_extra_state"):
            assert torch.equal(layer.state_dict()[k], sd[k]), k
