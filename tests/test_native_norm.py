"""Native norm wrappers (te_parallel.native.norm) on any machine: their one-line argument errors, the C
API's own checks, the fp64 backward references, the rule that picks the kernels (FP8 outputs only), the
autograd plumbing of te_parallel.ops.norm over them and its PyTorch fallback (GPU numerics:
tests/gpu/test_norm_kernel.py)."""
import pytest
import torch
import torch.nn.functional as F

from te_parallel import native
from te_parallel.native import norm as nn_
from te_parallel.ops import norm as norm_ops
from te_parallel.ops.cast import quantize
from tests.reference import rel_err

ONE_LINE = r"^[a-z_]+: [^\n]+; need [^\n]+$"


@pytest.mark.parametrize("x", [torch.randn(4, 8), torch.randn(4, 8).t(), torch.randn(2, 4, 8),
                               torch.randn(4, 8, dtype=torch.float64), torch.randn(0, 8)],
                         ids=["cpu", "non-contiguous", "3-D", "float64", "empty"])
def test_wrappers_reject_x_with_one_line(x):
    g = torch.ones(8)
    calls = [lambda: nn_.layer_norm_fwd(x, g, None, 1e-5), lambda: nn_.rms_norm_fwd(x, g, 1e-5),
             lambda: nn_.layer_norm_bwd(x, x, g, g, g), lambda: nn_.rms_norm_bwd(x, x, g, g)]
    for call in calls:
        with pytest.raises(ValueError, match=ONE_LINE) as info:
            call()
        assert "x is" in str(info.value) or "dy is" in str(info.value)
        assert "need a contiguous non-empty 2-D [rows, hidden] float32/float16/bfloat16 CUDA tensor" in str(info.value)


