"""Native LayerNorm / RMSNorm kernels (te_parallel.native.norm, and the autograd Functions over them in
te_parallel.ops.norm) vs fp64 references, on awkward shapes.

Stated tolerances (relative Frobenius error ‖out − ref‖ / ‖ref‖ against the fp64 math on the same
inputs, te_parallel.ops.norm.*_reference):
* y, dx, dgamma, dbeta: within 2x the error of PyTorch's own F.layer_norm / F.rms_norm (and its
  autograd) in the same storage dtype, or within the unit roundoff of the tensor's dtype
  (bf16 2^-8, fp16 2^-11; fp32: 1e-6), whichever is larger: storing a result in bf16 alone costs up
  to half a unit roundoff, so nothing tighter can be asked of a bf16 output.
* FP8 output: bit-exact against te_parallel.ops.cast.quantize_reference of the kernel's own fp32 y
  (a call with out_dtype=float32 runs the same instructions up to the store); its transposed copy
  bit-exact; amax exact. mu/rsigma of the two calls bit-identical.
* dgamma/dbeta: bit-identical across reruns (deterministic two-stage reduction).
Outputs land in memory poisoned with 0x7B bytes (freed to the caching allocator before the call).
"""
import pytest
import torch
import torch.nn.functional as F

from te_parallel import native
from te_parallel.native import norm as nn_
from te_parallel.ops import norm as norm_ops
from te_parallel.ops.cast import quantize_reference
from te_parallel.ops.norm import (layer_norm_bwd_reference, layer_norm_reference, native_layer_norm, native_rms_norm,
                                  rms_norm_bwd_reference, rms_norm_reference)
from tests.reference import rel_err

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

# rows x hidden: 1 row; hidden 1, not a multiple of 8 or of 128; the register kernels with 1, 2 and
# 4 chunks per thread; the backward's column-kernel path (hidden > 8192) and the looped kernels
# (hidden > 16384); many narrow rows (the persistent backward strides over rows); the large case.
SHAPES = [(1, 1), (1, 13), (7, 200), (33, 1000), (129, 64), (5, 4104), (3, 8200), (3, 16384), (2, 20000),
          (20000, 40), (8192, 4096)]
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
          (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]  # (x dtype, gamma/beta dtype)
NORMS = ["LayerNorm", "LayerNorm-nobias", "RMSNorm"]
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 1e-6}
EPS = 1e-5


def _poison(nbytes: int) -> None:
    """Fill the caching allocator's free blocks (small and large pools) with 0x7B bytes."""
    torch.cuda.empty_cache()
    small = [torch.full((256 * 1024,), 0x7B, dtype=torch.uint8, device="cuda") for _ in range(16)]
    large = torch.full((max(nbytes, 2 << 20),), 0x7B, dtype=torch.uint8, device="cuda")
    del small, large


