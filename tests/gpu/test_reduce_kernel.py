"""tep_reduce_sum (the owner's fp32 sum of reduce-scatter partials) vs its PyTorch reference, bit for bit."""
import pytest
import torch

from te_parallel import _native
from te_parallel.parallel.ub_transport import _TEP_DTYPES, reduce_sum_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not _native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("numel", [1, 7, 8, 13, 4096, 1 << 20, (1 << 20) + 3])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("in_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_reduce_matches_reference(numel, n, in_dtype, out_dtype):
    g = torch.Generator(device="cuda").manual_seed(numel + n)
    parts = [(torch.randn(numel, device="cuda", generator=g) * 10).to(in_dtype) for _ in range(n)]
    out = torch.full((numel,), float("nan"), device="cuda", dtype=out_dtype)  # poisoned
    _native.load().reduce_sum([p.data_ptr() for p in parts], _TEP_DTYPES[in_dtype], out.data_ptr(),
                              _TEP_DTYPES[out_dtype], numel, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(out, reduce_sum_reference(parts, out_dtype))


def test_unaligned_inputs_take_the_scalar_path():
    base = torch.randn(4097, device="cuda").to(torch.bfloat16)
    parts = [base[1:], base[:-1]]  # 2-byte offset: not 16-byte aligned
    out = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
    _native.load().reduce_sum([p.data_ptr() for p in parts], _TEP_DTYPES[torch.bfloat16], out.data_ptr(),
                              _TEP_DTYPES[torch.bfloat16], 4096, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(out, reduce_sum_reference(parts, torch.bfloat16))


def test_bad_arguments_raise():
    with pytest.raises(RuntimeError, match="need 1..8 inputs"):
        _native.load().reduce_sum([], 2, 0, 2, 4, 0)
