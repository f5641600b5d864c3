"""Native bias + activation kernels (te_parallel.native.activation: forward; dact + dbias + FP8
cast-transpose backward), and the autograd Function and FP8 entry points over them (te_parallel.ops.activation).

High-precision outputs vs fp64 references built from the formulas (te_parallel.ops.activation), with
the tolerance "max |error| <= 3 x the max |error| of the same op done with PyTorch ops in the same dtype,
+ 1 ulp of the largest reference value" (torch's error includes rounding x + bias to the dtype, which
the kernels do not). FP8 outputs bit for bit vs quantize_reference of the kernels' own high-precision
result (same call), transposes and amax exactly. Outputs come from poisoned memory (0xFF bytes: NaN in
every float and FP8 format), so an element the kernel fails to write shows up.
"""
import pytest
import torch

from te_parallel import native
from te_parallel.native import activation as na
from te_parallel.native import cast as native_cast
from te_parallel.ops import activation as act_ops
from te_parallel.ops.cast import quantize_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

ACTS = act_ops.ACTIVATIONS
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (rows, n): n = output columns (x has n columns, 2n for a gated activation). 1 row; odd rows; n not a
# multiple of 8 (13, and 12: a gated x of 24 columns whose halves are not 16-byte aligned) or of 128.
SHAPES = [(1, 13), (1, 4104), (7, 13), (9, 12), (129, 8), (31, 200), (65, 1000), (300, 4104), (8192, 4096)]
FP8_SHAPES = [(1, 13), (7, 13), (9, 12), (129, 8), (65, 1000), (3, 4104), (256, 4096)]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _ids(shapes):
    return [f"{r}x{n}" for r, n in shapes]


