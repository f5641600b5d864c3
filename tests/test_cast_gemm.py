"""quantize / dequantize and the FP8 GEMM layouts against fp64 references (incl. hypothesis fuzzing)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import gemm
from te_parallel.ops.cast import quantize, quantize_current, quantize_reference
from tests.reference import FP8, current_scale_ref, fp8_gemm_tol, quantize_ref, rel_err

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_bit_exact_with_transpose_and_amax(dtype, device):
    x = torch.randn(37, 53, device=device) * 30
    x[0, 0] = 1e9  # saturates
    scale = torch.tensor(3.7, device=device)
    cell = torch.tensor([5.0], device=device)
    q = quantize(x, scale, dtype, amax_out=cell, transpose=True)
    assert q.data.dtype == dtype and q.data.shape == x.shape
    assert torch.equal(_bits(q.data), _bits(quantize_reference(x, scale, dtype)))
    assert torch.equal(q.data.double().cpu(), quantize_ref(x.cpu(), scale.cpu(), dtype))  # independent rounding
    assert torch.equal(_bits(q.data_t), _bits(q.data.t().contiguous()))
    assert cell.item() == 1e9
    assert q.scale_inv.item() == pytest.approx(1 / 3.7)
    assert q.data.float().abs().max().item() == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax_of(dtype, device):
    """max |x| in fp32: negative extremes count, inf is kept, a NaN anywhere gives NaN."""
    from te_parallel.ops.cast import amax_of

    x = (torch.randn(33, 70, device=device) * 3).to(dtype)
    x[4, 9] = -50.0
    got = amax_of(x)
    assert got.dtype == torch.float32 and got.shape == () and got.item() == 50.0
    x[1, 1] = -float("inf")
    assert amax_of(x).item() == float("inf")
    x[2, 3] = float("nan")
    assert torch.isnan(amax_of(x)).item()


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_transposed_only_with_scale_snapshot(dtype, device):
    """rowwise=False writes only the transposed copy (data is a view of it); keep_scale returns a
    snapshot of the scale that later in-place updates of the scale do not touch."""
    x = torch.randn(40, 24, device=device, dtype=torch.bfloat16) * 20
    scale = torch.tensor(2.5, device=device)
    full = quantize(x, scale, dtype, transpose=True)
    q = quantize(x, scale, dtype, transpose=True, rowwise=False, keep_scale=True)
    assert q.data_t.is_contiguous() and q.data.shape == x.shape and q.data.data_ptr() == q.data_t.data_ptr()
    assert torch.equal(_bits(q.data_t), _bits(full.data_t)) and torch.equal(_bits(q.data), _bits(full.data))
    scale.mul_(4.0)
    assert q.scale.item() == 2.5 and torch.equal(q.scale_inv, full.scale_inv)
    assert quantize(x, scale, dtype).scale is None  # no snapshot unless asked for


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_nan_propagates_and_inf_saturates(dtype, device):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0]], device=device)
    q = quantize(x, torch.tensor(1.0, device=device), dtype).data.float()
    assert torch.isnan(q[0, 0]) and q[0, 1].item() == torch.finfo(dtype).max and q[0, 2].item() == -torch.finfo(dtype).max


@FUZZ
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), log_mag=st.floats(-12, 12), log_scale=st.floats(-10, 10),
       dtype=st.sampled_from(FP8), seed=st.integers(0, 2**31 - 1))
def test_quantize_fuzz(rows, cols, log_mag, log_scale, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 2.0**log_mag).to(device)
    scale = torch.tensor(2.0**log_scale, dtype=torch.float32, device=device)
    q = quantize(x, scale, dtype, transpose=True)
    assert torch.equal(q.data.double().cpu(), quantize_ref(x.cpu(), scale.cpu(), dtype))
    assert torch.equal(_bits(q.data_t), _bits(q.data.t().contiguous()))
    qc = quantize_current(x, dtype)
    assert torch.equal(qc.scale_inv.cpu(), 1.0 / current_scale_ref(x.cpu(), dtype))
    # current scaling uses the whole range: the largest element maps to fp8_max (or below by rounding of x*scale)
    assert qc.data.float().abs().max().item() <= torch.finfo(dtype).max


def _q(x, dtype):
    return quantize_current(x, dtype)


def _deq(t: Float8Tensor):
    return t.data.double().cpu() * t.scale_inv.double().cpu()


@pytest.mark.parametrize("out_dtype, tol", [(torch.float32, None), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_gemm_layouts_vs_fp64(out_dtype, tol, device):
    tol = tol or fp8_gemm_tol(device)
    m, k, n = 48, 80, 32
    x, w, dy = torch.randn(m, k, device=device), torch.randn(n, k, device=device), torch.randn(m, n, device=device)
    xq, wq = _q(x, torch.float8_e4m3fn), _q(w, torch.float8_e4m3fn)
    dyq = _q(dy, torch.float8_e5m2)
    bias = torch.randn(n, device=device, dtype=out_dtype)
    y = gemm.fprop(xq, wq, out_dtype, bias)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert rel_err(y.cpu(), _deq(xq) @ _deq(wq).t() + bias.double().cpu()) < tol
    assert rel_err(gemm.dgrad(dyq, wq, out_dtype).cpu(), _deq(dyq) @ _deq(wq)) < tol
    assert rel_err(gemm.wgrad(dyq, xq, out_dtype).cpu(), _deq(dyq).t() @ _deq(xq)) < tol


@FUZZ
@given(m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6), log_mag=st.floats(-8, 8),
       seed=st.integers(0, 2**31 - 1))
def test_gemm_fuzz(m, k, n, log_mag, seed, device):
    g = torch.Generator().manual_seed(seed)
    m, k, n = 16 * m, 16 * k, 16 * n
    x = (torch.randn(m, k, generator=g) * 2.0**log_mag).to(device)
    w = (torch.randn(n, k, generator=g) * 2.0**-log_mag).to(device)
    xq, wq = _q(x, torch.float8_e4m3fn), _q(w, torch.float8_e5m2)
    y = gemm.fprop(xq, wq, torch.float32)
    assert rel_err(y.cpu(), gemm.fp8_mm_reference(xq, wq).cpu()) < fp8_gemm_tol(device)


def test_gemm_rejects_bad_shapes_and_formats(device):
    e5 = _q(torch.randn(16, 32, device=device), torch.float8_e5m2)
    with pytest.raises(ValueError, match="two E5M2"):
        gemm.fprop(e5, e5, torch.float32)
    e4 = _q(torch.randn(16, 32, device=device), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="output dtype"):
        gemm.fprop(e4, e4, torch.float64)
    with pytest.raises(ValueError, match="column-major"):
        gemm.fp8_mm(e4.data, e4.scale_inv, e4.data.t().contiguous(), e4.scale_inv, torch.float32)


def test_quantize_rejects_bad_args(device):
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize(torch.randn(4, 4, device=device), torch.tensor(1.0, device=device), torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(4, device=device), torch.tensor(1.0, device=device), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rowwise=False needs transpose=True"):
        quantize(torch.randn(4, 4, device=device), torch.tensor(1.0, device=device), torch.float8_e4m3fn,
                 rowwise=False)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_accumulate_vs_fp64(out_dtype, with_bias, device):
    """D = A·Bᵀ (+ bias) + C, C added before the one rounding (cuBLASLt's epilogue on CUDA)."""
    m, k, n = 64, 96, 48
    xq = _q(torch.randn(m, k, device=device), torch.float8_e4m3fn)
    wq = _q(torch.randn(n, k, device=device), torch.float8_e4m3fn)
    c = (torch.randn(m, n, device=device) * 4).to(out_dtype)
    bias = torch.randn(n, device=device, dtype=out_dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), device=device, dtype=out_dtype)  # poisoned
    y = gemm.fprop(xq, wq, out_dtype, bias, out=out, accumulate=c)
    assert y.data_ptr() == out.data_ptr()
    want = _deq(xq) @ _deq(wq).t() + c.double().cpu() + (bias.double().cpu() if with_bias else 0)
    tol = fp8_gemm_tol(device) if out_dtype == torch.float32 else (8e-3 if out_dtype == torch.bfloat16 else 1e-3)
    assert rel_err(y.cpu(), want) < tol
    # adding C changed the result by C (not 2C, not 0): against the same GEMM without it
    plain = gemm.fprop(xq, wq, torch.float32, bias.float() if with_bias else None)
    assert rel_err((y.double() - c.double()).cpu(), plain.double().cpu()) < 4 * tol