def _case(shape, x_dtype, w_dtype, norm, zero_centered, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, h = shape
    x = (torch.randn(rows, h, device="cuda", generator=g) * 3 + 0.5).to(x_dtype)
    gamma = (torch.randn(h, device="cuda", generator=g) * 0.3 + (0.0 if zero_centered else 1.0)).to(w_dtype)
    beta = (torch.randn(h, device="cuda", generator=g) * 0.3).to(w_dtype) if norm == "LayerNorm" else None
    dy = torch.randn(rows, h, device="cuda", generator=g).to(x_dtype)
    return x, gamma, beta, dy


def _fwd(norm, x, gamma, beta, zero_centered, **kw):
    if norm == "RMSNorm":
        out, rsigma = nn_.rms_norm_fwd(x, gamma, EPS, zero_centered, **kw)
        return out, None, rsigma
    return nn_.layer_norm_fwd(x, gamma, beta, EPS, zero_centered, **kw)


def _bwd(norm, dy, x, mu, rsigma, gamma, beta, zero_centered):
    if norm == "RMSNorm":
        dx, dgamma = nn_.rms_norm_bwd(dy, x, rsigma, gamma, zero_centered)
        return dx, dgamma, None
    return nn_.layer_norm_bwd(dy, x, mu, rsigma, gamma, zero_centered, with_dbeta=beta is not None)


def _references(norm, dy, x, gamma, beta, zero_centered):
    """fp64 (y, dx, dgamma, dbeta) on the CPU."""
    xc, gc, dyc = x.cpu(), gamma.cpu(), dy.cpu()
    bc = None if beta is None else beta.cpu()
    if norm == "RMSNorm":
        y = rms_norm_reference(xc, gc, EPS, zero_centered)
        dx, dg = rms_norm_bwd_reference(dyc, xc, gc, EPS, zero_centered)
        return y, dx, dg, None
    y = layer_norm_reference(xc, gc, bc, EPS, zero_centered)
    dx, dg, db = layer_norm_bwd_reference(dyc, xc, gc, bc, EPS, zero_centered)
    return y, dx, dg, db


def _torch_errors(norm, dy, x, gamma, beta, zero_centered, refs):
    """Relative errors of PyTorch's own norm (same storage dtype as x) vs the fp64 references."""
    h = x.shape[1]
    xt = x.detach().clone().requires_grad_(True)
    wt = (gamma.float() + (1.0 if zero_centered else 0.0)).to(x.dtype).requires_grad_(True)
    bt = None if beta is None else beta.to(x.dtype).requires_grad_(True)
    yt = F.rms_norm(xt, (h,), wt, EPS) if norm == "RMSNorm" else F.layer_norm(xt, (h,), wt, bt, EPS)
    yt.backward(dy)
    got = (yt, xt.grad, wt.grad, None if bt is None else bt.grad)
    return [None if r is None else rel_err(t.cpu(), r) for t, r in zip(got, refs)]


def _assert_close(name, got, ref, torch_err):
    err = rel_err(got.cpu(), ref)
    tol = max(2 * torch_err, UNIT[got.dtype])
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.2e} (PyTorch's: {torch_err:.2e})"


def _params():
    cases = []
    for shape in SHAPES:
        for x_dtype, w_dtype in DTYPES:
            big = shape == (8192, 4096)
            if big and (x_dtype, w_dtype) not in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]:
                continue
            for norm in NORMS:
                if norm == "RMSNorm" and shape[1] == 1:
                    continue  # ill-conditioned: dx = rsigma * dy*g * eps / (x^2 + eps) cancels in any fp32 math
                zc = norm != "LayerNorm-nobias" and shape[1] % 2 == 1  # both settings across the shapes
                ident = f"{shape[0]}x{shape[1]}-{str(x_dtype)[6:]}-w{str(w_dtype)[6:]}-{norm}{'-zc' if zc else ''}"
                cases.append(pytest.param(shape, x_dtype, w_dtype, norm, zc, id=ident))
    return cases


