"""TE's checkpoint layout through the stand-in: `<module>._extra_state` carries the FP8 state both ways.

"TE" here is a stand-in of TE 2.9's recipe module (`_fake_te_recipe_module`: its Format, _FormatHelper
and DelayedScaling, put at `transformer_engine.common.recipe` in sys.modules only while pickling or
unpickling), so the test can write a blob as TE's get_extra_state does (plain pickle of TE's objects)
and read ours as TE's set_extra_state does (plain pickle.loads), without NVIDIA's TE installed.
"""
from tests.compat import stand_in

stand_in.require()

import dataclasses
import enum
import io
import pickle
import sys
import types
from typing import NamedTuple

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPE_MODULE = "transformer_engine.common.recipe"


def _fake_te_recipe_module():
    mod = types.ModuleType(RECIPE_MODULE)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(448, 448)
        E5M2 = _FormatHelper(57344, 57344)
        HYBRID = _FormatHelper(448, 57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False

        def delayed(self):
            return True

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = RECIPE_MODULE, cls.__name__
        setattr(mod, cls.__name__, cls)
    return mod


@pytest.fixture
def fake_te(monkeypatch):
    mod = _fake_te_recipe_module()

    class Swap:
        def __enter__(self):
            self.saved = sys.modules[RECIPE_MODULE]
            sys.modules[RECIPE_MODULE] = mod
            return mod

        def __exit__(self, *exc):
            sys.modules[RECIPE_MODULE] = self.saved

    return Swap()


def _te_blob(mod, fwd_scale, fwd_hist, bwd_scale, bwd_hist, **recipe_fields):
    """What TE 2.9's get_extra_state writes (its code path, with plain pickle)."""
    state = {"recipe": mod.DelayedScaling(**recipe_fields), "scale_fwd": fwd_scale, "amax_history_fwd": fwd_hist,
             "scale_bwd": bwd_scale, "amax_history_bwd": bwd_hist,
             "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0}}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def _train(module, steps=3, tokens=16, features=32):
    r = recipe.DelayedScaling(amax_history_len=5)
    for _ in range(steps):
        with te.fp8_autocast(fp8_recipe=r):
            out = module(torch.randn(tokens, 2, features))
        (out[0] if isinstance(out, tuple) else out).sum().backward()


@pytest.mark.parametrize("make", [lambda: te.Linear(32, 48, device="cpu"),
                                  lambda: te.LayerNormLinear(32, 48, normalization="RMSNorm", device="cpu"),
                                  lambda: te.LayerNormMLP(32, 64, device="cpu")])
def test_te_layout_round_trip_strict(make):
    torch.manual_seed(0)
    a = make()
    _train(a)
    sd = a.state_dict()
    assert "_extra_state" in sd and not any(k.startswith("fp8_state") for k in sd)
    b = make()
    b.load_state_dict(sd, strict=True)
    for key in ("fwd_scale", "fwd_amax_history", "bwd_scale", "bwd_amax_history", "fwd_scale_inv"):
        assert torch.equal(getattr(a.fp8_state, key), getattr(b.fp8_state, key)), key
    assert a.fp8_state.updates() == b.fp8_state.updates()
    x = torch.randn(16, 2, 32)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=5)):
        ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)  # the resumed module continues bit for bit


def test_never_fp8_module_writes_tes_empty_state():
    m = te.Linear(16, 16, device="cpu")
    assert m.state_dict()["_extra_state"].numel() == 0
    te.Linear(16, 16, device="cpu").load_state_dict(m.state_dict(), strict=True)
    assert te.LayerNorm(16).state_dict()["_extra_state"].numel() > 0  # TE's ops pickle {}
    assert te.DotProductAttention(2, 8).state_dict()["_extra_state"].numel() == 0


def test_reads_what_te_writes(fake_te):
    gen = torch.Generator().manual_seed(0)
    fwd_scale, bwd_scale = torch.rand(3, generator=gen) + 0.5, torch.rand(2, generator=gen) + 0.5
    fwd_hist, bwd_hist = torch.rand(4, 3, generator=gen), torch.rand(4, 2, generator=gen)
    with fake_te as mod:
        blob = _te_blob(mod, fwd_scale, fwd_hist, bwd_scale, bwd_hist, amax_history_len=4, margin=1)
    m = te.Linear(32, 32, device="cpu")
    sd = dict(m.state_dict(), _extra_state=blob)
    m.load_state_dict(sd, strict=True)
    # TE's slots per GEMM: input 0, weight 1, output 2 (forward); grad output 0, grad input 1 (backward)
    assert torch.equal(m.fp8_state.fwd_scale, fwd_scale[:2]) and torch.equal(m.fp8_state.bwd_scale, bwd_scale[:1])
    # TE's history: the pass just finished is the last row; te_parallel's: row 1 (rows 1.. reversed)
    assert torch.equal(m.fp8_state.fwd_amax_history[0], fwd_hist[0, :2])
    assert torch.equal(m.fp8_state.fwd_amax_history[1:], fwd_hist[1:, :2].flip(0))
    assert torch.equal(m.fp8_state.bwd_amax_history[1:], bwd_hist[1:, :1].flip(0))


def test_te_reads_what_we_write(fake_te):
    torch.manual_seed(0)
    m = te.Linear(32, 32, device="cpu")
    _train(m)
    blob = m.state_dict()["_extra_state"]
    with fake_te as mod:
        state = pickle.loads(blob.numpy().tobytes())  # TE's set_extra_state: a plain unpickle
    rec = state["recipe"]
    assert isinstance(rec, mod.DelayedScaling) and rec.fp8_format is mod.Format.HYBRID and rec.amax_history_len == 5
    assert state["scale_fwd"].shape == (3,) and torch.equal(state["scale_fwd"][:2], m.fp8_state.fwd_scale)
    assert state["scale_fwd"][2] == 1.0 and state["amax_history_fwd"].shape == (5, 3)
    assert torch.equal(state["amax_history_fwd"][1:, :2], m.fp8_state.fwd_amax_history[1:].flip(0))
    assert state["extra_fp8_variables"]["num_gemms"] == 1


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo should-not-run",))


@pytest.mark.parametrize("payload", [_Evil(), {"recipe": _Evil()}, {"scale_fwd": eval}])
def test_restricted_loader_executes_nothing(payload):
    blob = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
    m = te.Linear(16, 16, device="cpu")
    with pytest.raises(pickle.UnpicklingError, match="restricted loader"):
        m.load_state_dict(dict(m.state_dict(), _extra_state=blob))


def test_transformer_layer_te_layout_round_trip():
    torch.manual_seed(0)
    make = lambda: te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")  # noqa: E731
    a = make()
    _train(a, tokens=16, features=32)
    sd = a.state_dict()
    extra = sorted(k for k in sd if k.endswith("_extra_state"))
    assert extra == ["layernorm_mlp._extra_state", "self_attention.core_attention._extra_state",
                     "self_attention.layernorm_qkv._extra_state", "self_attention.proj._extra_state"]
    assert not any("fp8_state" in k for k in sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b = make()
    b.load_state_dict(torch.load(buf, weights_only=True), strict=True)  # the blobs are uint8 tensors
    for (name, ma), mb in zip(a.named_modules(), b.modules()):
        if "fp8_state" in ma._modules:
            assert torch.equal(ma.fp8_state.fwd_scale, mb.fp8_state.fwd_scale), name
            assert torch.equal(ma.fp8_state.bwd_amax_history, mb.fp8_state.bwd_amax_history), name