def test_c_api_checks_arguments_itself():
    """The kernels' own checks (for non-Python callers) need no GPU: they run before any CUDA call."""
    module = native.load()
    if module is None:
        pytest.skip("te_parallel._C is absent (built without nvcc)")
    with pytest.raises(RuntimeError, match=r"tep_norm_fwd: norm_type = 5; need TEP_LAYERNORM \(0\) or TEP_RMSNORM \(1\)"):
        module.norm_fwd(5, 4, 8, 1e-5, False, 16, 0, 0, 16, 0, 16, 0, 0, 0, 0, 0, 16, 0)
    with pytest.raises(RuntimeError, match=r"rows = 0, hidden = 8; need both >= 1"):
        module.norm_bwd_workspace_size(0, 0, 8, 0, 0)
    with pytest.raises(RuntimeError, match="mu NULL for RMSNorm"):
        module.norm_fwd(1, 4, 8, 1e-5, False, 16, 0, 0, 16, 0, 16, 0, 0, 0, 0, 16, 16, 0)
    with pytest.raises(RuntimeError, match="an FP8 output needs scale"):
        module.norm_fwd(0, 4, 8, 1e-5, False, 16, 0, 0, 16, 0, 16, 3, 0, 0, 0, 16, 16, 0)
    with pytest.raises(RuntimeError, match="x_dtype = 7, w_dtype = 0"):
        module.norm_bwd(0, 4, 8, False, 16, 0, 16, 16, 7, 16, 16, 16, 16, 0, 16, 1 << 20, 0)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_bwd_references_match_torch_autograd(zero_centered):
    torch.manual_seed(0)
    x, dy = torch.randn(6, 24, dtype=torch.float64), torch.randn(6, 24, dtype=torch.float64)
    w, b = torch.randn(24, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    g = w + 1 if zero_centered else w
    xt, gt, bt = (t.clone().requires_grad_(True) for t in (x, g, b))
    F.layer_norm(xt, (24,), gt, bt, 1e-5).backward(dy)
    dx, dw, db = norm_ops.layer_norm_bwd_reference(dy, x, w, b, 1e-5, zero_centered)
    assert rel_err(dx, xt.grad) < 1e-12 and rel_err(dw, gt.grad) < 1e-12 and rel_err(db, bt.grad) < 1e-12
    xt, gt = x.clone().requires_grad_(True), g.clone().requires_grad_(True)
    F.rms_norm(xt, (24,), gt, 1e-5).backward(dy)
    dx, dw = norm_ops.rms_norm_bwd_reference(dy, x, w, 1e-5, zero_centered)
    assert rel_err(dx, xt.grad) < 1e-12 and rel_err(dw, gt.grad) < 1e-12


def test_cpu_inputs_keep_the_pytorch_path():
    x, w = torch.randn(3, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    assert not nn_.usable(x, w, None)
    y = norm_ops.layer_norm(x, w, None, 1e-5)
    assert "NormFunction" not in str(y.grad_fn.next_functions) and "NormFunction" not in type(y.grad_fn).__name__


def test_high_precision_norm_rule(monkeypatch):
    """A high-precision norm is torch's forward; only where a gradient is wanted and the kernels can run
    does the backward go to the native kernel (the same forward bits either way)."""
    asked = []
    x, w, b = torch.randn(3, 8, requires_grad=True), torch.randn(8), torch.randn(8)
    plain = [norm_ops.layer_norm(x, w, b, 1e-5), norm_ops.rms_norm(x, w, 1e-5)]  # CPU: the kernels cannot run
    assert all("TorchNormNativeBackward" not in str(y.grad_fn.next_functions) for y in plain)
    monkeypatch.setattr(nn_, "usable", lambda *a: asked.append(a) or True)
    with torch.no_grad():  # no gradient wanted: not even asked
        norm_ops.layer_norm(x, w, b, 1e-5), norm_ops.rms_norm(x, w, 1e-5)
    norm_ops.rms_norm(x.detach(), w, 1e-5)
    assert asked == []
    hybrid = [norm_ops.layer_norm(x, w, b, 1e-5), norm_ops.rms_norm(x, w, 1e-5)]
    assert len(asked) == 2
    for y, want in zip(hybrid, plain):
        assert "TorchNormNativeBackward" in str(y.grad_fn.next_functions)
        assert torch.equal(y.detach(), want.detach())


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_fp8_entry_points_fall_back_to_torch(norm):
    """Where the kernels cannot run (CPU here) layer_norm_fp8 / rms_norm_fp8 quantize torch's norm, whose
    output is the carrier: gradients reach x, weight and bias through it."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 16), torch.randn(16), torch.randn(16)
    xa, wa, ba = (t.clone().requires_grad_(True) for t in (x, w, b))
    scale = torch.tensor(8.0)
    xr, wr, br = (t.double().requires_grad_(True) for t in (x, w, b))
    if norm == "LayerNorm":
        y8, carrier = norm_ops.layer_norm_fp8(xa, wa, ba, 1e-5, True, scale=scale, fp8_dtype=torch.float8_e4m3fn)
        y = norm_ops.layer_norm(x, w, b, 1e-5, True)
        ref = norm_ops.layer_norm_reference(xr, wr, br, 1e-5, True)
    else:
        y8, carrier = norm_ops.rms_norm_fp8(xa, wa, 1e-5, True, scale=scale, fp8_dtype=torch.float8_e4m3fn)
        y = norm_ops.rms_norm(x, w, 1e-5, True)
        ref = norm_ops.rms_norm_reference(xr, wr, 1e-5, True)
    q = quantize(y.reshape(6, 16), scale, torch.float8_e4m3fn, transpose=True)
    assert torch.equal(y8.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(y8.data_t.view(torch.uint8), q.data_t.view(torch.uint8)) and y8.scale_inv.item() == 0.125
    assert carrier.shape == (6, 16) and carrier.requires_grad and rel_err(carrier.detach(), ref.reshape(6, 16)) < 1e-5
    dy = torch.randn(6, 16)
    (carrier * dy).sum().backward()
    ref.reshape(6, 16).backward(dy.double())
    assert rel_err(xa.grad, xr.grad) < 1e-5 and rel_err(wa.grad, wr.grad) < 1e-5
    assert ba.grad is None if norm == "RMSNorm" else rel_err(ba.grad, br.grad) < 1e-5


def test_autograd_plumbing_with_reference_kernels(monkeypatch):
    """The autograd Functions (hp and FP8-with-carrier) route x, weight, bias gradients correctly: run
    on the CPU with the two kernel wrappers replaced by the fp64 references."""
    from te_parallel.ops.cast import quantize_reference

    def fwd(norm, x, gamma, beta, eps, zc, fp8, out_dtype):
        xd = x.double()
        if norm == "layer_norm":
            mu, y = xd.mean(-1), norm_ops.layer_norm_reference(x, gamma, beta, eps, zc)
            rs = 1 / torch.sqrt(((xd - mu[:, None]) ** 2).mean(-1) + eps)
        else:
            mu, y = None, norm_ops.rms_norm_reference(x, gamma, eps, zc)
            rs = 1 / torch.sqrt((xd * xd).mean(-1) + eps)
        if fp8 is not None:
            data = quantize_reference(y.float(), fp8.scale, fp8.fp8_dtype)
            out = (data, data.t().contiguous() if fp8.transpose else None)
        else:
            out = y.to(out_dtype or x.dtype)
        return out, None if mu is None else mu.float(), rs.float()

    def bwd(norm, dy, x, mu, rs, gamma, zc, with_dbeta):
        if norm == "layer_norm":
            beta = torch.zeros_like(gamma) if with_dbeta else None
            dx, dg, db = norm_ops.layer_norm_bwd_reference(dy, x, gamma, beta, 1e-5, zc)
        else:
            (dx, dg), db = norm_ops.rms_norm_bwd_reference(dy, x, gamma, 1e-5, zc), None
        return dx.to(x.dtype), dg.to(gamma.dtype), None if db is None else db.to(gamma.dtype)

    monkeypatch.setattr(nn_, "forward", fwd)
    monkeypatch.setattr(nn_, "backward", bwd)
    monkeypatch.setattr(nn_, "usable", lambda *a: True)  # the CPU tensors take the "kernels" above
    x, w, b = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)
    dy = torch.randn(2, 3, 8)
    xr, wr, br = (t.double().requires_grad_(True) for t in (x, w, b))
    norm_ops.layer_norm_reference(xr, wr, br, 1e-5).backward(dy.double())
    for variant in ("hp", "fp8"):
        xa, wa, ba = (t.clone().requires_grad_(True) for t in (x, w, b))
        if variant == "hp":
            y = norm_ops.native_layer_norm(xa, wa, ba, 1e-5)
            assert y.shape == x.shape
            y.backward(dy)
        else:
            y8, carrier = norm_ops.layer_norm_fp8(xa, wa, ba, 1e-5, scale=torch.tensor(4.0),
                                                  fp8_dtype=torch.float8_e4m3fn)
            assert y8.data.shape == (6, 8) and y8.data_t.shape == (8, 6) and not y8.data.requires_grad
            assert carrier.shape == (6, 8) and carrier.stride() == (0, 0) and y8.scale_inv.item() == 0.25
            (carrier * dy.reshape(6, 8)).sum().backward()
        for got, ref in ((xa, xr), (wa, wr), (ba, br)):
            assert rel_err(got.grad, ref.grad) < 1e-6, variant
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y8, carrier = norm_ops.rms_norm_fp8(xa, wa, 1e-5, scale=torch.tensor(1.0), fp8_dtype=torch.float8_e5m2,
                                        transpose=False)
    assert y8.data_t is None
    (carrier * dy.reshape(6, 8)).sum().backward()
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    norm_ops.rms_norm_reference(xr, wr, 1e-5).backward(dy.double())
    assert rel_err(xa.grad, xr.grad) < 1e-6 and rel_err(wa.grad, wr.grad) < 1e-6
