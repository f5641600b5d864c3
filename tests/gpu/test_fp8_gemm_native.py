"""tep_fp8_gemm (csrc/gemm: te_parallel's own cuBLASLt call) against torch._scaled_mm and fp64.

Both call cuBLASLt with the same operands, scales and epilogue, so they agree to the last bit where
the heuristic picks the same kernel; the assertions allow one rounding of the output dtype, since
nothing obliges the two callers' heuristics to agree.
"""
import gc
import os
import subprocess
import sys

import pytest
import torch

from te_parallel import native
from te_parallel.native import gemm as native_gemm
from te_parallel.ops.cast import quantize_current
from tests.reference import fp8_gemm_tol

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs compute capability >= 8.9 for FP8", allow_module_level=True)
if not native_gemm.usable():
    pytest.skip("te_parallel._C is absent or cuBLASLt did not open", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _q(shape, dtype, seed, mag=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_current(torch.randn(*shape, device="cuda", generator=g) * mag, dtype)


def _close(got, want, dtype, ulps=1.0, scale=None):
    """Within `ulps` units of the output dtype's rounding, relative to each element (or to `scale`,
    the magnitude of what was summed, where terms cancel), plus a floor relative to the largest."""
    err = (got.double() - want.double()).abs()
    mag = want.double().abs() if scale is None else scale.double()
    bound = ulps * ULP[dtype] * (mag + 1e-3 * want.double().abs().max())
    bad = (err > bound).sum().item()
    assert bad == 0, f"{bad} elements differ by more than {ulps} ulp (max {err.max().item():.3g})"


@pytest.mark.parametrize("m, k, n", [(16, 16, 16), (48, 80, 32), (272, 528, 1040), (2048, 768, 3072)])
@pytest.mark.parametrize("types", [(E4, E4), (E4, E5), (E5, E4)], ids=["e4e4", "e4e5", "e5e4"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_matches_scaled_mm(m, k, n, types, out_dtype, with_bias):
    a, b = _q((m, k), types[0], m + k), _q((n, k), types[1], n + 7, mag=0.5)
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias and out_dtype != torch.float32 else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)  # poisoned
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out, bias=bias)
    want = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, bias=bias,
                            out_dtype=out_dtype)
    assert not out.isnan().any()
    _close(out, want, out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_accumulate_is_one_rounding(out_dtype, fast_accum):
    """D = A·Bᵀ + C rounded once: against the fp32 GEMM plus C, rounded (the same kernel family's
    accumulation), and against fp64."""
    m, k, n = 1024, 512, 768
    a, b = _q((m, k), E4, 1), _q((n, k), E4, 2)
    c = (torch.randn(m, n, device="cuda") * 8).to(out_dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out, accumulate=c, fast_accum=fast_accum)
    acc32 = torch.empty(m, n, device="cuda")
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, acc32, fast_accum=fast_accum)
    # the two plans (with / without C) may be different kernels, whose fp32 accumulation orders differ
    # by a few fp32 ulps of the sum of |products|: that is the scale of an fp32 D's comparison
    products = (a.data.float() * a.scale_inv).abs() @ (b.data.float() * b.scale_inv).abs().t()
    _close(out, (acc32.double() + c.double()).to(out_dtype), out_dtype, ulps=16.0 if out_dtype == torch.float32 else 1.0,
           scale=products + c.abs())
    exact = (a.data.double() * a.scale_inv.double()) @ (b.data.double() * b.scale_inv.double()).t() + c.double()
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 4 * ULP[out_dtype] + fp8_gemm_tol("cuda"), rel  # (Hopper's FP8 MMA accumulator: reference.py)


def test_accumulate_in_place_and_into_row_slices():
    """C may be D (in place); D and C may be row slices of larger tensors; nothing outside is touched."""
    m, k, n = 64, 128, 96
    a, b = _q((m, k), E4, 3), _q((n, k), E4, 4)
    big = torch.full((3 * m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    c = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    big[m + 1 : 2 * m + 1] = c
    view = big[m + 1 : 2 * m + 1]  # a 1-row offset: 64-byte aligned, so the plan is not the 256-byte one
    want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, want, accumulate=c)
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, view, accumulate=view)
    # (another alignment, so maybe another kernel: its fp32 accumulation order may move the last bit)
    _close(view, want, torch.bfloat16, ulps=1.0, scale=want.abs() + c.abs())
    assert big[: m + 1].isnan().all() and big[2 * m + 1 :].isnan().all()


def test_plans_are_cached():
    a, b = _q((32, 64), E4, 5), _q((48, 64), E4, 6)
    out = torch.empty(32, 48, device="cuda", dtype=torch.bfloat16)
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out)
    before = native_gemm.cached_plans()
    for _ in range(3):
        native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out)
    assert native_gemm.cached_plans() == before
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out, accumulate=out)
    assert native_gemm.cached_plans() == before + 1  # C changes the plan


