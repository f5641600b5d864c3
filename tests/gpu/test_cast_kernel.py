"""Native one-pass FP8 cast (+transpose, +amax) vs the PyTorch path, bit for bit, on awkward shapes."""
import pytest
import torch

from te_parallel import native
from te_parallel.native import cast as native_cast
from te_parallel.ops.cast import quantize_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

SHAPES = [(1, 1), (1, 200), (7, 13), (63, 65), (64, 64), (129, 8), (300, 1000), (2048, 4096), (3, 4104)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cast_matches_reference(shape, dtype, fp8):
    torch.cuda.empty_cache()
    poison = torch.full((sum(shape) * 4096,), 0x7B, dtype=torch.uint8, device="cuda")  # reused by the outputs
    del poison
    x = (torch.randn(shape, device="cuda") * 40).to(dtype)
    x.view(-1)[0] = 3e4 if dtype != torch.float16 else 6e4  # saturates
    scale = torch.tensor(3.3, device="cuda")
    amax = torch.tensor([0.25], device="cuda")
    scale_inv = torch.full((), float("nan"), device="cuda")
    data, data_t = native_cast.cast_transpose_amax(x, scale, fp8, amax, transpose=True, scale_inv_out=scale_inv)
    assert torch.equal(scale_inv, 1.0 / scale)  # bit for bit the torch reciprocal
    ref = quantize_reference(x.cpu(), scale.cpu(), fp8)
    assert torch.equal(data.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.cpu().view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert amax.item() == max(0.25, x.float().abs().max().item())
    data2, none = native_cast.cast_transpose_amax(x, scale, fp8, None, transpose=False)
    assert none is None and torch.equal(data2.view(torch.uint8), data.view(torch.uint8))
    # transposed copy only, with the scale's snapshot (how backward re-encodes a weight's Wᵀ)
    snap = torch.full((), float("nan"), device="cuda")
    none, t_only = native_cast.cast_transpose_amax(x, scale, fp8, None, transpose=True, rowwise=False, scale_out=snap)
    assert none is None and torch.equal(t_only.view(torch.uint8), data_t.view(torch.uint8))
    assert torch.equal(snap, scale)


def test_amax_propagates_nan_and_keeps_larger_previous():
    x = torch.randn(33, 70, device="cuda", dtype=torch.bfloat16)
    amax = torch.tensor([1e6], device="cuda")
    native_cast.cast_transpose_amax(x, torch.tensor(1.0, device="cuda"), torch.float8_e4m3fn, amax, transpose=False)
    assert amax.item() == 1e6
    x[5, 7] = float("nan")
    data, _ = native_cast.cast_transpose_amax(x, torch.tensor(1.0, device="cuda"), torch.float8_e4m3fn, amax,
                                              transpose=False)
    assert torch.isnan(amax).item() and torch.isnan(data[5, 7].float()).item()


def test_bad_arguments():
    with pytest.raises(ValueError, match="need a contiguous non-empty 2-D"):
        native_cast.cast_transpose_amax(torch.randn(4, 4, device="cuda").t(), torch.tensor(1.0, device="cuda"),
                                        torch.float8_e4m3fn, None, transpose=False)
    with pytest.raises(ValueError, match="rowwise=False, transpose=False"):
        native_cast.cast_transpose_amax(torch.randn(4, 4, device="cuda"), torch.tensor(1.0, device="cuda"),
                                        torch.float8_e4m3fn, None, transpose=False, rowwise=False)
    with pytest.raises(ValueError, match="dbias_out goes with the row-wise cast"):
        native_cast.cast_transpose_amax(torch.randn(4, 4, device="cuda"), torch.tensor(1.0, device="cuda"),
                                        torch.float8_e4m3fn, None, True, None, torch.empty(4, device="cuda"), rowwise=False)


@pytest.mark.parametrize("shape", SHAPES + [(8, 3), (4104, 16)], ids=[f"{r}x{c}" for r, c in SHAPES + [(8, 3), (4104, 16)]])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transpose_fp8_matches_torch(shape, fp8):
    torch.cuda.empty_cache()
    poison = torch.full((sum(shape) * 4096,), 0x7B, dtype=torch.uint8, device="cuda")  # reused by the output
    del poison
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(fp8)
    out = native_cast.transpose_fp8(data)
    assert out.shape == (shape[1], shape[0]) and out.dtype == fp8 and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), data.view(torch.uint8).t().contiguous())


def test_transpose_fp8_unaligned_view_and_float8tensor():
    """A row slice at an odd byte offset takes the element path; Float8Tensor.transposed() uses the kernel."""
    from te_parallel.fp8.tensor import Float8Tensor

    base = torch.randint(0, 256, (65, 64), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    flat = base.view(-1)[3 : 3 + 64 * 64].view(64, 64)  # contiguous, 3 bytes off alignment
    assert torch.equal(native_cast.transpose_fp8(flat).view(torch.uint8), flat.view(torch.uint8).t().contiguous())
    q = Float8Tensor(base, torch.tensor(1.0, device="cuda"))
    assert torch.equal(q.transposed().view(torch.uint8), base.view(torch.uint8).t().contiguous())


def test_transpose_fp8_bad_arguments():
    with pytest.raises(ValueError, match="need a contiguous non-empty 2-D FP8 CUDA tensor"):
        native_cast.transpose_fp8(torch.zeros(4, 4, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="need a contiguous non-empty 2-D FP8 CUDA tensor"):
        native_cast.transpose_fp8(torch.zeros(4, 8, device="cuda").to(torch.float8_e4m3fn).t())


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_dbias_matches_reference(shape, dtype):
    """The fused column sums: within fp32 summation error of the fp64 sum, and the FP8 outputs, amax and
    scale_inv the same bytes as without them."""
    torch.cuda.empty_cache()
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    scale = torch.tensor(1.7, device="cuda")
    amax, amax2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    dbias = torch.full((shape[1],), float("nan"), device="cuda", dtype=dtype)
    data, data_t = native_cast.cast_transpose_amax(x, scale, torch.float8_e5m2, amax, True, None, dbias)
    plain, plain_t = native_cast.cast_transpose_amax(x, scale, torch.float8_e5m2, amax2, True)
    assert torch.equal(data.view(torch.uint8), plain.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), plain_t.view(torch.uint8)) and torch.equal(amax, amax2)
    ref = x.double().sum(0)
    tol = shape[0] * 2e-7 * x.double().abs().sum(0) + (ref.abs() * torch.finfo(dtype).eps if dtype != torch.float32 else 0)
    assert ((dbias.double() - ref).abs() <= tol + 1e-30).all()
    again = torch.empty_like(dbias)
    native_cast.cast_transpose_amax(x, scale, torch.float8_e5m2, None, False, None, again)
    assert torch.equal(again, dbias)  # deterministic, with or without the transposed output


def test_cast_dbias_bad_arguments():
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"need a contiguous \[16\]"):
        native_cast.cast_transpose_amax(x, torch.tensor(1.0, device="cuda"), torch.float8_e5m2, None, False, None,
                                        torch.empty(8, device="cuda"))