@pytest.mark.parametrize("m, k, n", [(8, 32, 48), (5, 24, 40), (16, 16, 9), (1, 7, 3)])
@pytest.mark.parametrize("layout", ["fprop", "dgrad", "wgrad"])
def test_gemm_pads_dims_not_multiple_of_16(m, k, n, layout, device):
    """Any M, K, N: the GEMM zero-pads to multiples of 16 (cuBLASLt's rule) and returns the [m, n] product,
    with bias, out= and accumulate= as on aligned shapes."""
    x, w, dy = torch.randn(m, k, device=device), torch.randn(n, k, device=device), torch.randn(m, n, device=device)
    xq, wq, dyq = _q(x, torch.float8_e4m3fn), _q(w, torch.float8_e4m3fn), _q(dy, torch.float8_e5m2)
    tol = fp8_gemm_tol(device)
    if layout == "fprop":
        bias, c = torch.randn(n, device=device), torch.randn(m, n, device=device)
        out = torch.full((m, n), float("nan"), device=device)
        y = gemm.fprop(xq, wq, torch.float32, bias, out=out, accumulate=c)
        assert y.data_ptr() == out.data_ptr()
        want = _deq(xq) @ _deq(wq).t() + bias.double().cpu() + c.double().cpu()
    elif layout == "dgrad":
        y, want = gemm.dgrad(dyq, wq, torch.float32), _deq(dyq) @ _deq(wq)
    else:
        y, want = gemm.wgrad(dyq, xq, torch.float32), _deq(dyq).t() @ _deq(xq)
    assert y.shape == want.shape and y.is_contiguous()
    assert rel_err(y.cpu(), want) < tol


def test_gemm_accumulate_rejects_mismatch(device):
    xq = _q(torch.randn(32, 32, device=device), torch.float8_e4m3fn)
    wq = _q(torch.randn(16, 32, device=device), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"accumulate is \(16, 32\) torch.bfloat16; need contiguous \(32, 16\)"):
        gemm.fprop(xq, wq, torch.bfloat16, accumulate=torch.zeros(16, 32, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="accumulate is .* torch.float32; need"):
        gemm.fprop(xq, wq, torch.bfloat16, accumulate=torch.zeros(32, 16, device=device))
