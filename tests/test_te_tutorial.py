"""TE's getting-started tutorial with only the import changed: the basic layer, the
te.Linear/te.LayerNorm layer, the LayerNormLinear/LayerNormMLP layer, te.TransformerLayer and the
same under FP8 (DelayedScaling HYBRID, history 16, "max"). Full size (4096, 16384, 32 heads,
s 2048, b 4, fp16) on a GPU (tests/gpu); reduced on the CPU. With dropout off (eval) every TE
variant must match the plain-PyTorch layer; FP8 within FP8 noise."""
import torch

import te_parallel as te
from te_parallel.common.recipe import DelayedScaling, Format
from tests import te_tutorial_utils as utils
from tests.reference import rel_err


class BasicTransformerLayer(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, layernorm_eps=1e-5,
                 attention_dropout=0.1, hidden_dropout=0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = torch.nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.attention = utils.DotProductAttention(num_attention_heads=num_attention_heads,
                                                   kv_channels=self.kv_channels, attention_dropout=attention_dropout)
        self.projection = torch.nn.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = utils.BasicMLP(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)

    def forward(self, x, attention_mask):
        res = x
        x = self.ln1(x)
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)
        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln2(x)
        x = self.mlp(x)
        return x + res


class BasicTEMLP(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size):
        super().__init__()
        self.linear1 = te.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = te.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x):
        x = self.linear1(x)
        x = torch.nn.functional.gelu(x, approximate="tanh")
        return self.linear2(x)


class BasicTETransformerLayer(BasicTransformerLayer):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, layernorm_eps=1e-5,
                 attention_dropout=0.1, hidden_dropout=0.1):
        super().__init__(hidden_size, ffn_hidden_size, num_attention_heads, layernorm_eps, attention_dropout, hidden_dropout)
        self.ln1 = te.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = te.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.projection = te.Linear(hidden_size, hidden_size, bias=True)
        self.ln2 = te.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = BasicTEMLP(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)


class FusedTETransformerLayer(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, layernorm_eps=1e-5,
                 attention_dropout=0.1, hidden_dropout=0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln_qkv = te.LayerNormLinear(hidden_size, 3 * hidden_size, eps=layernorm_eps, bias=True)
        self.attention = utils.DotProductAttention(num_attention_heads=num_attention_heads,
                                                   kv_channels=self.kv_channels, attention_dropout=attention_dropout)
        self.projection = te.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln_mlp = te.LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_eps, bias=True)

    def forward(self, x, attention_mask):
        res = x
        qkv = self.ln_qkv(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)
        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln_mlp(x)
        return x + res


def test_te_tutorial(device):
    cuda = device == "cuda"
    hidden_size, sequence_length, batch_size = (4096, 2048, 4) if cuda else (128, 32, 2)
    ffn_hidden_size, num_attention_heads = (16384, 32) if cuda else (512, 4)
    dtype = torch.float16 if cuda else torch.float32
    x = torch.rand(sequence_length, batch_size, hidden_size).to(device=device, dtype=dtype)
    dy = torch.rand(sequence_length, batch_size, hidden_size).to(device=device, dtype=dtype)

    basic_transformer = BasicTransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads).to(dtype=dtype).to(device)
    basic_te = BasicTETransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads).to(dtype=dtype).to(device)
    utils.share_parameters_with_basic_te_model(basic_te, basic_transformer)
    fused_te = FusedTETransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads).to(dtype=dtype).to(device)
    utils.share_parameters_with_fused_te_model(fused_te, basic_transformer)
    te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads).to(dtype=dtype).to(device)
    utils.share_parameters_with_transformerlayer_te_model(te_transformer, basic_transformer)

    models = [basic_transformer, basic_te, fused_te, te_transformer]
    for m in models:  # the tutorial's timing loop (fwd+bwd), dropout on
        m.train()
        utils.speedometer(m, x, dy, forward_kwargs={"attention_mask": None}, timing_iters=2 if cuda else 1)
    fp8_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    utils.speedometer(te_transformer, x, dy, forward_kwargs={"attention_mask": None},
                      fp8_autocast_kwargs={"enabled": True, "fp8_recipe": fp8_recipe}, timing_iters=2 if cuda else 1)

    for m in models:
        m.eval()
    with torch.no_grad():
        ref = basic_transformer(x, attention_mask=None).double()
        tol = 2e-3 if cuda else 1e-5
        for m in models[1:]:
            assert rel_err(m(x, attention_mask=None), ref) < tol, type(m).__name__
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            y8 = te_transformer(x, attention_mask=None)
    assert y8.dtype == dtype and 0 < rel_err(y8, ref) < 5e-2