def test_bad_arguments_fail_with_one_line():
    a, b = _q((32, 64), E4, 7), _q((48, 64), E4, 8)
    out = torch.empty(32, 48, device="cuda", dtype=torch.bfloat16)
    module, code = native.load(), native.DTYPES  # the C API's own checks, below the wrapper's
    e4, e5, bf16 = code[torch.float8_e4m3fn], code[torch.float8_e5m2], code[torch.bfloat16]
    with pytest.raises(RuntimeError, match="m=8 n=48 k=64; need each >= 16 and a multiple of 16"):
        module.gemm(a.data.data_ptr(), e4, b.data.data_ptr(), e4, 8, 48, 64, a.scale_inv.data_ptr(),
                    b.scale_inv.data_ptr(), 0, out.data_ptr(), bf16, 0, False, 0, 0, 0)
    with pytest.raises(RuntimeError, match=r"need FP8 E4M3/E5M2 operands \(not both E5M2\), or both bf16"):
        module.gemm(a.data.data_ptr(), e5, b.data.data_ptr(), e5, 32, 48, 64, a.scale_inv.data_ptr(),
                    b.scale_inv.data_ptr(), 0, out.data_ptr(), bf16, 0, False, 0, 0, 0)
    with pytest.raises(ValueError, match=r"fp8_gemm: got a .*need FP8 a \[m, k\], b \[n, k\]"):
        native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out.t())


def test_tune_times_the_candidates_and_choose_switches_them():
    """gemm_tune times every candidate, keeps the fastest (the result stays the GEMM's, to the rounding
    of another kernel), and gemm_choose(0) restores the heuristic's pick bit for bit."""
    m, k, n = 512, 1024, 768
    a, b = _q((m, k), E4, 11), _q((n, k), E5, 12)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out, bias=bias)
    heuristic = out.clone()
    times, chosen = native_gemm.gemm_tune(a.data, a.scale_inv, b.data, b.scale_inv, out, bias=bias, rounds=3, reps=2)
    assert 1 <= len(times) <= 8 and 0 <= chosen < len(times)
    assert times[chosen] > 0 and all(t < 0 or times[chosen] <= t for t in times)
    out.fill_(float("nan"))
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out, bias=bias)  # the chosen candidate
    exact = (a.data.double() * a.scale_inv.double()) @ (b.data.double() * b.scale_inv.double()).t() + bias.double()
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 4 * ULP[torch.bfloat16] + fp8_gemm_tol("cuda"), rel
    native_gemm.gemm_choose(a.data, a.scale_inv, b.data, b.scale_inv, out, 0, bias=bias)
    native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out, bias=bias)
    assert torch.equal(out, heuristic)
    with pytest.raises(RuntimeError, match=f"tep_gemm_choose: index {len(times)}; this plan has {len(times)} candidates"):
        native_gemm.gemm_choose(a.data, a.scale_inv, b.data, b.scale_inv, out, len(times), bias=bias)


