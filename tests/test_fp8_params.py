"""FP8 parameters (quantized_model_init / fp8_model_init): GEMM weights held as FP8 bytes + scale.

The reference is the same module with high-precision weights, whose forward casts each weight with the
scale the FP8 parameter was written with: the same FP8 bytes of W give bit-equal outputs and gradients
(torch.equal), step after step, with fp32 master weights (MasterWeights + SGD) on the FP8 side and SGD
on the reference's own fp32 weights. FSDP2 with FP8 parameters is in tests/distributed/test_fsdp2.py.
"""
import copy
import io

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.params import Float8Weight, MasterWeights, is_fp8_weight, write_fp8_weights
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.ops.cast import quantize, quantize_current

RECIPES = {"delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling()}
MODULES = {
    "Linear": (te.Linear, (64, 48), {}, (16, 64)),
    "LayerNormMLP": (te.LayerNormMLP, (64, 96), dict(activation="swiglu", normalization="RMSNorm"), (16, 64)),
    "TransformerLayer": (te.TransformerLayer, (64, 128, 8),
                         dict(num_gqa_groups=4, activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0),
                         (16, 2, 64)),
}


def _build(name, device, recipe=None, preserve=True, **extra):
    cls, args, kw, _ = MODULES[name]
    torch.manual_seed(11)
    if recipe is None:
        return cls(*args, device=device, **kw, **extra)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return cls(*args, device=device, **kw, **extra)


def _fp8_names(module):
    return [n for n, p in module.named_parameters() if isinstance(p, Float8Weight)]


def assert_same_step(ref, fp8, x, recipe, step):
    """One fwd+bwd of both modules on copies of x under `recipe`: outputs, input gradients and every parameter
    gradient bit-equal."""
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with te.fp8_autocast(fp8_recipe=recipe):
        y_ref, y_fp8 = ref(xs[0]), fp8(xs[1])
    y_ref.float().pow(2).mean().backward()
    y_fp8.float().pow(2).mean().backward()
    assert torch.equal(y_ref, y_fp8), f"step {step}: outputs differ"
    assert torch.equal(xs[0].grad, xs[1].grad), f"step {step}: input gradients differ"
    for (n, p), q in zip(ref.named_parameters(), fp8.parameters()):
        assert torch.equal(p.grad, q.grad), f"step {step}: gradient of {n} differs"


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_training_equals_high_precision_weights(name, recipe_name, device):
    """Three SGD steps: FP8 weights + fp32 masters vs high-precision weights cast every forward."""
    recipe = RECIPES[recipe_name]
    ref, fp8 = _build(name, device), _build(name, device, recipe)
    expected = {"Linear": 1, "LayerNormMLP": 2, "TransformerLayer": 6}[name]  # q, k, v, proj, fc1, fc2
    assert len(_fp8_names(fp8)) == expected
    masters = MasterWeights(fp8.parameters())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_fp8 = torch.optim.SGD(masters.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        assert_same_step(ref, fp8, torch.randn(*MODULES[name][3], generator=g).to(device), recipe, step)
        masters.step(opt_fp8)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    if recipe.delayed():
        for a, b in zip(ref.modules(), fp8.modules()):
            if isinstance(a, FP8ScalingState):
                assert torch.equal(a.fwd_scale, b.fwd_scale) and torch.equal(a.bwd_scale, b.bwd_scale)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_bytes_are_the_forward_cast_of_the_weight(recipe_name, device):
    """The FP8 weight holds exactly quantize(W, scale): delayed with the module's weight scale (the amax
    recorded in its state), current with fp8_max / amax(W). One byte per element, no high-precision copy."""
    recipe = RECIPES[recipe_name]
    ref, fp8 = _build("Linear", device), _build("Linear", device, recipe, preserve=False)
    w, hp = fp8.weight, ref.weight.detach()
    if recipe.delayed():
        slot = FP8ScalingState.weight_slot(0)
        want = quantize(hp, fp8.fp8_state.fwd_scale[slot], torch.float8_e4m3fn)
        assert fp8.fp8_state.fwd_amax_history[0, slot] == hp.abs().max()
    else:
        want = quantize_current(hp, torch.float8_e4m3fn)
    assert torch.equal(w._data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(w.scale_inv, want.scale_inv.reshape(()))
    assert w._data.element_size() == 1 and w.get_high_precision_init_val() is None
    assert w.dtype == torch.float32 and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert not any(b.shape == w.shape for b in fp8.buffers()), "a high-precision copy of W is kept"


def test_writes_requantize(device):
    """copy_, .data.copy_, in-place ops and load_state_dict quantize the new value (current scaling: its
    own amax); a Float8Weight source is copied byte for byte."""
    fp8 = _build("Linear", device, RECIPES["current"])
    w = fp8.weight
    new = torch.randn(w.shape, device=device) * 3
    for write in (lambda v: w.copy_(v), lambda v: w.data.copy_(v),
                  lambda v: fp8.load_state_dict({**fp8.state_dict(), "weight": v})):
        with torch.no_grad():
            write(new)
        want = quantize_current(new, torch.float8_e4m3fn)
        assert torch.equal(w._data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(w.scale_inv, want.scale_inv.reshape(()))
        new = new * 0.5
    value = w.dequantize()
    with torch.no_grad():
        w.mul_(2.0)
    assert torch.equal(w.dequantize(), value * 2.0)  # powers of two: exact in FP8 with a new scale
    other = _build("Linear", device, RECIPES["current"])
    other.load_state_dict(fp8.state_dict())
    assert torch.equal(other.weight._data.view(torch.uint8), w._data.view(torch.uint8))
    assert torch.equal(other.weight._scales, w._scales)


def test_state_dict_file_round_trip_and_deepcopy(device):
    fp8 = _build("TransformerLayer", device, RECIPES["delayed"])
    buf = io.BytesIO()
    torch.save(fp8.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = _build("TransformerLayer", device, RECIPES["delayed"])
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(loaded)
    for (n, a), b in zip(fp8.named_parameters(), fresh.parameters()):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), n
    twin = copy.deepcopy(fp8)
    assert _fp8_names(twin) == _fp8_names(fp8)
    assert twin.layernorm_mlp.fc1_weight._quantizer.module is twin.layernorm_mlp
    qkv = twin.self_attention.layernorm_qkv
    assert qkv.query_weight._scales is qkv.value_weight._scales, "split pieces no longer share one scale"


def test_split_pieces_share_one_scale(device):
    """parameters_split (query/key/value): one FP8 buffer, one scale; written together they get a new one,
    a piece written alone keeps the shared scale; the forward joins them without a copy."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES["current"]):
        m = te.Linear(64, 96, parameters_split=("query", "key", "value"), device=device)
    q, k, v = m.query_weight, m.key_weight, m.value_weight
    assert q._scales is k._scales is v._scales and q._pieces == 3
    assert k._data.storage_offset() == q._data.numel()
    values = [torch.randn(p.shape, device=device) * s for p, s in zip((q, k, v), (1.0, 4.0, 2.0))]
    write_fp8_weights(zip((q, k, v), values))
    want = quantize_current(torch.cat(values), torch.float8_e4m3fn)
    assert torch.equal(torch.cat([q._data, k._data, v._data]).view(torch.uint8), want.data.view(torch.uint8))
    scale = q._scales.clone()
    with torch.no_grad():
        k.copy_(values[1] * 0.5)
    assert torch.equal(q._scales, scale), "a piece written alone changed the shared scale"
    with te.fp8_autocast(fp8_recipe=RECIPES["current"]):
        m(torch.randn(16, 64, device=device))


def test_forward_outside_autocast_uses_the_value(device):
    """Without FP8 compute the module multiplies by the dequantized weight (gradients flow to it)."""
    fp8 = _build("Linear", device, RECIPES["delayed"])
    plain = te.Linear(64, 48, device=device)
    with torch.no_grad():
        plain.weight.copy_(fp8.weight.dequantize())
        plain.bias.copy_(fp8.bias)
    x = torch.randn(16, 64, device=device)
    y1, y2 = fp8(x), plain(x)
    y1.sum().backward()
    y2.sum().backward()
    assert torch.equal(y1, y2) and torch.equal(fp8.weight.grad, plain.weight.grad)
    assert type(fp8.weight.grad) is torch.Tensor


def test_fsdp_ops_keep_fp8_bytes_scale_and_init_value():
    """What FSDP2 does to a parameter (chunk, new_zeros, narrow + copy_, view(-1), as_strided) keeps a
    Float8Weight with the shared scale, and the preserved initial value follows the same layout."""
    fp8 = _build("Linear", "cpu", RECIPES["delayed"])
    w = fp8.weight.detach()
    chunks = torch.chunk(w, 2, dim=0)
    padded = chunks[1].new_zeros((30, 64))
    padded.narrow(0, 0, 24).copy_(chunks[1])
    flat = padded.view(-1)
    back = torch.as_strided(flat, (24, 64), (64, 1), 0)
    for t in (chunks[1], padded, flat, back):
        assert isinstance(t, Float8Weight) and t._scales is w._scales and t._quantizer is w._quantizer
    assert torch.equal(back.dequantize(), w.dequantize()[24:])
    assert torch.equal(back.get_high_precision_init_val(), w.get_high_precision_init_val()[24:])
    assert type(torch.zeros_like(w)) is torch.Tensor, "a gradient-like tensor must be plain"
    half = w.to(torch.bfloat16)  # (module.to(dtype) keeps an FP8 model FP8: bytes and scale stay)
    assert type(half) is Float8Weight and half.dtype == torch.bfloat16 and torch.equal(half._data, w._data)


def test_meta_build_materialises(device):
    """Built on the meta device under quantized_model_init, to_empty + reset_parameters gives the FP8
    weights a direct build has."""
    direct = _build("LayerNormMLP", device, RECIPES["current"])
    torch.manual_seed(11)
    cls, args, kw, _ = MODULES["LayerNormMLP"]
    with te.quantized_model_init(recipe=RECIPES["current"], preserve_high_precision_init_val=True):
        lazy = cls(*args, device="meta", **kw)
    assert _fp8_names(lazy) == _fp8_names(direct)
    torch.manual_seed(11)
    lazy.to_empty(device=device)
    lazy.reset_parameters()
    for (n, a), b in zip(direct.named_parameters(), lazy.parameters()):
        assert type(a) is type(b) and torch.equal(a.detach(), b.detach()), n


def test_names_and_errors(device):
    assert te.fp8_model_init is te.quantized_model_init
    with te.quantized_model_init(enabled=False):
        assert not _fp8_names(te.Linear(64, 48, device=device))
    fp8 = _build("Linear", device, RECIPES["delayed"])
    assert is_fp8_weight(fp8.weight) and not is_fp8_weight(fp8.bias)
    with pytest.raises(ValueError, match="built for DelayedScaling") as e:
        with te.fp8_autocast(fp8_recipe=R.Float8CurrentScaling()):
            fp8(torch.randn(16, 64, device=device))
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="recipe must be a te_parallel recipe"):
        te.quantized_model_init(recipe="delayed")
    detached = torch.load(_saved(fp8.weight.detach()), weights_only=False)
    with pytest.raises(TypeError, match="detached from its module"):
        detached.copy_(torch.zeros(detached.shape))
    with pytest.raises(ValueError, match=r"value of shape \(2, 2\)"):
        write_fp8_weights([(fp8.weight, torch.zeros(2, 2))])


def _saved(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return buf
