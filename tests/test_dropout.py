"""te_parallel.ops.dropout.dropout_add off the native kernel (CPU here; the kernel: tests/gpu/test_dropout_cuda.py):
torch's dropout and add, drawing from torch's generator as F.dropout does."""
import torch
import torch.nn.functional as F

from te_parallel.ops import dropout as dropout_ops


def test_torch_path_on_the_cpu():
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    assert not dropout_ops.fused(x, r, 0.2, training=True)
    torch.manual_seed(5)
    got = dropout_ops.dropout_add(x, r, 0.2)
    torch.manual_seed(5)
    assert torch.equal(got, r + F.dropout(x, p=0.2, training=True))
    assert torch.equal(dropout_ops.dropout_add(x, r, 0.2, training=False), r + x)
    xg = x.clone().requires_grad_(True)
    dropout_ops.dropout_add(xg, r, 0.5).sum().backward()
    assert set(xg.grad.unique().tolist()) <= {0.0, 2.0}
