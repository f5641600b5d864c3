"""Stand-ins for the helpers of TE's getting-started tutorial, its `quickstart_utils.py` (not shipped
with TE): a plain-PyTorch causal DotProductAttention, BasicMLP, parameter sharing into the TE-style models,
and a speedometer."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads: int, kv_channels: int, attention_dropout: float) -> None:
        super().__init__()
        self.p = attention_dropout

    def forward(self, q, k, v, attention_mask=None):  # [s, b, h, d] -> [s, b, h·d], causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        out = out.permute(2, 0, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1)


class BasicMLP(torch.nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = torch.nn.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(x), approximate="tanh"))


def _copy(dst, src):
    with torch.no_grad():
        dst.copy_(src)


def share_parameters_with_basic_te_model(te_model, basic):
    for a, b in [("ln1", "ln1"), ("ln2", "ln2"), ("qkv_projection", "qkv_projection"), ("projection", "projection")]:
        _copy(getattr(te_model, a).weight, getattr(basic, b).weight)
        _copy(getattr(te_model, a).bias, getattr(basic, b).bias)
    for n in ("linear1", "linear2"):
        _copy(getattr(te_model.mlp, n).weight, getattr(basic.mlp, n).weight)
        _copy(getattr(te_model.mlp, n).bias, getattr(basic.mlp, n).bias)


def share_parameters_with_fused_te_model(te_model, basic):
    _copy(te_model.ln_qkv.layer_norm_weight, basic.ln1.weight)
    _copy(te_model.ln_qkv.layer_norm_bias, basic.ln1.bias)
    _copy(te_model.ln_qkv.weight, basic.qkv_projection.weight)
    _copy(te_model.ln_qkv.bias, basic.qkv_projection.bias)
    _copy(te_model.projection.weight, basic.projection.weight)
    _copy(te_model.projection.bias, basic.projection.bias)
    _copy_mlp(te_model.ln_mlp, basic)


def _copy_mlp(ln_mlp, basic):
    _copy(ln_mlp.layer_norm_weight, basic.ln2.weight)
    _copy(ln_mlp.layer_norm_bias, basic.ln2.bias)
    _copy(ln_mlp.fc1_weight, basic.mlp.linear1.weight)
    _copy(ln_mlp.fc1_bias, basic.mlp.linear1.bias)
    _copy(ln_mlp.fc2_weight, basic.mlp.linear2.weight)
    _copy(ln_mlp.fc2_bias, basic.mlp.linear2.bias)


def share_parameters_with_transformerlayer_te_model(te_layer, basic):
    """The basic layer's fused QKV rows are per head [q(d), k(d), v(d)]; TE keeps query/key/value apart."""
    qkv = te_layer.self_attention.layernorm_qkv
    heads = basic.num_attention_heads
    w = basic.qkv_projection.weight.view(heads, 3, -1, basic.qkv_projection.weight.shape[1])
    b = basic.qkv_projection.bias.view(heads, 3, -1)
    for i, name in enumerate(("query", "key", "value")):
        _copy(getattr(qkv, f"{name}_weight"), w[:, i].reshape(-1, w.shape[-1]))
        _copy(getattr(qkv, f"{name}_bias"), b[:, i].reshape(-1))
    _copy(qkv.layer_norm_weight, basic.ln1.weight)
    _copy(qkv.layer_norm_bias, basic.ln1.bias)
    _copy(te_layer.self_attention.proj.weight, basic.projection.weight)
    _copy(te_layer.self_attention.proj.bias, basic.projection.bias)
    _copy_mlp(te_layer.layernorm_mlp, basic)


def speedometer(module, x, dy, forward_kwargs=None, fp8_autocast_kwargs=None, timing_iters=3, warmup_iters=1):
    """Mean fwd+bwd time in ms (wall clock, synchronized)."""
    import te_parallel as te

    forward_kwargs, fp8_autocast_kwargs = forward_kwargs or {}, fp8_autocast_kwargs or {"enabled": False}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for i in range(warmup_iters + timing_iters):
        if i == warmup_iters:
            sync()
            start = time.perf_counter()
        with te.fp8_autocast(**fp8_autocast_kwargs):
            y = module(x, **forward_kwargs)
        y.backward(dy)
    sync()
    ms = (time.perf_counter() - start) * 1000 / timing_iters
    print(f"Mean time: {ms} ms")
    return ms