@pytest.mark.parametrize("shape, x_dtype, w_dtype, norm, zero_centered", _params())
def test_fwd_bwd_match_reference(shape, x_dtype, w_dtype, norm, zero_centered):
    kind = "RMSNorm" if norm == "RMSNorm" else "LayerNorm"
    x, gamma, beta, dy = _case(shape, x_dtype, w_dtype, norm, zero_centered)  # no beta for "LayerNorm-nobias"
    rows, h = shape
    _poison(8 * rows * h * 4)
    y, mu, rsigma = _fwd(kind, x, gamma, beta, zero_centered)
    _poison(8 * rows * h * 4)
    dx, dgamma, dbeta = _bwd(kind, dy, x, mu, rsigma, gamma, beta, zero_centered)
    torch.cuda.synchronize()
    assert y.dtype == x_dtype and dx.dtype == x_dtype and dgamma.dtype == w_dtype
    refs = _references(kind, dy, x, gamma, beta, zero_centered)
    terr = _torch_errors(kind, dy, x, gamma, beta, zero_centered, refs)
    _assert_close("y", y, refs[0], terr[0])
    _assert_close("dx", dx, refs[1], terr[1])
    _assert_close("dgamma", dgamma, refs[2], terr[2])
    if beta is not None:
        assert dbeta.dtype == w_dtype
        _assert_close("dbeta", dbeta, refs[3], terr[3])
    else:
        assert dbeta is None
    # Statistics: mu exact-ish vs fp64, rsigma within fp32 rounding of rsqrt.
    xd = x.cpu().double()
    if kind == "LayerNorm":
        mu_ref = xd.mean(-1)
        rs_ref = 1 / torch.sqrt(((xd - mu_ref[:, None]) ** 2).mean(-1) + EPS)
        assert (mu.cpu().double() - mu_ref).abs().max().item() <= 1e-5 * (xd.abs().max().item() + 1)
    else:
        assert mu is None
        rs_ref = 1 / torch.sqrt((xd * xd).mean(-1) + EPS)
    assert rel_err(rsigma.cpu(), rs_ref) < 1e-5
    # Deterministic: the same inputs give the same bits.
    dx2, dgamma2, dbeta2 = _bwd(kind, dy, x, mu, rsigma, gamma, beta, zero_centered)
    assert torch.equal(dx2, dx) and torch.equal(dgamma2, dgamma)
    assert dbeta is None or torch.equal(dbeta2, dbeta)


