"""Attention on CUDA: the CPU suites again (fp32, device="cuda"), then every fused backend in bf16/fp16
against the fp64 reference, outputs and the gradients of q, k, v, and the kernel `auto` picks.

Tolerance (flash-attention's rule): a kernel's error against fp64 is within 2x (+ a small floor) the
error of the same computation done by PyTorch in the kernel's precision (`attention_reference` on the
bf16/fp16 inputs: fp32 scores and softmax, bf16/fp16 probabilities times v).
"""
import os
import subprocess
import sys

import pytest
import torch

import te_parallel as te
from te_parallel.ops import attention_cudnn_fe as cudnn_fe
from te_parallel.ops.attention import attention_reference
from tests.attention_reference import padding_masked, ref_attention, ref_thd, te_mask
from tests.reference import rel_err
from tests.test_attention import *  # noqa: F401,F403
from tests.test_attention_thd import *  # noqa: F401,F403

LENGTHS = (37, 0, 1, 128, 64, 5)  # with an empty and a one-token sequence


@pytest.fixture
def sm90(device):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"needs sm_90+ (cuDNN fused attention), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    return device


@pytest.fixture
def fe(sm90):
    if not cudnn_fe.available():
        pytest.skip("needs the cuDNN frontend: pip install nvidia-cudnn-frontend (te_parallel[cudnn])")
    return sm90


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def _rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(True)


def _errors(out, grads, ref_fn, inputs, dy):
    """Relative errors against ref_fn in fp64 (on the CPU) of (out, *grads), and of ref_fn itself run in
    the inputs' dtype on the GPU (PyTorch at the same precision, flash-attention's yardstick)."""
    refs = []
    for dtype, dev in ((torch.float64, "cpu"), (inputs[0].dtype, "cuda")):
        xs = [t.detach().to(dev, dtype).requires_grad_(True) for t in inputs]
        ref = ref_fn(*xs)
        ref.backward(dy.to(dev, dtype))
        refs.append([ref.detach().double().cpu()] + [x.grad.double().cpu() for x in xs])
    exact, same_precision = refs
    kernel = [out.double().cpu()] + [g.double().cpu() for g in grads]
    return ([rel_err(k, e) for k, e in zip(kernel, exact)],
            [rel_err(p, e) for p, e in zip(same_precision, exact)])


def _assert_close(out, inputs, ref_fn, dy, what):
    """Within 2x PyTorch's own error at the inputs' precision (plus a floor of a tenth of bf16's unit
    roundoff, for where that error is tiny)."""
    grads = [t.grad for t in inputs]
    (kernel, same_precision) = _errors(out.detach(), grads, ref_fn, inputs, dy)
    for name, err, err_pt in zip(("out", "dq", "dk", "dv"), kernel, same_precision):
        assert err <= 2 * err_pt + 2e-4, f"{what} {name}: {err:.2e} vs PyTorch same-precision {err_pt:.2e}"


def _packed_ref(cu_q, cu_kv, mask_type, win, scale=None):
    def fn(q, k, v):
        if q.dtype == torch.float64:
            return ref_thd(q, k, v, cu_q.cpu(), cu_kv.cpu(), mask_type, win, scale)
        # same precision: each sequence through attention_reference in bf16/fp16
        outs, cq, ck = [], cu_q.tolist(), cu_kv.tolist()
        for i in range(len(cq) - 1):
            qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]))
            if qs.shape[2] == 0:
                continue
            masked = te_mask(qs.shape[2], ks.shape[2], mask_type, win).cuda()
            o = attention_reference(qs, ks, vs, masked, scale or qs.shape[-1] ** -0.5) if ks.shape[2] else qs * 0
            outs.append(o.squeeze(0).transpose(0, 1).flatten(1))
        return torch.cat(outs)
    return fn


def _run_thd(backend, lengths_q, lengths_kv, groups, mask_type, win=None, dtype=torch.bfloat16, h=8, d=128):
    dpa = te.DotProductAttention(h, d, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask_type, window_size=win,
                                 backend=backend, attention_type="self" if lengths_q == lengths_kv else "cross")
    cu_q = _cu(lengths_q)
    cu_kv = cu_q if lengths_kv == lengths_q else _cu(lengths_kv)
    q = _rand(sum(lengths_q), h, d, dtype=dtype)
    k, v = _rand(sum(lengths_kv), groups, d, dtype=dtype), _rand(sum(lengths_kv), groups, d, dtype=dtype)
    out = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    dy = torch.randn_like(out)
    out.backward(dy)
    _assert_close(out, [q, k, v], _packed_ref(cu_q, cu_kv, mask_type, win), dy, f"{backend} {mask_type} {win}")
    return dpa, out


