"""Independent fp64 references for attention and the transformer layer (plain PyTorch, copied weights)."""
from __future__ import annotations

import math

import torch


def ref_attention(q, k, v, masked=None, scale=None):
    """q [s, b, h, d], k/v [s_kv, b, g, d] (fp64); masked: bool [b|1, h|1, s, s_kv], True = masked out."""
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scale = scale or 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def causal(s, t, shift=0):
    return torch.triu(torch.ones(s, t, dtype=torch.bool), diagonal=1 + shift)


def window(s, t, left, right):
    i = torch.arange(s).view(-1, 1) + (t - s)
    j = torch.arange(t).view(1, -1)
    out = torch.zeros(s, t, dtype=torch.bool)
    if left >= 0:
        out |= j < i - left
    if right >= 0:
        out |= j > i + right
    return out


def rope_ref(t, base=10000.0):
    """Rotary embedding as complex rotation of (x_i, x_{i+d/2}) pairs by angle pos·base^(-2i/d); t [s, b, h, d]."""
    s, d = t.shape[0], t.shape[-1]
    half = d // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = torch.arange(s, dtype=torch.float64).view(s, 1, 1, 1) * theta
    z = torch.complex(t[..., :half], t[..., half:]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], dim=-1)


def ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def lin(x, p, name):
    y = x @ p[f"{name}weight"].t()
    return y + p[f"{name}bias"] if f"{name}bias" in p else y


def ref_mha(p, pre, x, heads, groups, eps, mask=None, enc=None, input_ln=True, rope=False):
    """TE MultiheadAttention with separate query/key/value weights, as plain math."""
    if enc is None:
        base = f"{pre}layernorm_qkv." if input_ln else f"{pre}qkv."
        src = ln(x, p[base + "layer_norm_weight"], p[base + "layer_norm_bias"], eps) if input_ln else x
        q, k, v = lin(src, p, base + "query_"), lin(src, p, base + "key_"), lin(src, p, base + "value_")
    else:
        base = f"{pre}layernorm_query."
        q = lin(ln(x, p[base + "layer_norm_weight"], p[base + "layer_norm_bias"], eps), p, base)
        k, v = lin(enc, p, f"{pre}key_value.key_"), lin(enc, p, f"{pre}key_value.value_")
    d = q.shape[-1] // heads
    q, k, v = (t.reshape(*t.shape[:2], -1, d) for t in (q, k, v))
    if rope:
        q, k = rope_ref(q), rope_ref(k)
    ctx = ref_attention(q, k, v, mask)
    return lin(ctx, p, f"{pre}proj.")


def ref_mlp(p, x, eps):
    y = ln(x, p["layernorm_mlp.layer_norm_weight"], p["layernorm_mlp.layer_norm_bias"], eps)
    h = gelu(y @ p["layernorm_mlp.fc1_weight"].t() + p["layernorm_mlp.fc1_bias"])
    return h @ p["layernorm_mlp.fc2_weight"].t() + p["layernorm_mlp.fc2_bias"], y


def ref_gpt(p, x, heads, groups, eps, mask):
    h = x + ref_mha(p, "self_attention.", x, heads, groups, eps, mask)
    m, _ = ref_mlp(p, h, eps)
    return h + m


def ref_bert(p, x, heads, groups, eps, mask):
    h = x + ref_mha(p, "self_attention.", x, heads, groups, eps, mask, input_ln=False)
    m, y = ref_mlp(p, h, eps)
    return ln(y + m, p["layernorm.weight"], p["layernorm.bias"], eps)


def ref_t5_decoder(p, x, enc, heads, groups, eps, mask):
    h = x + ref_mha(p, "self_attention.", x, heads, groups, eps, mask)
    h = h + ref_mha(p, "inter_attention.", h, heads, groups, eps, None, enc=enc)
    m, _ = ref_mlp(p, h, eps)
    return h + m
