"""Deferred init: every module builds on the meta device and materialises with to_empty + reset_parameters
into the module an eager build with the same seed gives, bit for bit (parameters, FP8 state, buffers,
outputs and gradients, in high precision and FP8); and the counter-based initialiser behind it."""
import math

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.module.init import counter_normal, philox4x32
from te_parallel.module.params import _are_adjacent
from te_parallel.parallel.sharding import replicated, split_layout

H, FFN, HEADS = 32, 64, 4
TL = dict(hidden_dropout=0.0, attention_dropout=0.0, attention_backend="math")  # (a deterministic backward on CUDA)
MODULES = {
    "Linear": lambda **d: te.Linear(H, 48, **d),
    "Linear-split": lambda **d: te.Linear(H, 48, parameters_split={"query": 16, "key": 24, "value": 8}, **d),
    "LayerNormLinear": lambda **d: te.LayerNormLinear(H, 48, normalization="RMSNorm", **d),
    "LayerNormMLP": lambda **d: te.LayerNormMLP(H, FFN, activation="swiglu", **d),
    "LayerNorm": lambda **d: te.LayerNorm(H, **d),
    "RMSNorm": lambda **d: te.RMSNorm(H, zero_centered_gamma=True, **d),
    "DotProductAttention": lambda **d: te.DotProductAttention(HEADS, H // HEADS, backend="math"),
    "MultiheadAttention": lambda **d: te.MultiheadAttention(H, HEADS, attention_dropout=0.0, input_layernorm=True,
                                                            attention_backend="math", **d),
    "MultiheadAttention-fused": lambda **d: te.MultiheadAttention(
        H, HEADS, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False, num_gqa_groups=2,
        attention_backend="math", **d),
    "TransformerLayer": lambda **d: te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=2, activation="swiglu", **TL, **d),
    "TransformerLayer-decoder": lambda **d: te.TransformerLayer(H, FFN, HEADS, layer_type="decoder",
                                                                 fuse_qkv_params=True, **TL, **d),
    "RotaryPositionEmbedding": lambda **d: te.RotaryPositionEmbedding(8, rotary_base=500.0),
}
GEMM = {"Linear", "Linear-split", "LayerNormLinear", "LayerNormMLP"}
NO_DEVICE_ARG = {"DotProductAttention", "RotaryPositionEmbedding"}  # (as in TE)
BUILDS = [(n, how) for n in MODULES for how in ("context", "argument") if how == "context" or n not in NO_DEVICE_ARG]