def _poison(nbytes: int) -> None:
    """Leave the caching allocator's free blocks (small and large pool) full of 0xFF bytes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full((1 << 19,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(16)]
    blocks.append(torch.full((max(4 * nbytes, 4 << 20),), 0xFF, dtype=torch.uint8, device="cuda"))
    del blocks


def _inputs(name, shape, dtype, with_bias, seed=0):
    rows, n = shape
    cols = 2 * n if act_ops.is_gated(name) else n
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
    bias = (torch.randn(cols, device="cuda", generator=g) * 0.5).to(dtype) if with_bias else None
    dy = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
    return x, bias, dy


def _assert_close(out, ref, torch_out, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element left unwritten?)"
    err = (out.double() - ref).abs().max().item()
    torch_err = (torch_out.double() - ref).abs().max().item()
    ulp = torch.finfo(dtype).eps * ref.abs().max().item()
    # fp32: the kernel's tanh/exp-based derivatives differ from torch's formulas by a few fp32 ulps
    # (measured up to ~7 ulps of max |ref| for the gelu derivative on an H200); 16-bit dtypes: 1 ulp.
    tol = 3 * torch_err + (8 if dtype == torch.float32 else 1) * ulp
    assert err <= tol, (f"{what}: max |error| vs fp64 {err:.3e} > {tol:.3e} (torch's own {torch_err:.3e}, "
                        f"1 ulp of max |ref| {ulp:.3e})")


def _torch_grads(name, x, bias, dy):
    xt = x.clone().requires_grad_(True)
    bt = bias.clone().requires_grad_(True) if bias is not None else None
    act_ops.bias_activation_torch(name, xt, bt).backward(dy)
    dbias = bt.grad if bt is not None else xt.grad.float().sum(0).to(x.dtype)
    return xt.grad, dbias


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", ACTS)
def test_forward_vs_fp64(name, with_bias, dtype, shape):
    x, bias, _ = _inputs(name, shape, dtype, with_bias)
    _poison(x.numel() * x.element_size())
    y, none, none_t = na.bias_activation_forward(name, x, bias)
    assert none is None and none_t is None and y.shape == (shape[0], shape[1]) and y.dtype == dtype
    _assert_close(y, act_ops.bias_activation_reference(name, x, bias), act_ops.bias_activation_torch(name, x, bias),
                  dtype, "y")


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", ACTS)
def test_backward_vs_fp64(name, with_bias, dtype, shape):
    x, bias, dy = _inputs(name, shape, dtype, with_bias)
    _poison(2 * x.numel() * x.element_size())
    dx, dbias, none, none_t = na.dbias_dactivation_backward(name, dy, x, bias, need_dbias=True)
    assert none is None and none_t is None and dx.shape == x.shape and dbias.shape == (x.shape[1],)
    assert dbias.dtype == dtype
    ref_dx, ref_dbias = act_ops.dbias_dactivation_reference(name, dy, x, bias)
    torch_dx, torch_dbias = _torch_grads(name, x, bias, dy)
    _assert_close(dx, ref_dx, torch_dx, dtype, "dx")
    _assert_close(dbias, ref_dbias, torch_dbias, dtype, "dbias")
    # dbias is the column sum of the kernel's own dx: fp32 accumulation error (a bound on the number of
    # additions on any path: 8 in a thread, 3 in the block, row tiles / 8 + 8 in the final kernel), then
    # one rounding to dtype.
    own = dx.double().sum(0)
    adds = 8 + 3 + (x.shape[0] + 63) // 64 // 8 + 1 + 8
    bound = torch.finfo(dtype).eps * own.abs() + adds * 2.0**-24 * dx.double().abs().sum(0)
    assert ((dbias.double() - own).abs() <= bound).all()
    again = na.dbias_dactivation_backward(name, dy, x, bias, need_dbias=True, high_precision=False)[1]
    assert torch.equal(again, dbias), "dbias is not deterministic"


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=_ids(FP8_SHAPES))
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_forward_fp8_bit_exact(name, dtype, fp8, shape):
    x, bias, _ = _inputs(name, shape, dtype, True, seed=1)
    x.view(-1)[0] = 100.0  # saturates E4M3 at this scale
    if act_ops.is_gated(name):
        x[0, shape[1]] = 100.0
    scale = torch.tensor([8.0], device="cuda")
    amax = torch.tensor([0.25], device="cuda")
    _poison(4 * x.numel() * x.element_size())
    y, data, data_t = na.bias_activation_forward(name, x, bias, fp8_dtype=fp8, scale=scale, amax_out=amax,
                                                 transpose=True)
    ref = quantize_reference(y.cpu(), scale.cpu(), fp8)
    assert torch.equal(data.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.cpu().view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert amax.item() == max(0.25, y.float().abs().max().item())
    none, data_only, none_t = na.bias_activation_forward(name, x, bias, high_precision=False, fp8_dtype=fp8,
                                                         scale=scale)
    assert none is None and none_t is None
    assert torch.equal(data_only.view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=_ids(FP8_SHAPES))
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_backward_fp8_bit_exact(name, dtype, fp8, shape):
    x, bias, dy = _inputs(name, shape, dtype, True, seed=2)
    dy.view(-1)[0] = 200.0
    scale = torch.tensor([8.0], device="cuda")
    amax = torch.tensor([0.25], device="cuda")
    _poison(6 * x.numel() * x.element_size())
    dx, dbias, data, data_t = na.dbias_dactivation_backward(name, dy, x, bias, need_dbias=True, fp8_dtype=fp8,
                                                            scale=scale, amax_out=amax, transpose=True)
    ref = quantize_reference(dx.cpu(), scale.cpu(), fp8)
    assert torch.equal(data.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.cpu().view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert amax.item() == max(0.25, dx.float().abs().max().item())
    # FP8 + dbias without dx (the fused fc1 backward): same bytes, same dbias bits
    none, dbias2, data2, data2_t = na.dbias_dactivation_backward(name, dy, x, bias, need_dbias=True,
                                                                 high_precision=False, fp8_dtype=fp8, scale=scale,
                                                                 transpose=True)
    assert none is None and torch.equal(dbias2, dbias)
    assert torch.equal(data2.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(data2_t.view(torch.uint8), data_t.view(torch.uint8))


# Backward calls without a transposed copy or dbias, on 16-byte rows (n % 8 == 0), take the row kernel;
# asking for the transpose sends the same call to the tiled kernel. Odd rows (the row kernel takes 2 per
# thread), n/8 not a multiple of its 128 threads, more row pairs than the grid's 65535.
ROW_SHAPES = [(1, 8), (7, 200), (129, 1000), (300, 4104), (2048, 4096), (2 * 65535 + 37, 8)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=_ids(ROW_SHAPES))
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_backward_rows_path_matches_tiled(name, dtype, fp8, shape):
    x, bias, dy = _inputs(name, shape, dtype, shape[0] % 2 == 1, seed=4)
    dy.view(-1)[0] = 200.0
    scale = torch.tensor([8.0], device="cuda")
    amax_rows, amax_tiled = torch.tensor([0.25], device="cuda"), torch.tensor([0.25], device="cuda")
    _poison(6 * x.numel() * x.element_size())
    dx, _, data, none_t = na.dbias_dactivation_backward(name, dy, x, bias, fp8_dtype=fp8, scale=scale,
                                                        amax_out=amax_rows)
    assert none_t is None
    dx_t, _, data_t, data_tt = na.dbias_dactivation_backward(name, dy, x, bias, fp8_dtype=fp8, scale=scale,
                                                             amax_out=amax_tiled, transpose=True)
    assert data_tt is not None
    assert torch.equal(dx.view(torch.uint8), dx_t.view(torch.uint8)), "dx differs from the tiled kernel's"
    assert torch.equal(data.view(torch.uint8), data_t.view(torch.uint8)), "FP8 bytes differ from the tiled kernel's"
    assert torch.equal(amax_rows, amax_tiled)
    if shape[0] <= 4096:
        ref_dx, _ = act_ops.dbias_dactivation_reference(name, dy, x, bias)
        _assert_close(dx, ref_dx, _torch_grads(name, x, bias, dy)[0], dtype, "dx")
    # high precision only, and in place over x (the MLP backward writes the gradient over the activation's input)
    hp = na.dbias_dactivation_backward(name, dy, x, bias)[0]
    assert torch.equal(hp.view(torch.uint8), dx.view(torch.uint8))
    inplace = x.clone()
    na.dbias_dactivation_backward(name, dy, inplace, bias, dx_out=inplace)
    assert torch.equal(inplace.view(torch.uint8), dx.view(torch.uint8))
    # FP8 rows into rows of a larger tensor, as the chunked backward asks for them
    big = torch.full((shape[0] + 3, x.shape[1]), 0x7F, dtype=torch.uint8, device="cuda").view(fp8)
    na.dbias_dactivation_backward(name, dy, x, bias, high_precision=False, fp8_dtype=fp8, scale=scale,
                                  fp8_out=big[1:1 + shape[0]])
    assert torch.equal(big[1:1 + shape[0]].view(torch.uint8), data.view(torch.uint8))
    assert (big[0].view(torch.uint8) == 0x7F).all() and (big[1 + shape[0]:].view(torch.uint8) == 0x7F).all()


def test_backward_rows_path_amax_propagates_nan():
    x, _, dy = _inputs("swiglu", (33, 64), torch.bfloat16, False)
    dy[5, 7] = float("nan")
    amax = torch.tensor([1e6], device="cuda")
    scale = torch.tensor([1.0], device="cuda")
    na.dbias_dactivation_backward("swiglu", dy, x, None, high_precision=False, fp8_dtype=torch.float8_e4m3fn,
                                  scale=scale, amax_out=amax)
    assert torch.isnan(amax).item()


@pytest.mark.parametrize("name", ["gelu", "swiglu"])
def test_fp8_entry_points_match_quantize(name):
    from te_parallel.ops.cast import quantize

    x, bias, dy = _inputs(name, (96, 256), torch.bfloat16, True, seed=3)
    scale = torch.tensor(4.0, device="cuda")
    f8 = act_ops.bias_activation_fp8(name, x, bias, scale, torch.float8_e4m3fn)
    q = quantize(na.bias_activation_forward(name, x, bias)[0], scale, torch.float8_e4m3fn, transpose=True)
    assert torch.equal(f8.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(f8.data_t.view(torch.uint8), q.data_t.view(torch.uint8))
    assert f8.scale_inv.item() == (1.0 / scale).item()
    g8, dbias = act_ops.dbias_dactivation_fp8(name, dy, x, bias, scale, torch.float8_e5m2)
    dx, dbias_ref, _, _ = na.dbias_dactivation_backward(name, dy, x, bias, need_dbias=True)
    q = quantize(dx, scale, torch.float8_e5m2, transpose=True)
    assert torch.equal(g8.data_t.view(torch.uint8), q.data_t.view(torch.uint8)) and torch.equal(dbias, dbias_ref)


@pytest.mark.parametrize("name", ACTS)
def test_autograd_path(name):
    """apply_activation / bias_activation on CUDA go through the kernels, 3-D input, within tolerance."""
    n = 24
    cols = 2 * n if act_ops.is_gated(name) else n
    x = (torch.randn(5, 3, cols, device="cuda") * 3).to(torch.bfloat16).requires_grad_(True)
    bias = (torch.randn(cols, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    y = act_ops.bias_activation(name, x, bias)
    assert type(y.grad_fn).__name__.startswith("_BiasActivationFunction")
    dy = torch.randn_like(y)
    y.backward(dy)
    x2d, dy2d = x.detach().reshape(-1, cols), dy.reshape(-1, n)
    ref_y = act_ops.bias_activation_reference(name, x2d, bias.detach())
    ref_dx, ref_db = act_ops.dbias_dactivation_reference(name, dy2d, x2d, bias.detach())
    torch_dx, torch_db = _torch_grads(name, x2d, bias.detach(), dy2d)
    _assert_close(y.detach().reshape(-1, n), ref_y, act_ops.bias_activation_torch(name, x2d, bias.detach()),
                  torch.bfloat16, "y")
    _assert_close(x.grad.reshape(-1, cols), ref_dx, torch_dx, torch.bfloat16, "dx")
    _assert_close(bias.grad, ref_db, torch_db, torch.bfloat16, "dbias")
    # no bias, non-contiguous input, dy broadcast from a sum (stride 0)
    xt = x.detach().transpose(0, 1).requires_grad_(True)
    act_ops.apply_activation(name, xt).sum().backward()
    ref_dx, _ = act_ops.dbias_dactivation_reference(name, torch.ones(15, n, device="cuda"),
                                                    xt.detach().reshape(-1, cols))
    assert (xt.grad.reshape(-1, cols).double() - ref_dx).abs().max().item() <= 2**-7 * ref_dx.abs().max().item()


def test_row_tiles_beyond_grid_limit():
    """More than 65535 row tiles of 64 rows: the grid strides over them (activation and cast kernels)."""
    rows = 65535 * 64 + 100
    x = (torch.randn(rows, 8, device="cuda") * 3).to(torch.bfloat16)
    scale, amax = torch.tensor([2.0], device="cuda"), torch.zeros(1, device="cuda")
    y, y8, _ = na.bias_activation_forward("gelu", x, None, fp8_dtype=torch.float8_e4m3fn, scale=scale, amax_out=amax)
    _assert_close(y, act_ops.bias_activation_reference("gelu", x), act_ops.bias_activation_torch("gelu", x),
                  torch.bfloat16, "y")
    ref = quantize_reference(y, scale, torch.float8_e4m3fn)
    assert torch.equal(y8.view(torch.uint8), ref.view(torch.uint8))
    assert amax.item() == y.float().abs().max().item()
    data, data_t = native_cast.cast_transpose_amax(x, scale, torch.float8_e4m3fn, None, transpose=True)
    ref = quantize_reference(x, scale, torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))


def test_amax_propagates_nan():
    x = torch.randn(33, 70, device="cuda", dtype=torch.bfloat16)
    x[5, 7] = float("nan")
    amax = torch.tensor([1e6], device="cuda")
    na.bias_activation_forward("gelu", x, None, high_precision=False, amax_out=amax)
    assert torch.isnan(amax).item()


def test_bad_arguments():
    x = torch.randn(4, 6, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="need an even number"):
        na.bias_activation_forward("swiglu", torch.randn(4, 7, device="cuda"))
    with pytest.raises(ValueError, match="need one of"):
        na.bias_activation_forward("tanh", x)
    with pytest.raises(ValueError, match=r"bias is \(6,\) torch.float32.*need a contiguous \[6\] torch.bfloat16"):
        na.bias_activation_forward("gelu", x, torch.zeros(6, device="cuda"))
    with pytest.raises(ValueError, match="x is .*non-contiguous"):
        na.bias_activation_forward("gelu", x.t())
    with pytest.raises(ValueError, match=r"dy is \(4, 6\).*need a contiguous \[4, 3\]"):
        na.dbias_dactivation_backward("geglu", x, x)
    with pytest.raises(ValueError, match="scale is"):
        na.bias_activation_forward("gelu", x, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="ask for nothing"):
        na.bias_activation_forward("gelu", x, high_precision=False)