FP8_SHAPES = [(1, 13), (7, 200), (63, 1000), (64, 64), (5, 4104), (2, 20000), (8192, 4096)]


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=[f"{r}x{c}" for r, c in FP8_SHAPES])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_fp8_output_bit_exact(shape, x_dtype, fp8, norm):
    x, gamma, beta, _ = _case(shape, x_dtype, x_dtype, norm, zero_centered=True, seed=1)
    rows, h = shape
    y32, mu, rsigma = _fwd(norm, x, gamma, beta, True, out_dtype=torch.float32)
    y_x, _, _ = _fwd(norm, x, gamma, beta, True)
    assert torch.equal(y_x, y32.to(x_dtype))  # the same y, rounded once to x's dtype
    scale = torch.tensor([150.0], device="cuda")  # |y| beyond ~3 saturates E4M3
    amax = torch.tensor([0.125], device="cuda")
    _poison(4 * rows * h)
    (data, data_t), mu8, rsigma8 = _fwd(norm, x, gamma, beta, True,
                                        fp8=nn_.FP8NormOutput(scale, fp8, amax, transpose=True))
    ref = quantize_reference(y32.cpu(), scale.cpu(), fp8)
    assert data.dtype == fp8 and torch.equal(data.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.cpu().view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert amax.item() == max(0.125, y32.abs().max().item())
    assert torch.equal(rsigma8, rsigma) and (mu is None or torch.equal(mu8, mu))
    (data2, none), _, _ = _fwd(norm, x, gamma, beta, True, fp8=nn_.FP8NormOutput(scale, fp8))
    assert none is None and torch.equal(data2.view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_bits_do_not_depend_on_alignment(norm):
    """A misaligned x (offset by one element) takes the element-wise path: same chunks, same bits."""
    x, gamma, beta, dy = _case((37, 4096), torch.bfloat16, torch.bfloat16, norm, False)
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    xm = buf[1:].view_as(x)
    xm.copy_(x)
    y, mu, rs = _fwd(norm, x, gamma, beta, False)
    ym, mum, rsm = _fwd(norm, xm, gamma, beta, False)
    assert torch.equal(y, ym) and torch.equal(rs, rsm)
    dx, dg, db = _bwd(norm, dy, x, mu, rs, gamma, beta, False)
    dxm, dgm, dbm = _bwd(norm, dy, xm, mum, rsm, gamma, beta, False)
    assert torch.equal(dx, dxm) and torch.equal(dg, dgm)


def test_amax_propagates_nan_and_keeps_larger_previous():
    x, gamma, beta, _ = _case((33, 70), torch.bfloat16, torch.bfloat16, "LayerNorm", False)
    amax = torch.tensor([1e6], device="cuda")
    spec = nn_.FP8NormOutput(torch.tensor([1.0], device="cuda"), torch.float8_e4m3fn, amax)
    nn_.layer_norm_fwd(x, gamma, beta, EPS, fp8=spec)
    assert amax.item() == 1e6
    x[5, 7] = float("nan")
    (data, _), _, _ = nn_.layer_norm_fwd(x, gamma, beta, EPS, fp8=spec)
    assert torch.isnan(amax).item() and torch.isnan(data[5].float()).all().item()


@pytest.mark.parametrize("norm, zero_centered", [("LayerNorm", False), ("LayerNorm", True), ("LayerNorm-nobias", False),
                                                 ("RMSNorm", False), ("RMSNorm", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_high_precision_norm_runs_native_backward(norm, zero_centered, dtype):
    """ops.norm's high-precision layer_norm / rms_norm with a gradient: torch's forward (the same bits as
    F.layer_norm / F.rms_norm) and the native backward; gradients within 2x PyTorch's own error vs fp64."""
    x, gamma, beta, dy = _case((1024, 768), dtype, dtype, norm.split("-")[0], zero_centered, seed=3)
    if norm == "LayerNorm-nobias":
        beta = None
    x, gamma = x.view(8, 128, 768).requires_grad_(True), gamma.requires_grad_(True)
    beta = None if beta is None else beta.requires_grad_(True)
    if norm == "RMSNorm":
        y = norm_ops.rms_norm(x, gamma, EPS, zero_centered)
        want = F.rms_norm(x.detach(), (768,), (gamma.detach() + zero_centered).to(dtype), EPS)
    else:
        y = norm_ops.layer_norm(x, gamma, beta, EPS, zero_centered)
        want = F.layer_norm(x.detach(), (768,), (gamma.detach() + zero_centered).to(dtype),
                            None if beta is None else beta.detach(), EPS)
    assert "TorchNormNativeBackward" in str(y.grad_fn.next_functions)
    assert torch.equal(y.detach(), want)
    y.backward(dy.view(8, 128, 768))
    rows = x.detach().view(-1, 768)
    refs = _references(norm.split("-")[0], dy, rows, gamma.detach(), None if beta is None else beta.detach(), zero_centered)
    torch_err = _torch_errors(norm.split("-")[0], dy, rows, gamma.detach(), None if beta is None else beta.detach(),
                              zero_centered, refs)
    _assert_close("dx", x.grad.view(-1, 768), refs[1], torch_err[1])
    _assert_close("dgamma", gamma.grad, refs[2], torch_err[2])
    if beta is not None:
        _assert_close("dbeta", beta.grad, refs[3], torch_err[3])
    with torch.no_grad():  # no gradient wanted: torch's op alone
        assert norm_ops.rms_norm(x, gamma, EPS).grad_fn is None


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_native_autograd_matches_reference(norm):
    """The native high-precision autograd path (called directly: ops.norm's layer_norm / rms_norm use
    torch's forward, measured faster, see te_parallel/ops/norm.py) runs the native Function; values and
    gradients vs fp64."""
    torch.manual_seed(0)
    x = (torch.randn(5, 7, 40, device="cuda") * 2).requires_grad_(True)
    w = (torch.randn(40, device="cuda") * 0.3).requires_grad_(True)
    b = (torch.randn(40, device="cuda") * 0.3).requires_grad_(True) if norm == "LayerNorm" else None
    y = native_layer_norm(x, w, b, 1e-3, True) if norm == "LayerNorm" else native_rms_norm(x, w, 1e-3, True)
    assert "NormFunction" in type(y.grad_fn).__name__ or "NormFunction" in str(y.grad_fn.next_functions)
    y_hp = norm_ops.layer_norm(x, w, b, 1e-3, True) if norm == "LayerNorm" else norm_ops.rms_norm(x, w, 1e-3, True)
    assert "_NormFunction" not in str(y_hp.grad_fn.next_functions)  # the high-precision rule: torch's forward
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.detach().cpu().double().requires_grad_(True), w.detach().cpu().double().requires_grad_(True)
    br = None if b is None else b.detach().cpu().double().requires_grad_(True)
    ref = layer_norm_reference(xr, wr, br, 1e-3, True) if norm == "LayerNorm" else rms_norm_reference(xr, wr, 1e-3, True)
    ref.backward(dy.cpu().double())
    assert rel_err(y.detach().cpu(), ref) < 1e-5 and rel_err(x.grad.cpu(), xr.grad) < 1e-5
    assert rel_err(w.grad.cpu(), wr.grad) < 1e-5 and (b is None or rel_err(b.grad.cpu(), br.grad) < 1e-5)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_fp8_entry_point_gradient_flows_through_carrier(norm):
    x, gamma, beta, dy = _case((300, 1000), torch.bfloat16, torch.float32, norm, False)
    x.requires_grad_(True)
    gamma.requires_grad_(True)
    scale = torch.tensor(64.0, device="cuda")
    assert nn_.usable(x, gamma, beta)  # the FP8 rule: the kernels, where they can run
    if norm == "LayerNorm":
        beta.requires_grad_(True)
        y8, carrier = norm_ops.layer_norm_fp8(x, gamma, beta, EPS, scale=scale, fp8_dtype=torch.float8_e4m3fn)
    else:
        y8, carrier = norm_ops.rms_norm_fp8(x, gamma, EPS, scale=scale, fp8_dtype=torch.float8_e4m3fn)
    assert y8.data_t is not None and torch.equal(y8.data_t, y8.data.t().contiguous())
    assert y8.scale_inv.item() == 1 / 64.0 and carrier.shape == x.shape and carrier.dtype == x.dtype
    (data, _), mu, rsigma = _fwd(norm, x.detach(), gamma.detach(), None if beta is None else beta.detach(), False,
                                 fp8=nn_.FP8NormOutput(scale.reshape(1), torch.float8_e4m3fn))
    assert torch.equal(y8.data.view(torch.uint8), data.view(torch.uint8))
    (carrier.float() * dy.float()).sum().backward()
    dx, dgamma, dbeta = _bwd(norm, dy, x.detach(), mu, rsigma, gamma.detach(), beta, False)
    assert torch.equal(x.grad, dx) and torch.equal(gamma.grad, dgamma)
    assert beta is None or torch.equal(beta.grad, dbeta)


def test_bad_arguments_cuda():
    x = torch.randn(4, 16, device="cuda")
    g = torch.ones(16, device="cuda")
    with pytest.raises(ValueError, match=r"gamma is \(8,\).*need a contiguous \(16,\)"):
        nn_.layer_norm_fwd(x, g[:8], None, EPS)
    with pytest.raises(ValueError, match="need one dtype for both"):
        nn_.layer_norm_fwd(x, g, g.half(), EPS)
    with pytest.raises(ValueError, match="fp8.fp8_dtype"):
        nn_.rms_norm_fwd(x, g, EPS, fp8=nn_.FP8NormOutput(torch.ones(1, device="cuda"), torch.int8))
    with pytest.raises(ValueError, match="fp8.scale"):
        nn_.rms_norm_fwd(x, g, EPS, fp8=nn_.FP8NormOutput(torch.ones(2, device="cuda"), torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"rsigma is .*need the forward's contiguous float32 \(4,\)"):
        nn_.rms_norm_bwd(x, x, torch.ones(3, device="cuda"), g)
    with pytest.raises(ValueError, match="dy is"):
        nn_.layer_norm_bwd(x.half(), x, torch.ones(4, device="cuda"), torch.ones(4, device="cuda"), g)
    with pytest.raises(ValueError, match=r"^\S+: [^\n]+$"):  # one line
        nn_.layer_norm_fwd(x.t(), g, None, EPS)
