"""The stand-in's modules: te_parallel's modules under TE's module paths, with TE 2.9's keywords and
behaviour (normalized_shape, attention masks TE ignores, delay_wgrad_compute / backward_dw, qk_norm_type,
context-parallel groups, activation recompute, the RNG tracker)."""
from tests.compat import stand_in

stand_in.require()

import pytest
import torch

import te_parallel
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import distributed as ted


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear, te.LayerNormMLP, te.LayerNorm, te.RMSNorm,
                                 te.DotProductAttention, te.MultiheadAttention, te.TransformerLayer])
def test_te_module_paths(cls):
    assert cls.__module__.startswith("transformer_engine.pytorch.")  # Lightning's "already converted" test
    assert issubclass(cls, getattr(te_parallel, cls.__name__))


@pytest.mark.parametrize("kwargs", [dict(normalized_shape=64), dict(normalized_shape=(64,)), dict(hidden_size=64)])
def test_norm_shape_keywords(kwargs):
    for cls in (te.LayerNorm, te.RMSNorm):
        m = cls(**kwargs, eps=1e-6, device="cpu", dtype=torch.float32)
        assert m.normalized_shape == (64,) and m.weight.shape == (64,)


def test_compat_linear_computes_what_te_parallel_computes():
    torch.manual_seed(0)
    a, b = te.Linear(32, 48, device="cpu"), te_parallel.Linear(32, 48, device="cpu")
    b.load_state_dict(te_parallel.from_te_state_dict(a.state_dict(), b))  # TE's layout -> te_parallel's
    x = torch.randn(8, 32)
    for _ in range(2):
        outs = []
        for m, autocast in ((a, te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4))),
                            (b, te_parallel.fp8_autocast(fp8_recipe=te_parallel.recipe.DelayedScaling(amax_history_len=4)))):
            with autocast:
                outs.append(m(x))
            outs[-1].sum().backward()
        assert torch.equal(outs[0], outs[1]) and torch.equal(a.weight.grad, b.weight.grad)
    assert a.fp8 and a.fp8_meta["recipe"].amax_history_len == 4


def test_te_only_keywords():
    with pytest.warns(UserWarning, match="symmetric_ar_type"):
        m = te.Linear(16, 16, device="cpu", symmetric_ar_type="multimem_all_reduce", save_original_input=True,
                      name="proj")
    assert m.save_original_input and m.name == "proj"
    with pytest.raises(NotImplementedError, match="fp8_output"):
        m(torch.randn(8, 16), fp8_output=True)


def test_delay_wgrad_compute():
    torch.manual_seed(0)
    ref, late = te.Linear(16, 32, device="cpu"), te.Linear(16, 32, device="cpu", delay_wgrad_compute=True)
    late.load_state_dict(ref.state_dict())
    x = torch.randn(8, 16, requires_grad=True)
    ref(x).square().sum().backward()
    dx = x.grad.clone()
    x.grad = None
    late(x).square().sum().backward()
    assert torch.equal(x.grad, dx)  # the data gradient is not delayed
    assert late.weight.grad is None or not late.weight.grad.any()
    late.backward_dw()
    assert torch.equal(late.weight.grad, ref.weight.grad) and torch.equal(late.bias.grad, ref.bias.grad)


def test_causal_attention_ignores_the_mask_as_te_does():
    dpa = te.DotProductAttention(4, 16, attn_mask_type="causal")
    q, k, v = (torch.randn(8, 2, 4, 16) for _ in range(3))
    garbage = torch.rand(2, 1, 8, 8) > 0.5
    assert torch.equal(dpa(q, k, v, attention_mask=garbage), dpa(q, k, v))
    assert torch.equal(dpa(q, k, v, garbage, attn_mask_type="no_mask"), dpa(q, k, v, attn_mask_type="no_mask"))


