"""Deferred init on CUDA (the CPU suite's tests), and the generator giving the CPU's bits on the GPU."""
import pytest
import torch

import te_parallel as te
from te_parallel.parallel.sharding import split_layout
from tests.test_deferred_init import *  # noqa: F401,F403


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_values_equal_cpu_values(dtype, device):
    """A shard generated on the GPU is the CPU's: bit for bit in fp32 and bf16 (the values are rounded from
    fp64); in fp64 itself the GPU's fused multiply-adds may move the last bits (measured on an H100:
    13479 of 2048000 elements, each within a few ulps)."""
    layout = split_layout((4096, 1000), 0, 1, 2, blocks=[2048, 2048])
    out = []
    for dev in ("cpu", device):
        torch.manual_seed(9)
        t = torch.empty(layout.local_shape, dtype=dtype, device=dev)
        te.init.normal_(0.02).fill_(t, layout)
        out.append(t.cpu())
    if dtype == torch.float64:
        torch.testing.assert_close(out[1], out[0], rtol=1e-13, atol=1e-15)
    else:
        assert torch.equal(out[0], out[1]), f"{(out[0] != out[1]).sum()} elements differ"