def test_tune_rejects_bad_arguments():
    a, b = _q((32, 64), E4, 13), _q((48, 64), E4, 14)
    out = torch.empty(32, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"rounds must be an int in \[1, 16\] and reps an int >= 1, got 0, 5"):
        native_gemm.gemm_tune(a.data, a.scale_inv, b.data, b.scale_inv, out, rounds=0)
    with pytest.raises(ValueError, match="accumulate is out itself"):
        native_gemm.gemm_tune(a.data, a.scale_inv, b.data, b.scale_inv, out, accumulate=out)
    with pytest.raises(ValueError, match=r"gemm_tune: got a .*need FP8 a \[m, k\]"):
        native_gemm.gemm_tune(a.data, a.scale_inv, b.data, b.scale_inv, out.t())


def test_linear_with_native_gemm_matches_scaled_mm():
    """A te.Linear FP8 step with every GEMM through the native call (the default MMParams) gives the
    outputs and gradients of the same step through torch._scaled_mm (MMParams(backend="torch")), each GEMM
    with the recipe's accumulation (fast in fprop, exact in dgrad / wgrad)."""
    import dataclasses

    import te_parallel as te
    from te_parallel import recipe

    torch.manual_seed(0)
    lin = te.Linear(512, 768, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 768, device="cuda", dtype=torch.bfloat16)

    def step(rec):
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=rec):
            y = lin(xi)
        y.backward(dy)
        grads = (xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
        lin.zero_grad(set_to_none=True)
        return (y.detach(), *grads)

    native = recipe.Float8CurrentScaling()
    want = step(dataclasses.replace(native, **{f"fp8_gemm_{g}": dataclasses.replace(getattr(native, f"fp8_gemm_{g}"),
                                                                                  backend="torch")
                                               for g in ("fprop", "dgrad", "wgrad")}))
    got = step(native)
    for g, w in zip(got, want):
        _close(g.float(), w.float(), torch.bfloat16)


def test_unopenable_cublaslt_says_why_and_accumulate_falls_back():
    code = (
        "import torch; from te_parallel.native import gemm as native_gemm; from te_parallel.ops import gemm;"
        "from te_parallel.ops.cast import quantize_current as q;"
        "assert not native_gemm.usable();"
        "print(native_gemm.unavailable_reason());"
        "a = q(torch.randn(32, 64, device='cuda'), torch.float8_e4m3fn);"
        "c = torch.ones(32, 32, device='cuda', dtype=torch.bfloat16);"
        "y = gemm.fprop(a, a, torch.bfloat16, accumulate=c);"
        "ref = gemm.fprop(a, a, torch.float32) + 1;"
        "assert ((y.float() - ref).abs() <= 2**-6 * ref.abs() + 1e-2).all()"
    )
    env = dict(os.environ, TE_PARALLEL_CUBLASLT="/nonexistent/libcublasLt.so")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot open cuBLASLt (TE_PARALLEL_CUBLASLT=/nonexistent/libcublasLt.so)" in done.stdout, done.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_high_precision_operands(dtype, out_fp32):
    """bf16 / fp16 operands (no scales), as comm-GEMM overlap's fused schedule calls them."""
    m, k, n = 272, 192, 80
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype)
    c = torch.randn(m, n, device="cuda").to(torch.float32 if out_fp32 else dtype)
    out = torch.full_like(c, float("nan"))
    stream = torch.cuda.current_stream().cuda_stream
    ws, _scratch = native_gemm.workspace(a.device, stream)
    code = native.DTYPES  # fp8_gemm takes FP8 only: the C API itself, as the comm-overlap schedules call it
    native.load().gemm(a.data_ptr(), code[dtype], b.data_ptr(), code[dtype], m, n, k, 0, 0, c.data_ptr(),
                       out.data_ptr(), code[out.dtype], 0, False, ws, native_gemm.WORKSPACE_BYTES, stream)
    want = (a.double() @ b.double().t() + c.double())
    _close(out, want.to(out.dtype), out.dtype, ulps=16.0 if out_fp32 else 2.0, scale=(a.double().abs() @ b.double().abs().t()) + c.abs())