# -- dense: SDPA cuDNN and flash with native GQA -----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash"])
@pytest.mark.parametrize("groups", [8, 2, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gqa_causal(backend, groups, dtype, sm90):
    """SDPA's cuDNN (auto's choice on sm_90+) and flash kernels with fewer KV heads, no repeated K/V."""
    h, d, s, b = 8, 128, 256, 2
    dpa = te.DotProductAttention(h, d, num_gqa_groups=groups, attn_mask_type="causal", qkv_format="bshd", backend=backend)
    q, k, v = _rand(b, s, h, d, dtype=dtype), _rand(b, s, groups, d, dtype=dtype), _rand(b, s, groups, d, dtype=dtype)
    out = dpa(q, k, v)
    assert dpa.last_backend == (("cudnn_fe" if cudnn_fe.available() else "cudnn") if backend == "auto" else backend)
    dy = torch.randn_like(out)
    out.backward(dy)

    def ref(q_, k_, v_):
        if q_.dtype == torch.float64:
            return ref_attention(*(t.transpose(0, 1) for t in (q_, k_, v_)), te_mask(s, s, "causal")).transpose(0, 1)
        o = attention_reference(*(t.transpose(1, 2) for t in (q_, k_, v_)), None, d ** -0.5, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, h * d)
    _assert_close(out, [q, k, v], ref, dy, backend)


def test_llama_shape_runs_on_cudnn(sm90):
    """b1 s4096 32 heads / 8 KV groups d128 causal bf16 (the Llama-3-8B layer's attention)."""
    dpa = te.DotProductAttention(32, 128, num_gqa_groups=8, attn_mask_type="causal")
    q = torch.randn(4096, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4096, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dpa(q, k, v)
    assert dpa.last_backend == ("cudnn_fe" if cudnn_fe.available() else "cudnn")


# -- dense through the cuDNN frontend ---------------------------------------------------------------

def _dense(fmt, s, b, n, d, dtype=torch.bfloat16):
    return _rand(*((s, b) if fmt == "sbhd" else (b, s)), n, d, dtype=dtype)


def _sbhd(t, fmt):
    return t if fmt == "sbhd" else t.transpose(0, 1)


DENSE_FE = [  # fmt, heads, groups, s_q, s_kv, mask type, window
    ("sbhd", 8, 8, 256, 256, "causal", None),           # GPT: MHA, causal
    ("bshd", 8, 2, 256, 256, "causal", None),           # GQA
    ("sbhd", 8, 1, 200, 200, "no_mask", None),          # MQA, a length off the 64 grid
    ("bshd", 8, 2, 128, 256, "causal", None),           # top-left diagonal, s_q < s_kv
    ("sbhd", 8, 2, 128, 256, "causal_bottom_right", None),
    ("sbhd", 8, 8, 256, 256, "causal", (64, 0)),        # sliding window
    ("bshd", 4, 4, 96, 160, "no_mask", (32, 16)),       # a two-sided window, bottom-right
]


@pytest.mark.parametrize("case", DENSE_FE, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_fe_dense(case, dtype, fe):
    """Dense bshd/sbhd on the frontend's graphs (auto's choice on sm_90+): outputs and gradients against fp64."""
    fmt, h, g, sq, skv, mask_type, win = case
    d, b = 64, 2
    dpa = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type=mask_type, window_size=win, qkv_format=fmt,
                                 attention_type="self" if sq == skv else "cross")
    q, k, v = _dense(fmt, sq, b, h, d, dtype), _dense(fmt, skv, b, g, d, dtype), _dense(fmt, skv, b, g, d, dtype)
    out = dpa(q, k, v)
    assert dpa.last_backend == "cudnn_fe"
    dy = torch.randn_like(out)
    out.backward(dy)
    masked = te_mask(sq, skv, mask_type, win)

    def ref(q_, k_, v_):
        if q_.dtype == torch.float64:
            return _sbhd(ref_attention(*(_sbhd(t, fmt) for t in (q_, k_, v_)), masked), fmt)
        bhsd = [t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.transpose(1, 2) for t in (q_, k_, v_)]
        o = attention_reference(*bhsd, masked.cuda(), d ** -0.5)
        o = o.permute(2, 0, 1, 3) if fmt == "sbhd" else o.transpose(1, 2)
        return o.reshape(*o.shape[:2], -1)
    _assert_close(out, [q, k, v], ref, dy, f"cudnn_fe dense {case}")


def _views(interleaved, s, b, h, d):
    if interleaved:  # Megatron's per-head [q k v] blocks
        return lambda m: m.view(s, b, h, 3, d).unbind(-2)
    return lambda m: tuple(t.view(s, b, h, d) for t in m.split(h * d, dim=-1))


@pytest.mark.parametrize("interleaved", [True, False])
def test_cudnn_fe_writes_fused_qkv_gradient_in_place(interleaved, fe):
    """q, k, v split from one projection output: the backward writes dq, dk, dv into one tensor, which is
    the projection output's gradient with no join; equal to attention on separate copies."""
    from te_parallel.ops.attention_dispatch import split_views
    s, b, h, d = 128, 2, 8, 64
    views = _views(interleaved, s, b, h, d)
    mixed = torch.randn(s, b, 3 * h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    joined = []
    q, k, v = split_views(mixed, views, lambda *g: joined.append(g) or torch.cat([t.reshape(s, b, -1) for t in g], -1))
    dpa = te.DotProductAttention(h, d, attn_mask_type="causal")
    out = dpa(q, k, v)
    assert dpa.last_backend == "cudnn_fe"
    dy = torch.randn_like(out)
    out.backward(dy)
    assert joined == []
    copies = [t.detach().clone().requires_grad_(True) for t in views(mixed.detach())]
    ref = dpa(*copies)
    ref.backward(dy)
    assert torch.equal(out, ref)
    for got, want in zip(views(mixed.grad), copies):
        assert torch.equal(got, want.grad)


def test_mha_gpt_backward_has_no_qkv_join(fe):
    """A GPT-style MultiheadAttention (fused interleaved QKV, MHA, causal): no concatenation of the q/k/v
    gradients in its backward, and the same output and gradients as with SDPA's cuDNN kernels."""
    kw = dict(hidden_size=512, num_attention_heads=8, attention_dropout=0.0, input_layernorm=True, fuse_qkv_params=True,
              attn_mask_type="causal", params_dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(0)
    fe_mha = te.MultiheadAttention(**kw)
    sdpa = te.MultiheadAttention(**kw, attention_backend="cudnn")
    sdpa.load_state_dict(fe_mha.state_dict())
    x = torch.randn(256, 2, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out = fe_mha(x)
    dy = torch.randn_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(dy)
    ops = {e.name for e in prof.events()}
    assert fe_mha.core_attention.last_backend == "cudnn_fe"
    assert not ops & {"aten::cat", "aten::stack"}, sorted(ops & {"aten::cat", "aten::stack"})
    ref = sdpa(x2)
    ref.backward(dy)
    assert rel_err(out.float(), ref.float()) < 1e-2 and rel_err(x.grad.float(), x2.grad.float()) < 1e-2
    for (name, p1), p2 in zip(fe_mha.named_parameters(), sdpa.parameters()):
        assert rel_err(p1.grad.float(), p2.grad.float()) < 1e-2, name


def test_cudnn_fe_program_exits_quietly(fe, tmp_path):
    """A program that ran frontend attention in eager and CUDA-graphed FP8 Llama layers (the layer benchmark
    with its --graph rows, small sizes) exits with status 0 and without the bindings' report of objects
    still alive at teardown ("nanobind: leaked ..."; 44 lines of it when the frontend's cache is not
    dropped at exit)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "bench_transformer.py"), "--model", "llama", "--graph",
           "--seq", "256", "--hidden", "512", "--ffn", "1024", "--heads", "8", "--json", str(tmp_path / "rows.json")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CUDA graph" in run.stdout, run.stdout[-2000:]
    assert "leaked" not in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("fmt, groups", [("sbhd", 8), ("bshd", 2)])
def test_cudnn_fe_dense_dropout_against_its_mask(fmt, groups, fe):
    """Attention dropout on cuDNN's Philox generator: the output and gradients equal the fp64 reference
    with the mask cuDNN dumps for the same seed; the seed comes from torch's generator."""
    from te_parallel.ops.attention import Band
    h, d, s, b, p = 8, 64, 256, 2, 0.25
    dpa = te.DotProductAttention(h, d, num_gqa_groups=groups, attention_dropout=p, qkv_format=fmt, attn_mask_type="causal")
    q, k, v = _dense(fmt, s, b, h, d), _dense(fmt, s, b, groups, d), _dense(fmt, s, b, groups, d)
    torch.cuda.manual_seed(1234)
    out = dpa(q, k, v)
    assert dpa.last_backend == "cudnn_fe"
    dy = torch.randn_like(out)
    out.backward(dy)
    torch.cuda.manual_seed(1234)
    seed = cudnn_fe.dropout_seed(q.device)
    key = cudnn_fe.dense_key(q, k, v, fmt == "sbhd", Band(False, -1, 0), d ** -0.5, p, shared=False)
    causal = te_mask(s, s, "causal")
    keep = cudnn_fe.dropout_mask(key, q, k, v, seed).double().cpu().masked_fill(causal, 0.0)  # (not written above the diagonal)
    seen = keep[..., ~causal]
    assert set(seen.unique().tolist()) == {0.0, 1.0} and abs(seen.mean().item() - (1 - p)) < 0.01
    xs = [_sbhd(t.detach().double().cpu(), fmt).requires_grad_(True) for t in (q, k, v)]
    ref = ref_attention(*xs, causal, keep=keep, dropout=p)
    ref.backward(_sbhd(dy.double().cpu(), fmt))
    assert rel_err(_sbhd(out.double().cpu(), fmt), ref) < 1e-2
    for t, x in zip((q, k, v), xs):
        assert rel_err(_sbhd(t.grad.double().cpu(), fmt), x.grad) < 2e-2
    # another draw, another mask; eval mode, none
    assert not torch.equal(dpa(q, k, v), out)
    dpa.eval()
    torch.testing.assert_close(dpa(q, k, v), te.DotProductAttention(h, d, num_gqa_groups=groups, qkv_format=fmt)(q, k, v))


def test_cudnn_fe_packed_dropout_against_its_mask(fe):
    """Dropout on packed sequences (auto: cuDNN frontend): each sequence against the fp64 reference with its
    block of the dumped mask."""
    from te_parallel.ops.attention import Band
    h, d, p = 4, 64, 0.2
    dpa = te.DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal", attention_dropout=p)
    cu = _cu(LENGTHS)
    q, k, v = (_rand(sum(LENGTHS), h, d, dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.manual_seed(99)
    out = dpa(q, k, v, cu_seqlens_q=cu, max_seqlen_q=128)
    assert dpa.last_backend == "cudnn_fe"
    dy = torch.randn_like(out)
    out.backward(dy)
    torch.cuda.manual_seed(99)
    seed = cudnn_fe.dropout_seed(q.device)
    key = cudnn_fe.graph_key(q, k, v, len(LENGTHS), 128, 128, Band(False, -1, 0), d ** -0.5, p)
    keep = cudnn_fe.dropout_mask(key, q, k, v, seed, cu, cu).double().cpu()
    xs = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    outs, c = [], cu.tolist()
    for i, n in enumerate(LENGTHS):
        if n:
            seq = [x[c[i]:c[i + 1]].unsqueeze(1) for x in xs]
            outs.append(ref_attention(*seq, te_mask(n, n, "causal"), keep=keep[i:i + 1, :, :n, :n], dropout=p).squeeze(1))
    ref = torch.cat(outs)
    ref.backward(dy.double().cpu())
    assert rel_err(out.double().cpu(), ref) < 1e-2
    for t, x in zip((q, k, v), xs):
        assert rel_err(t.grad.double().cpu(), x.grad) < 2e-2


# -- packed sequences: flash_varlen and cudnn_fe ----------------------------------------------------

@pytest.mark.parametrize("mask_type, win", [("padding_causal", None), ("padding", None), ("padding_causal", (32, 0)),
                                            ("padding", (16, 16)), ("padding_causal_bottom_right", (8, 0))])
@pytest.mark.parametrize("groups", [8, 2, 1])
def test_flash_varlen_thd(mask_type, win, groups, device):
    dpa, _ = _run_thd("flash_varlen", LENGTHS, LENGTHS, groups, mask_type, win)
    assert dpa.last_backend == "flash_varlen"


@pytest.mark.parametrize("mask_type, win", [("padding_causal", None), ("padding", None), ("padding_causal", (32, 0)),
                                            ("padding", (16, 16)), ("padding_causal_bottom_right", (8, 0))])
@pytest.mark.parametrize("groups", [8, 2, 1])
def test_cudnn_fe_thd(mask_type, win, groups, fe):
    dpa, _ = _run_thd("cudnn_fe", LENGTHS, LENGTHS, groups, mask_type, win)
    assert dpa.last_backend == "cudnn_fe"


@pytest.mark.parametrize("backend, mask_type", [("flash_varlen", "padding_causal_bottom_right"), ("flash_varlen", "padding"),
                                                ("cudnn_fe", "padding_causal"), ("cudnn_fe", "padding_causal_bottom_right")])
def test_varlen_cross_attention(backend, mask_type, device):
    """Different lengths per sequence, including a query with no keys (zeros) and keys with no query."""
    if backend == "cudnn_fe" and (torch.cuda.get_device_capability() < (9, 0) or not cudnn_fe.available()):
        pytest.skip("needs sm_90+ and the cuDNN frontend")
    lq, lkv = (48, 0, 16, 7, 1), (64, 9, 0, 30, 1)
    _, out = _run_thd(backend, lq, lkv, 2, mask_type)
    empty = out[48 + 0: 48 + 16].detach().float()  # the queries of the sequence with no keys
    assert torch.all(empty == 0), (f"{backend} {mask_type}: queries without keys are not zero: "
                                   f"{int((empty != 0).sum())} nonzero, {int(empty.isnan().sum())} NaN")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_backends_fp16_and_head_dim_64(dtype, device):
    _run_thd("flash_varlen", LENGTHS, LENGTHS, 2, "padding_causal", dtype=dtype, d=64)
    if torch.cuda.get_device_capability() >= (9, 0) and cudnn_fe.available():
        _run_thd("cudnn_fe", LENGTHS, LENGTHS, 2, "padding_causal", dtype=dtype, d=64)


def test_auto_picks_for_packed_and_window(device):
    fe_ok = torch.cuda.get_device_capability() >= (9, 0) and cudnn_fe.available()
    varlen = "cudnn_fe" if fe_ok else "flash_varlen"
    dpa, _ = _run_thd("auto", LENGTHS, LENGTHS, 2, "padding_causal")
    assert dpa.last_backend == varlen
    dpa, _ = _run_thd("auto", LENGTHS, LENGTHS, 2, "padding_causal", win=(16, 0))
    assert dpa.last_backend == varlen
    dense = te.DotProductAttention(8, 128, num_gqa_groups=2, attn_mask_type="causal", window_size=(64, 0))
    q = torch.randn(256, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(256, 2, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = dense(q, k, k)
    assert dense.last_backend == varlen
    ref = ref_attention(q.double(), k.double(), k.double(), te_mask(256, 256, "causal", (64, 0)).cuda())
    assert rel_err(out.float(), ref) < 2e-2


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("backend", ["auto", "flash_varlen"])
def test_padding_mask_unpads_to_varlen(fmt, backend, device):
    """bshd/sbhd + padding mask [b, 1, 1, s] reaches a varlen kernel; padded query rows are zero."""
    b, s, h, g, d = 3, 96, 8, 2, 128
    lengths = torch.tensor([96, 0, 33])
    pad = torch.arange(s).view(1, s) >= lengths.view(b, 1)
    dpa = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="padding_causal", qkv_format=fmt, backend=backend)
    shape = (lambda n: (b, s, n, d)) if fmt == "bshd" else (lambda n: (s, b, n, d))
    q, k, v = _rand(*shape(h), dtype=torch.bfloat16), _rand(*shape(g), dtype=torch.bfloat16), _rand(*shape(g), dtype=torch.bfloat16)
    out = dpa(q, k, v, attention_mask=pad.view(b, 1, 1, s).cuda())
    assert dpa.last_backend in ("cudnn_fe", "flash_varlen")
    out.backward(torch.ones_like(out))
    to_sbhd = (lambda t: t.transpose(0, 1)) if fmt == "bshd" else (lambda t: t)
    masked = (padding_masked(pad, pad) | te_mask(s, s, "causal")).cuda()
    ref = ref_attention(*(to_sbhd(t.detach().double()) for t in (q, k, v)), masked)
    assert rel_err(to_sbhd(out).float(), ref) < 2e-2
    rows = pad.cuda() if fmt == "bshd" else pad.t().cuda()
    assert torch.all(out[rows] == 0)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("backend", ["flash_varlen", "cudnn_fe"])
def test_varlen_dropout_is_reproducible(backend, device):
    """Dropout on packed sequences; same seed, same output and gradients."""
    if backend == "cudnn_fe" and (torch.cuda.get_device_capability() < (9, 0) or not cudnn_fe.available()):
        pytest.skip("needs sm_90+ and the cuDNN frontend")
    dpa = te.DotProductAttention(8, 64, qkv_format="thd", attn_mask_type="padding_causal", attention_dropout=0.2,
                                 backend=backend)
    cu = _cu(LENGTHS)
    q = _rand(sum(LENGTHS), 8, 64, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        q.grad = None
        out = dpa(q, q, q, cu_seqlens_q=cu)
        out.float().pow(2).sum().backward()
        runs.append((out.detach(), q.grad.clone()))
    assert dpa.last_backend == backend
    # the same mask both times: outputs equal bit for bit, gradients up to the kernels' atomic dq accumulation
    assert torch.equal(runs[0][0], runs[1][0]) and rel_err(runs[0][1].float(), runs[1][1].float()) < 1e-2
    assert torch.isfinite(runs[0][1]).all()
    dpa.eval()
    assert not torch.equal(dpa(q, q, q, cu_seqlens_q=cu), runs[0][0])


def test_cudnn_fe_graphs_are_cached_by_bucket(fe):
    dpa = te.DotProductAttention(8, 128, qkv_format="thd", attn_mask_type="padding_causal", backend="cudnn_fe")
    for lengths in ((100, 28), (90, 38), (127, 1)):  # one bucket: batch 2, longest <= 128, 128 tokens
        q = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dpa(q, q, q, cu_seqlens_q=_cu(lengths), max_seqlen_q=128).sum().backward()
        if lengths == (100, 28):
            built = len(cudnn_fe._graphs)
    assert len(cudnn_fe._graphs) == built


def test_explicit_dense_backend_refuses_packed(device):
    dpa = te.DotProductAttention(8, 128, qkv_format="thd", backend="flash")
    q = torch.randn(10, 8, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend='flash' cannot run this input.*it needs a dense input"):
        dpa(q, q, q, cu_seqlens_q=_cu((4, 6)))


def test_mha_thd_bf16_matches_sequences_one_by_one(device):
    kw = dict(hidden_size=512, num_attention_heads=4, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True,
              attn_mask_type="causal", params_dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(0)
    thd = te.MultiheadAttention(**kw, qkv_format="thd")
    torch.manual_seed(0)
    bshd = te.MultiheadAttention(**kw, qkv_format="bshd")
    bshd.load_state_dict(thd.state_dict())
    x = torch.randn(sum(LENGTHS), 512, device="cuda", dtype=torch.bfloat16)
    out = thd(x, cu_seqlens_q=_cu(LENGTHS), cu_seqlens_kv=_cu(LENGTHS), max_seqlen_q=128, max_seqlen_kv=128)
    assert thd.core_attention.last_backend in ("cudnn_fe", "flash_varlen")
    ref, start = [], 0
    for n in LENGTHS:
        if n:
            ref.append(bshd(x[start:start + n].unsqueeze(0)).squeeze(0))
        start += n
    assert rel_err(out.float(), torch.cat(ref).float()) < 2e-2


def test_cudnn_fe_dropout_replays_under_recompute(fe):
    """te.checkpoint recomputes a bf16 layer whose attention dropout runs on the frontend's graphs: the
    recomputed forward draws the same seed (the generator is restored), so outputs are equal bit for bit
    and gradients up to cuDNN's atomic dq accumulation (another mask would move them by far more)."""
    from te_parallel.parallel.random import CudaRNGStatesTracker, model_parallel_seed

    def run(use_checkpoint):
        torch.manual_seed(0)
        tracker = CudaRNGStatesTracker(device="cuda")
        model_parallel_seed(tracker, 0, tp_rank=0)
        layer = te.TransformerLayer(256, 512, 4, hidden_dropout=0.0, attention_dropout=0.3, fuse_qkv_params=True,
                                    params_dtype=torch.bfloat16, device="cuda", get_rng_state_tracker=lambda: tracker)
        x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = te.checkpoint(layer, x, get_rng_state_tracker=lambda: tracker) if use_checkpoint else layer(x)
        y.backward(torch.ones_like(y))
        assert layer.self_attention.core_attention.last_backend == "cudnn_fe"
        return y.detach(), x.grad, [p.grad for p in layer.parameters()]

    (y, dx, grads), (y2, dx2, grads2) = run(False), run(True)
    assert torch.equal(y, y2)
    assert rel_err(dx2.float(), dx.float()) < 2e-2
    assert all(rel_err(b.float(), a.float()) < 2e-2 for a, b in zip(grads, grads2))
