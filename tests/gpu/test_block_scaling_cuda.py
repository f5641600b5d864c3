"""tests/test_block_scaling.py on CUDA (cuBLASLt's block-scaled GEMMs through torch._scaled_mm, the Triton
quantization kernels), plus what only a GPU shows: every GEMM layout and operand-granularity pair against the
CPU path on the same quantized operands, ragged and unaligned shapes, and row slices of a quantized gradient."""
import pytest
import torch

from te_parallel.fp8.blockwise import quantize_blockwise
from te_parallel.ops import gemm
from tests.reference import rel_err
from tests.test_block_scaling import *  # noqa: F401,F403

FP8 = torch.float8_e4m3fn


def _to(q, device):
    fields = [None if t is None else t.to(device) for t in (q.data, q.scale_inv, q.data_t, q.scale_inv_t)]
    return type(q)(*fields, q.block_dim, q.fp8_dtype, q.shape)


@pytest.mark.parametrize("m, k, n", [(256, 512, 384), (4096, 4096, 4096), (200, 304, 136), (48, 1000, 272),
                                     (128, 128, 16), (512, 512, 256)])
@pytest.mark.parametrize("x_dim, w_dim", [(1, 2), (1, 1), (2, 1)])
def test_three_gemms_match_the_cpu_path(m, k, n, x_dim, w_dim, device):
    """fprop, dgrad and wgrad on the GPU against the CPU path on the very same quantized operands (the GPU's
    quantization is the CPU's bit for bit: tests/gpu/test_block_cast_cuda.py)."""
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 6, (m, 1), generator=g)).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    qx = quantize_blockwise(x.cuda(), FP8, x_dim, columnwise=True)
    qw = quantize_blockwise(w.cuda(), FP8, w_dim, columnwise=True)
    qdy = quantize_blockwise(dy.cuda(), FP8, 1, columnwise=True)
    pairs = {"fprop": (gemm.fprop, qx, qw), "dgrad": (gemm.dgrad, qdy, qw), "wgrad": (gemm.wgrad, qdy, qx)}
    for what, (fn, a, b) in pairs.items():
        if what == "fprop" and x_dim == 2 and w_dim == 2:
            continue
        got = fn(a, b, torch.float32)
        want = fn(_to(a, "cpu"), _to(b, "cpu"), torch.float32)
        assert rel_err(got.cpu(), want) < 5e-4, f"{what}: {rel_err(got.cpu(), want):.2e}"


def test_row_slices_of_a_gradient(device):
    """dgrad of row slices (the fused MLP backward's chunks) equals the rows of the whole dgrad."""
    dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    qdy = quantize_blockwise(dy, FP8, 1)
    qw = quantize_blockwise(w, FP8, 2).with_transpose()
    whole = gemm.dgrad(qdy, qw, torch.bfloat16)
    for r0 in (0, 128, 384):
        part = gemm.dgrad(qdy.row_slice(r0, r0 + 128), qw, torch.bfloat16)
        assert torch.equal(part, whole[r0:r0 + 128]), r0