def _inputs(name, device):
    g = torch.Generator().manual_seed(7)
    rand = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    if name == "DotProductAttention":
        return (rand(8, 2, HEADS, H // HEADS).requires_grad_(), rand(8, 2, HEADS, H // HEADS), rand(8, 2, HEADS, H // HEADS)), {}
    if name == "RotaryPositionEmbedding":
        return (8,), {}
    kw = {"encoder_output": rand(8, 2, H)} if name.endswith("decoder") else {}
    return (rand(8, 2, H).requires_grad_(),), kw


def _run(module, name, device, recipe=None):
    """Output and the gradients of the input and every parameter after one forward/backward."""
    args, kw = _inputs(name, device)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = module(*args, **kw)
    if not out.requires_grad:
        return [out]
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(device))
    grads = [args[0].grad] + [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [out.detach()] + grads


def _state(module):
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_same(a, b, what):
    sa, sb = _state(a), _state(b)
    assert list(sa) == list(sb), what
    for n in sa:
        assert sa[n].device == sb[n].device and torch.equal(sa[n], sb[n]), f"{what}: {n} differs"


def _build(name, how, device):
    if how == "context" or name in NO_DEVICE_ARG:
        with torch.device(device):
            return MODULES[name]()
    return MODULES[name](device=device)


@pytest.mark.parametrize("name, how", BUILDS)
def test_meta_then_materialise_equals_eager(name, how, device):
    torch.manual_seed(11)
    eager = _build(name, "argument", device)
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    meta = _build(name, how, "meta")
    assert torch.equal(torch.random.get_rng_state(), before), "a meta build must not draw from the generator"
    assert all(t.is_meta for t in _state(meta).values()), "a meta build must allocate nothing"
    if name != "DotProductAttention":
        with pytest.raises(RuntimeError, match="meta device .* materialise it first with module.to_empty"):
            meta(*_inputs(name, device)[0], **_inputs(name, device)[1])
    meta.to_empty(device=device)
    with torch.no_grad():  # what to_empty leaves is garbage; make it loud garbage
        for t in _state(meta).values():
            t.fill_(float("nan")) if t.is_floating_point() else t.fill_(7)
    meta.reset_parameters()
    _assert_same(eager, meta, name)
    for step, recipe in enumerate([None, R.DelayedScaling(amax_history_len=4)] if name in GEMM or "Layer" in name else [None]):
        got, want = _run(meta, name, device, recipe), _run(eager, name, device, recipe)
        for i, (g, w) in enumerate(zip(got, want)):
            assert (g is None and w is None) or torch.equal(g, w), f"{name} step {step}: output/grad {i} differs"
    _assert_same(eager, meta, f"{name} after FP8 steps")


@pytest.mark.parametrize("name", sorted(GEMM | {"TransformerLayer"}))
def test_reset_parameters_restores_construction_and_fresh_fp8_state(name, device):
    torch.manual_seed(3)
    module = MODULES[name](device=device)
    fresh = {n: t.clone() for n, t in _state(module).items()}
    _run(module, name, device, R.DelayedScaling(amax_history_len=4))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    states = [m for m in module.modules() if isinstance(m, FP8ScalingState)]
    assert states and any(s.fwd_amax_history.abs().sum() > 0 for s in states)
    torch.manual_seed(3)
    module.reset_parameters()
    for n, t in _state(module).items():
        assert torch.equal(t, fresh[n]), f"{name}: {n} not back to its constructed value"
    assert all(s.updates() == [0, 0] for s in states)


def test_markers_and_split_views_survive_to_empty(device):
    with torch.device("meta"):
        mlp = te.LayerNormMLP(H, FFN, sequence_parallel=True)
        lin = te.Linear(H, 48, parameters_split=("query", "key", "value"))
    for m in (mlp, lin):
        m.to_empty(device=device)
        m.reset_parameters()
    assert mlp.layer_norm_weight.sequence_parallel and mlp.fc2_bias.sequence_parallel
    weights = [lin.query_weight, lin.key_weight, lin.value_weight]
    assert _are_adjacent(weights), "split weights must be views of one buffer again (a copy-free forward)"


def test_output_layer_init_method_follows_te(device):
    """TE: proj / fc2 take output_layer_init_method, the default N(0, 0.023²) when it is None."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(128, 256, 4, init_method=te.init.normal_(0.2), device=device, **TL)
    stds = {n: p.std().item() for n, p in layer.named_parameters() if n.endswith("weight") and p.dim() == 2}
    for n, s in stds.items():
        want = 0.023 if n.endswith(("proj.weight", "fc2_weight")) else 0.2
        assert abs(s - want) < 0.1 * want, f"{n}: std {s:.4f}, want {want}"
    layer = te.TransformerLayer(128, 256, 4, output_layer_init_method=te.init.scaled_normal_(0.2, 8), device=device, **TL)
    assert abs(layer.layernorm_mlp.fc2_weight.std().item() - 0.05) < 0.005


def test_plain_callable_init_method_is_called_on_the_local_weight(device):
    seen = []
    m = te.Linear(H, 48, parameters_split=("a", "b"), init_method=lambda w: seen.append(tuple(w.shape)) or w.fill_(0.5),
                  device=device)
    assert seen == [(48, H)] and bool((m.a_weight == 0.5).all()) and bool((m.b_bias == 0).all())


# --- the generator --------------------------------------------------------------------------------
def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    cases = [((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, 0xFFFFFFFFFFFFFFFF, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0x299F31D0A4093822,
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        got = philox4x32([torch.tensor([c], dtype=torch.int64) for c in ctr], key)
        assert tuple(int(w) for w in got) == want


def test_counter_normal_is_normal():
    z = counter_normal(12345, torch.arange(1 << 16))  # 4+ standard errors of slack in each check below
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.015
    for k, p in ((1, 0.6827), (2, 0.9545), (3, 0.9973)):  # the normal's mass within k sigma
        assert abs((z.abs() < k).double().mean().item() - p) < 8e-3
    assert not torch.equal(counter_normal(12346, torch.arange(10)), z[:10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dim, blocks", [(0, None), (1, None), (0, [6, 8])])
def test_shard_values_are_slices_of_the_full_tensor(dtype, dim, blocks, device):
    """Odd sizes so torch's CPU kernels take their scalar tails in different places per shard size."""
    full_shape = (14, 13) if dim == 0 else (7, 26)
    torch.manual_seed(5)
    full = torch.empty(full_shape, dtype=dtype, device=device)
    te.init.normal_(0.5, 0.1).fill_(full, replicated(full_shape))
    for tp in (2,):
        for r in range(tp):
            layout = split_layout(full_shape, dim, r, tp, blocks)
            local = torch.empty(layout.local_shape, dtype=dtype, device=device)
            torch.manual_seed(5)
            te.init.normal_(0.5, 0.1).fill_(local, layout)
            for loc, index in layout.global_slices():
                assert torch.equal(local.narrow(dim, loc.start, loc.stop - loc.start), full[index]), (tp, r, loc)


def test_plain_call_and_bad_arguments():
    torch.manual_seed(0)
    t = te.init.normal_(2.0)(torch.empty(1000))
    assert abs(t.std().item() - 2.0) < 0.2
    with pytest.raises(ValueError, match="std must be a number >= 0, got -1"):
        te.init.normal_(-1)
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        te.init.scaled_normal_(0.02, 0)
    with pytest.raises(ValueError, match=r"tensor of shape \(3,\) does not match its layout's local shape \(4,\)"):
        te.init.normal_().fill_(torch.empty(3), replicated((4,)))
    assert math.isclose(te.init.scaled_normal_(0.02, 8).std, 0.02 / 4)


def test_layout_boxes_of_an_fsdp_region():
    """An FSDP2 shard (rows [2, 6) of a gated fc1's TP shard [a_r; b_r]) cut by the layout's two pieces."""
    from te_parallel.module.init import layout_boxes

    layout = split_layout((16, 3), 0, 1, 2, blocks=[8, 8])  # local rows: full [4, 8) then [12, 16)
    assert layout_boxes(layout, ((2, 0), (4, 3))) == [((0, 0), (6, 0), (2, 3)), ((2, 0), (12, 0), (2, 3))]
    row = split_layout((5, 8), 1, 1, 2)  # local columns: full [4, 8); the region takes rows [3, 5)
    assert layout_boxes(row, ((3, 0), (2, 4))) == [((0, 0), (3, 4), (2, 4))]
    assert layout_boxes(replicated((6,)), ((4,), (2,))) == [((0,), (4,), (2,))]