def test_attention_keywords():
    dpa = te.DotProductAttention(4, (16, 16), num_gqa_groups=2, attention_type="self", layer_number=1, softmax_scale=0.2)
    assert dpa.kv_channels == 16
    with pytest.raises(NotImplementedError, match="different key and value"):
        te.DotProductAttention(4, (16, 8))
    with pytest.raises(NotImplementedError, match="softmax_type"):
        te.DotProductAttention(4, 16, softmax_type="learnable")
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        dpa(*(torch.randn(8, 1, n, 16) for n in (4, 2, 2)), alibi_slopes=torch.ones(4))


def test_context_parallel_group_is_taken():
    """TE's set_context_parallel_group reaches te_parallel's attention: no group (or one rank) changes
    nothing; a comm type TE does not have is refused in one line (tests/distributed/test_context_parallel.py
    runs the groups)."""
    dpa = te.DotProductAttention(4, 16)
    q = torch.randn(8, 1, 4, 16)
    dpa.set_context_parallel_group(None, None, None)
    dpa(q, q, q)  # no group: runs
    assert dpa.cp_config is None
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        dpa.set_context_parallel_group(None, None, None, "ring")


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm", "L2Normalization"])
def test_qk_norm_type(kind):
    torch.manual_seed(0)
    layer = te.TransformerLayer(64, 128, 4, qk_norm_type=kind, qk_norm_eps=1e-6, hidden_dropout=0.0,
                                attention_dropout=0.0, device="cpu")
    attn = layer.self_attention
    seen = {}
    attn.core_attention.register_forward_pre_hook(lambda m, a: seen.update(q=a[0], k=a[1]))
    x = torch.randn(8, 2, 64, requires_grad=True)
    layer(x).sum().backward()
    rms = seen["q"].float().pow(2).mean(-1).sqrt()
    if kind == "L2Normalization":
        assert torch.allclose(seen["q"].float().norm(dim=-1), torch.ones_like(rms), atol=1e-4)
    else:
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-2)  # unit weight: normalized heads
        assert attn.q_norm.weight.grad is not None and attn.k_norm.weight.grad is not None
        assert "self_attention.q_norm.weight" in layer.state_dict()


def test_layernorm_mlp_checkpoint_recomputes_bit_identically():
    torch.manual_seed(0)
    a = te.LayerNormMLP(32, 64, activation="swiglu", device="cpu")
    b = te.LayerNormMLP(32, 64, activation="swiglu", device="cpu", checkpoint=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 2, 32)
    for m in (a, b):
        for _ in range(2):
            xi = x.clone().requires_grad_(True)
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
                out = m(xi)
            out.square().sum().backward()
        m.result = (out, xi.grad, m.fc1_weight.grad, m.fc2_weight.grad)
    assert all(torch.equal(p, q) for p, q in zip(a.result, b.result))


def test_activation_recompute_forward_replays_the_original_scales():
    torch.manual_seed(0)
    m = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    r = recipe.DelayedScaling(amax_history_len=4)
    with te.fp8_autocast(fp8_recipe=r):
        m(x)  # a first step: scales move off 1
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r), ted.activation_recompute_forward(True, False):
        original = m(x)
    assert ted.is_fp8_activation_recompute_enabled() is False
    with te.fp8_autocast(fp8_recipe=r), ted.activation_recompute_forward(True, True):
        assert ted.in_fp8_activation_recompute_phase()
        recomputed = m(x)  # the scales were updated at the region's exit above; the recompute uses the old ones
    assert torch.equal(original, recomputed)


def test_rng_tracker_on_cpu():
    tracker = ted.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    assert "model-parallel-rng" in ted.get_all_rng_states()
    with tracker.fork():
        a = torch.rand(4)
    tracker2 = ted.CudaRNGStatesTracker()
    tracker2.add("model-parallel-rng", 1234)
    with tracker2.fork():
        b = torch.rand(4)
    assert torch.equal(a, b)
    y = ted.checkpoint(lambda t: t.sin(), torch.randn(3, requires_grad=True), distribute_saved_activations=False,
                       get_rng_state_tracker=lambda: tracker, tp_group=None)
    y.sum().backward()