@pytest.mark.parametrize("case", ["bias_bf16", "acc_fp32", "bias_fp32", "fp16"])
def test_fp8_mm_op_and_binding_same_bytes(case, monkeypatch):
    """ops.gemm.fp8_mm issues a GEMM with a new output through the torch op te_parallel::fp8_gemm (less host
    time) and one into a given `out` through the binding: the same cuBLASLt plan (none added by the second),
    the same bytes, with bias (fused, or added after for fp32) and accumulate."""
    from te_parallel.native import torch_ops
    from te_parallel.ops import gemm as ops_gemm
    from te_parallel.recipe import MMParams

    if not torch_ops.usable():
        pytest.skip("te_parallel._C was built without the torch ops")
    out_dtype = {"acc_fp32": torch.float32, "bias_fp32": torch.float32, "fp16": torch.float16}.get(case, torch.bfloat16)
    m, k, n = 64, 128, 96
    a, b = _q((m, k), E4, 21), _q((n, k), E5, 22)
    bias = torch.randn(n, device="cuda").to(out_dtype) if case.startswith("bias") else None
    acc = torch.randn(m, n, device="cuda").to(out_dtype) if case == "acc_fp32" else None
    calls = []
    original = torch_ops.fp8_gemm
    monkeypatch.setattr(torch_ops, "fp8_gemm", lambda *args: calls.append(1) or original(*args))
    for mm in (MMParams(), MMParams(use_split_accumulator=False)):
        via_op = ops_gemm.fp8_mm(a.data, a.scale_inv, b.data.t(), b.scale_inv, out_dtype, bias, mm=mm, accumulate=acc)
        plans = native_gemm.cached_plans()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        via_binding = ops_gemm.fp8_mm(a.data, a.scale_inv, b.data.t(), b.scale_inv, out_dtype, bias, out=out, mm=mm,
                                      accumulate=acc)
        assert via_binding is out and native_gemm.cached_plans() == plans
        assert torch.equal(via_op, via_binding)
    assert len(calls) == 2  # the calls without `out`


def test_gemm_workspace_is_outside_torch_allocator_and_capture_safe():
    """The cuBLASLt workspace of a stream is the C API's (cudaMalloc'd once, outside torch's allocator): a
    first GEMM on a new stream, through the torch op and through the binding, leaves nothing allocated in
    torch's allocator (a kept workspace there is what a CUDA graph pool cannot own: inductor's CUDA graph
    trees refuse it). A GEMM captured on a stream that has no workspace yet takes a temporary one, and the
    graph's replays give the eager bytes."""
    from te_parallel.native import torch_ops

    if not torch_ops.usable():
        pytest.skip("the torch ops are not built (te_parallel._C without torch's headers)")
    a, b = _q((64, 128), E4, 1), _q((32, 128), E4, 2)
    want = torch_ops.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.bfloat16)
    torch.cuda.synchronize()
    gc.collect()  # (a collection inside the measured lines would free earlier tests' tensors)
    gc.disable()
    try:
        for path in ("op", "binding"):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                before = torch.cuda.memory_allocated()
                if path == "op":
                    got = torch_ops.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.bfloat16)
                else:
                    got = native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.empty_like(want))
                stream.synchronize()
                assert torch.equal(got, want), path
                del got
                after = torch.cuda.memory_allocated()
                assert after == before, f"{path}: torch's allocated bytes went from {before} to {after}"
    finally:
        gc.enable()
    for path in ("op", "binding"):
        graph, out = torch.cuda.CUDAGraph(), torch.empty_like(want)
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # a stream with no workspace
            if path == "op":
                got = torch_ops.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.bfloat16)
            else:
                got = native_gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out)
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want), path
