"""Independent fp64 references for attention and the transformer layer (plain PyTorch, copied weights)."""
from __future__ import annotations

import math

import torch


def ref_attention(q, k, v, masked=None, scale=None, keep=None, dropout=0.0):
    """q [s, b, h, d], k/v [s_kv, b, g, d] (fp64); masked: bool [b|1, h|1, s, s_kv], True = masked out;
    keep: the dropout mask (0/1 [b, h, s, s_kv]) applied to the probabilities, scaled by 1 / (1 - dropout)."""
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scale = scale or 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if keep is not None:
        probs = probs * keep.to(probs) / (1 - dropout)
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


def te_mask(s, t, mask_type="no_mask", win=None):
    """bool [s, t], True = masked out, with TE's alignment: causal diagonal (and the window with it)
    top-left for "causal"/"padding_causal", bottom-right for "*_bottom_right" and non-causal types."""
    causal_ = "causal" in mask_type
    bottom_right = mask_type.endswith("bottom_right") or not causal_
    i = torch.arange(s).view(-1, 1) + ((t - s) if bottom_right else 0)
    j = torch.arange(t).view(1, -1)
    out = torch.zeros(s, t, dtype=torch.bool)
    if causal_:
        out |= j > i
    if win is not None:
        if win[0] >= 0:
            out |= j < i - win[0]
        if win[1] >= 0:
            out |= j > i + win[1]
    return out


def padding_masked(pad_q, pad_kv):
    """[b, s_q], [b, s_kv] bool (True = padding) -> [b, 1, s_q, s_kv]: padded keys and whole padded query
    rows (which then output 0, as TE)."""
    return pad_kv[:, None, None, :] | pad_q[:, None, :, None]


def ref_thd(q, k, v, cu_q, cu_kv, mask_type="padding", win=None, scale=None):
    """Packed q [t_q, h, d], k/v [t_kv, g, d] (fp64) -> [t_q, h·d]: each sequence on its own."""
    outs = []
    cq, ck = cu_q.tolist(), cu_kv.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        sq, skv = qs.shape[0], ks.shape[0]
        if sq == 0:
            continue
        if skv == 0:
            outs.append(qs.flatten(1) * 0)
            continue
        masked = te_mask(sq, skv, mask_type, win)
        out = ref_attention(qs.unsqueeze(1), ks.unsqueeze(1), vs.unsqueeze(1), masked, scale)
        outs.append(out.squeeze(1))
    return torch.cat(outs) if outs else q.flatten(1) * 0


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
    """mask: the padding mask [b, 1, 1, s] (True = padding); padded query rows attend to nothing (TE)."""
    pad = mask.view(mask.shape[0], -1)
    h = x + ref_mha(p, "self_attention.", x, heads, groups, eps, padding_masked(pad, pad), input_ln=False)
    m, y = ref_mlp(p, h, eps)
    return ln(y + m, p["layernorm.weight"], p["layernorm.bias"], eps)


def ref_t5_decoder(p, x, enc, heads, groups, eps, mask):
    h = x + ref_mha(p, "self_attention.", x, heads, groups, eps, mask)
    h = h + ref_mha(p, "inter_attention.", h, heads, groups, eps, None, enc=enc)
    m, _ = ref_mlp(p, h, eps)
    return h + m
