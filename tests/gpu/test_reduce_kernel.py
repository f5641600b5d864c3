"""tep_reduce_sum (the owner's fp32 sum of reduce-scatter partials) vs its PyTorch reference, bit for bit."""
import pytest
import torch

from te_parallel import native
from te_parallel.native import comm_overlap as native_comm
from te_parallel.parallel.ub_transport import reduce_sum_reference

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
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
    native_comm.reduce_sum(parts, out, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(out, reduce_sum_reference(parts, out_dtype))


def test_unaligned_inputs_take_the_scalar_path():
    base = torch.randn(4097, device="cuda").to(torch.bfloat16)
    parts = [base[1:], base[:-1]]  # 2-byte offset: not 16-byte aligned
    out = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
    native_comm.reduce_sum(parts, out, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(out, reduce_sum_reference(parts, torch.bfloat16))


def test_bad_arguments_raise():
    out = torch.empty(4, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="need 1..8 inputs"):  # the C API's own check
        native_comm.reduce_sum([], out, 0)
    with pytest.raises(ValueError, match=r"reduce_sum: parts\[1\] is \(5,\) torch.bfloat16 .*need a contiguous "
                                         r"torch.bfloat16 CUDA tensor of 4 elements"):
        native_comm.reduce_sum([out, torch.empty(5, device="cuda", dtype=torch.bfloat16)], out, 0)
