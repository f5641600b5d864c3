"""The torch custom ops' CUDA kernels (csrc/torch_ops) against their CPU kernels (the references, checked
against fp64 in tests/test_torch_ops.py): the same FP8 bytes, scale_inv and amax bit for bit, the GEMM
within fp32-accumulation error; torch.library.opcheck on CUDA; te.Linear's forward through the fused op,
bit-identical to the separate cast and GEMM; the ops under CUDA-graph capture."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.native import torch_ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def ops(device):
    if not torch_ops.usable():
        pytest.skip("te_parallel._C was built without the torch ops (torch's headers not found at build time)")
    return device


def _on(t, device):
    return None if t is None else t.to(device)


def _bytes(t):
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["delayed", "current", "delayed_no_amax", "t_only_e5m2"])
@pytest.mark.parametrize("shape", [(64, 128), (17, 33), (1, 4096), (4096, 16)])
def test_cast_equals_cpu_kernel(ops, dtype, mode, shape):
    torch.manual_seed(hash((mode, shape)) % 2**31)
    x = (torch.randn(*shape) * 10).to(dtype)
    scale = None if mode == "current" else torch.tensor(3.7)
    amax = None if mode == "delayed_no_amax" else torch.full((1,), 0.5)
    fp8 = E5M2 if mode == "t_only_e5m2" else E4M3
    rowwise = mode != "t_only_e5m2"
    amax_gpu = _on(amax, "cuda")
    got = torch_ops.cast_fp8(x.cuda(), _on(scale, "cuda"), amax_gpu, fp8, rowwise, True, mode == "delayed")
    want = torch_ops.cast_fp8(x, scale, amax, fp8, rowwise, True, mode == "delayed")
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(_bytes(g).cpu(), _bytes(w))
    if amax is not None:
        assert torch.equal(amax_gpu.cpu(), amax)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mnk", [(16, 16, 16), (128, 256, 512), (2048, 768, 3072)])
def test_gemm_close_to_cpu_kernel(ops, out_dtype, mnk):
    m, n, k = mnk
    a, b = (torch.randn(m, k) * 2).to(E4M3), (torch.randn(n, k) * 2).to(E5M2)
    sa, sb = torch.tensor(0.5), torch.tensor(0.125)
    bias = torch.randn(n, dtype=out_dtype) if out_dtype != torch.float32 else None
    acc = torch.randn(m, n, dtype=out_dtype)
    got = torch_ops.fp8_gemm(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), out_dtype, _on(bias, "cuda"), acc.cuda())
    want = torch_ops.fp8_gemm(a, sa, b, sb, out_dtype, bias, acc)
    # Hopper's FP8 tensor cores keep about 14 mantissa bits in their partial sums (measured: 6e-5 relative
    # at k=16 with an fp32 output), so the bound is 2⁻¹²·Σ|a·b| plus the output's rounding
    terms = (a.double().abs() @ b.double().abs().t()) * (sa * sb).item()
    bound = 2.0**-12 * terms + torch.finfo(out_dtype).eps * want.double().abs()
    assert ((got.cpu().double() - want.double()).abs() <= 2 * bound).all()


def test_opcheck_cuda(ops):
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(32, 128, device="cuda") * 2).to(E4M3)
    one = torch.ones((), device="cuda")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.te_parallel.cast_fp8.default, (x, one * 2, torch.zeros(1, device="cuda"), E4M3,
                                                                     True, True, True))
    torch.library.opcheck(torch.ops.te_parallel.fp8_gemm.default, (x.to(E4M3), one, w, one, torch.bfloat16, None, None,
                                                                     False), test_utils=utils)
    torch.library.opcheck(torch.ops.te_parallel.linear_fp8_fwd.default,
                          (x, None, None, E4M3, True, w, one, torch.zeros(32, device="cuda", dtype=torch.bfloat16),
                           True), test_utils=utils)


def test_bad_cuda_input_is_one_line(ops):
    x = torch.randn(64, 128, device="cuda").t()  # not contiguous
    with pytest.raises(RuntimeError, match="te_parallel::cast_fp8: need a contiguous") as err:
        torch_ops.cast_fp8(x, None, None, E4M3, True, False, False)
    assert "\n" not in str(err.value).strip()


@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_takes_fused_op_bit_identical(ops, recipe, bias, monkeypatch):
    """te.Linear's FP8 forward goes through linear_fp8_fwd, and gives the bytes of the separate cast and
    GEMM: outputs, input/weight gradients and the scaling state after three steps."""
    torch.manual_seed(0)
    mods = [te.Linear(256, 512, bias=bias, params_dtype=torch.bfloat16) for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    calls = []
    real = torch_ops.linear_fp8_fwd

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    results = []
    for fused, m in zip((True, False), mods):
        monkeypatch.setattr(torch_ops, "linear_fp8_fwd", spy)
        if not fused:
            monkeypatch.setattr(torch_ops, "linear_usable", lambda *a: False)
            monkeypatch.setattr(te.Linear, "_fp8_one_call", lambda *a: None)
        torch.manual_seed(1)
        outs = []
        for _ in range(3):
            x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with te.fp8_autocast(fp8_recipe=recipe):
                y = m(x)
            y.backward(torch.randn_like(y))
            outs += [y.detach(), x.grad, m.weight.grad.clone()]
            m.zero_grad(set_to_none=True)
        outs += [b.clone() for b in m.fp8_state.buffers()]
        results.append(outs)
        monkeypatch.undo()
    assert len(calls) == 3
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("case", ["bias_2d", "nobias_3d", "microbatch", "fp16", "frozen_weight"])
def test_linear_one_call_bit_identical(ops, recipe, case, monkeypatch):
    """te.Linear's one-call FP8 forward (Linear._fp8_one_call: one rank, the fused op, none of the general
    path's plumbing) gives the bytes of the general path: outputs, input/weight/bias gradients, the FP8
    scaling state and the weight cache over three steps, then a no_grad forward. With TE's micro-batch flag
    the weight is cast on the first step and reused after; with a frozen weight it is cast once and kept."""
    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    bias = case != "nobias_3d"
    shape = (32, 4, 256) if case == "nobias_3d" else (128, 256)
    flags = [True, False, False] if case == "microbatch" else [None] * 3
    torch.manual_seed(0)
    mods = [te.Linear(256, 512, bias=bias, params_dtype=dtype) for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    if case == "frozen_weight":
        for m in mods:
            m.weight.requires_grad_(False)
    original = te.Linear._fp8_one_call
    taken = []

    def spy(self, *args):
        out = original(self, *args)
        taken.append(out is not None)
        return out

    results = []
    for one_call, m in zip((True, False), mods):
        monkeypatch.setattr(te.Linear, "_fp8_one_call", spy if one_call else (lambda *a: None))
        torch.manual_seed(1)
        outs = []
        for flag in flags:
            x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
            with te.fp8_autocast(fp8_recipe=recipe):
                y = m(x, is_first_microbatch=flag)
            y.backward(torch.randn_like(y))
            outs += [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters() if p.requires_grad]
            m.zero_grad(set_to_none=True)
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe):
            outs.append(m(torch.randn(*shape, device="cuda", dtype=dtype)))
        outs += [b.clone() for b in m.fp8_state.buffers()]
        outs += [q.data.view(torch.uint8) for _, q in m._weight_cache.values()]
        results.append(outs)
        monkeypatch.undo()
    # the first forward checks the module (general path); every later one takes the one call
    assert taken == [False, True, True, True], taken
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        assert a.shape == b.shape and torch.equal(a, b)


def test_linear_one_call_leaves_other_cases(ops, monkeypatch):
    """The cases the one call does not take run the general path, unchanged: tokens not a multiple of 16,
    an input of another dtype than the weight, a returned bias, a recipe below its FP8 size threshold."""
    lin = te.Linear(256, 256, params_dtype=torch.bfloat16)
    ref = te.Linear(256, 256, params_dtype=torch.bfloat16, return_bias=True)
    original, taken = te.Linear._fp8_one_call, []
    monkeypatch.setattr(te.Linear, "_fp8_one_call", lambda self, *a: taken.append(original(self, *a)) or taken[-1])
    rec = R.DelayedScaling()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    with te.fp8_autocast(fp8_recipe=rec):
        lin(x), ref(x)  # first calls: the module checks
        taken.clear()
        assert lin(x[:24]).shape == (24, 256)
        assert lin(x.float()).dtype == torch.bfloat16
        assert ref(x)[0].shape == (32, 256)
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling(min_fp8_gemm=10**12)):
        lin(x)
    assert taken == [None] * 4
    with te.fp8_autocast(fp8_recipe=rec):
        assert lin(x) is not None and taken[-1] is not None


def test_ops_capture_in_cuda_graph(ops):
    """The ops allocate from torch's caching allocator on the current stream: capturable, and a replay
    recomputes with the inputs' new values."""
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(32, 128, device="cuda") * 2).to(E4M3)
    scale, amax, one = torch.full((), 4.0, device="cuda"), torch.zeros(1, device="cuda"), torch.ones((), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.te_parallel.linear_fp8_fwd(x, scale, amax, E4M3, True, w, one, None, False)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.te_parallel.linear_fp8_fwd(x, scale, amax, E4M3, True, w, one, None, False)[0]
    x.copy_(torch.randn_like(x) * 3)
    amax.zero_()
    graph.replay()
    want_amax = torch.zeros(1, device="cuda")
    want = torch_ops.linear_fp8_fwd(x, scale, want_amax, E4M3, True, w, one, None, False)[0]
    torch.cuda.synchronize()
    assert torch.equal(y, want) and torch.equal(amax, want_amax)


def test_refused_linear_launches_nothing(ops):
    """A weight the GEMM cannot take is refused before the cast runs: the amax cell is left as it was."""
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(24, 128, device="cuda").to(E4M3)  # 24 output features: not a multiple of 16
    amax, one = torch.full((1,), 0.5, device="cuda"), torch.ones((), device="cuda")
    with pytest.raises(RuntimeError, match=r"te_parallel::linear_fp8_fwd: need FP8 a \[m, k\].*b of 2 dims \[24, 128\]"):
        torch_ops.linear_fp8_fwd(x, one, amax, E4M3, True, w, one, None, False)
    torch.cuda.synchronize()
    assert amax.item() == 0.5


@pytest.mark.parametrize("mode", ["delayed", "delayed_t_only", "current", "weight"])
def test_quantize_takes_cast_op_bit_identical(ops, mode, monkeypatch):
    """ops.cast.quantize / quantize_current without a dbias go through te_parallel::cast_fp8 (one call;
    the pybind11 wrapper is not reached) and give the pybind11 path's bytes, scale_inv, amax and scale
    snapshot."""
    from te_parallel.native import cast as native_cast
    from te_parallel.native import scaling as native_scaling
    from te_parallel.ops import cast as cast_ops

    torch.manual_seed(hash(mode) % 2**31)
    x = (torch.randn(384, 256, device="cuda") * 7).to(torch.bfloat16)
    scale = torch.tensor(3.5, device="cuda")

    def run():
        amax = torch.full((1,), 2.0, device="cuda")
        if mode == "current":
            q = cast_ops.quantize_current(x, E4M3, transpose=True, keep_scale=True)
        else:
            q = cast_ops.quantize(x, scale, E5M2 if mode == "delayed_t_only" else E4M3, amax_out=amax,
                                  transpose=mode != "delayed", rowwise=mode != "delayed_t_only",
                                  keep_scale=mode == "weight")
        return [_bytes(q.data), None if q.data_t is None else _bytes(q.data_t), q.scale_inv.reshape(()),
                None if q.scale is None else q.scale.reshape(()), amax], q

    calls = []
    real = torch_ops.cast_fp8
    monkeypatch.setattr(torch_ops, "cast_fp8", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(native_cast, "cast_transpose_amax", lambda *a, **k: pytest.fail("the pybind11 cast was called"))
    monkeypatch.setattr(native_scaling, "current_scale_of", lambda *a, **k: pytest.fail("two-call current scale"))
    by_op, q = run()
    assert calls == [1] and q.data.shape == x.shape
    assert q.scale is None or q.scale.dim() == 0
    monkeypatch.undo()
    monkeypatch.setattr(torch_ops, "usable", lambda: False)
    by_pybind, _ = run()
    for a, b in zip(by_op, by_pybind):
        assert (a is None and b is None) or torch.equal(a, b)
