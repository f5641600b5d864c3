"""TransformerLayer in GPT, BERT and T5-decoder configurations vs independent plain-PyTorch references.

fp32 vs the fp64 reference: relative error < 1e-5 for the output and every gradient. FP8 (delayed,
HYBRID) vs the same fp64 reference without quantization: < 8e-2 for output and input gradient,
< 0.15 for parameter gradients (E5M2 gradients carry 2 mantissa bits), and the FP8 run must
differ from the fp32 run (it really quantizes).
"""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from tests.attention_reference import ref_bert, ref_gpt, ref_t5_decoder
from tests.reference import rel_err

S, B, HID, FFN, HEADS = 16, 2, 64, 128, 4
CONFIGS = {
    "gpt": dict(),
    "bert": dict(apply_residual_connection_post_layernorm=True, output_layernorm=True, self_attn_mask_type="padding"),
    "t5-decoder": dict(layer_type="decoder"),
}


def _layer(name, device, **extra):
    torch.manual_seed(0)
    return te.TransformerLayer(HID, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, device=device,
                               init_method=lambda w: torch.nn.init.normal_(w, 0, 0.05), **CONFIGS[name], **extra)


def _nontrivial_norms(layer):
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if "layer_norm" in n or n.startswith("layernorm."):
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith("bias"):
                p.normal_(0, 0.05)


def _run(name, layer, x, enc, mask, recipe=None):
    kwargs = {}
    if name == "bert":
        kwargs["attention_mask"] = mask
    if name == "t5-decoder":
        kwargs["encoder_output"] = enc
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        return layer(x, **kwargs)


def _reference(name, layer, x, enc, mask_ref):
    p = {n: t.detach().double().cpu().requires_grad_(True) for n, t in layer.named_parameters()}
    xr = x.detach().double().cpu().requires_grad_(True)
    eps = 1e-5
    if name == "gpt":
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
        out = ref_gpt(p, xr, HEADS, HEADS, eps, causal)
    elif name == "bert":
        out = ref_bert(p, xr, HEADS, HEADS, eps, mask_ref)
    else:
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
        out = ref_t5_decoder(p, xr, enc.detach().double().cpu(), HEADS, HEADS, eps, causal)
    return out, xr, p


def _grad_close(name, got, ref, tol):
    """Relative error, except for gradients that are zero in exact arithmetic (the key bias: softmax
    ignores a per-query constant), where the absolute size must be rounding-level."""
    if ref.norm() < 1e-12:
        assert got.norm() < 1e-5, f"{name}: {got.norm():.2e} should be ~0"
    else:
        err = rel_err(got.cpu(), ref)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


def _inputs(device):
    x = torch.randn(S, B, HID, device=device, requires_grad=True)
    enc = torch.randn(S // 2, B, HID, device=device)
    pad = torch.arange(S).view(1, S) >= torch.tensor([S, S - 5]).view(B, 1)
    return x, enc, pad.view(B, 1, 1, S).to(device), pad.view(B, 1, 1, S)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_fp32_vs_reference(name, device):
    layer = _layer(name, device)
    _nontrivial_norms(layer)
    x, enc, mask, mask_ref = _inputs(device)
    out = _run(name, layer, x, enc, mask)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref, xr, p = _reference(name, layer, x, enc, mask_ref)
    ref.backward(dy.double().cpu())
    assert rel_err(out.cpu(), ref) < 1e-5
    assert rel_err(x.grad.cpu(), xr.grad) < 1e-5
    for n, prm in layer.named_parameters():
        _grad_close(n, prm.grad, p[n].grad, 1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_fp8_vs_reference(name, device):
    layer = _layer(name, device)
    _nontrivial_norms(layer)
    x, enc, mask, mask_ref = _inputs(device)
    recipe = R.DelayedScaling(fp8_format=R.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    for step in range(2):  # step 0 calibrates the delayed scales
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = _run(name, layer, x, enc, mask, recipe)
        dy = torch.randn_like(out) if step == 0 else dy
        out.backward(dy)
    ref, xr, p = _reference(name, layer, x, enc, mask_ref)
    ref.backward(dy.double().cpu())
    err = rel_err(out.cpu(), ref)
    assert 1e-4 < err < 8e-2, err
    assert rel_err(x.grad.cpu(), xr.grad) < 8e-2
    for n, prm in layer.named_parameters():
        _grad_close(n, prm.grad, p[n].grad, 0.15)


def test_gqa_window_rope_fused_qkv_layer(device):
    """GQA, sliding window, RoPE and a fused interleaved QKV weight: same result as separate weights."""
    kw = dict(num_gqa_groups=2, window_size=(4, 0), hidden_dropout=0.0, attention_dropout=0.0, device=device)
    torch.manual_seed(0)
    sep = te.TransformerLayer(HID, FFN, HEADS, **kw)
    fused = te.TransformerLayer(HID, FFN, HEADS, fuse_qkv_params=True, **kw)
    d, g = HID // HEADS, 2
    with torch.no_grad():
        src = dict(sep.named_parameters())
        for n, prm in fused.named_parameters():
            if n in src:
                prm.copy_(src[n])
        qkv = sep.self_attention.layernorm_qkv
        q = qkv.query_weight.view(g, HEADS // g, d, HID)
        k, v = qkv.key_weight.view(g, 1, d, HID), qkv.value_weight.view(g, 1, d, HID)
        fused.self_attention.layernorm_qkv.weight.copy_(torch.cat([q, k, v], 1).reshape(-1, HID))
        qb = qkv.query_bias.view(g, HEADS // g, d)
        kb, vb = qkv.key_bias.view(g, 1, d), qkv.value_bias.view(g, 1, d)
        fused.self_attention.layernorm_qkv.bias.copy_(torch.cat([qb, kb, vb], 1).reshape(-1))
    x = torch.randn(S, B, HID, device=device)
    freqs = te.RotaryPositionEmbedding(d)(S).to(device)
    a, b = sep(x, rotary_pos_emb=freqs), fused(x, rotary_pos_emb=freqs)
    assert rel_err(a.cpu(), b.cpu()) < 1e-6
    with_rope = sep.self_attention(x, rotary_pos_emb=freqs)
    assert rel_err(with_rope.cpu(), sep.self_attention(x).cpu()) > 1e-2  # RoPE is applied


def test_dropout_and_drop_path_train_vs_eval(device):
    layer = te.TransformerLayer(HID, FFN, HEADS, hidden_dropout=0.5, attention_dropout=0.5, drop_path_rate=0.5, device=device)
    x = torch.randn(S, B, HID, device=device)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_attention_heads=5), ValueError, "hidden_size=64 is not divisible by num_attention_heads=5"),
    (dict(self_attn_mask_type="upper"), ValueError, "attn_mask_type must be one of"),
    (dict(layer_type="encdec"), ValueError, "layer_type must be 'encoder' or 'decoder'"),
    (dict(tp_size=3, set_parallel_mode=True), ValueError, "not divisible by tp_size=3"),
    (dict(activation="tanh"), ValueError, "activation must be one of"),
])
def test_bad_layer_args(kwargs, exc, match, device):
    args = dict(hidden_size=HID, ffn_hidden_size=FFN, num_attention_heads=HEADS, device=device)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        te.TransformerLayer(**args)
