"""The MoE row kernels (te_parallel.ops.moe_rows) on CUDA: the cases of tests/test_moe_rows.py through the public
functions (which take the Triton kernels on CUDA tensors), and an MoE-shaped permute -> unpermute round trip with
probs, outputs and gradients, against the fp64 torch path on the CPU. tests/gpu/test_moe_routing_cuda.py runs
the permutation tests themselves on CUDA."""
from __future__ import annotations

import pytest
import torch

import te_parallel as te
from te_parallel.ops import moe_rows
from tests.test_moe_rows import run_cases


@pytest.fixture
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    if moe_rows.triton is None:
        pytest.skip("needs triton (import triton failed)")
    return "cuda"


def test_kernels_against_fp64_loops(cuda):
    assert moe_rows.usable(torch.zeros(1, device=cuda, dtype=torch.bfloat16))
    run_cases(moe_rows.gather_rows, moe_rows.segment_sum_rows, device=cuda, hiddens=(3, 2050))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("drop", [False, True])
def test_moe_shaped_round_trip(dtype, drop, cuda):
    """T=1024 tokens, 32 experts, top-4, hidden 1024: permute -> (rows · 1.5) -> unpermute with probs, fwd and bwd,
    against the same on the CPU in fp64; with `drop` a quarter of the rows dropped (num_out_tokens smaller)."""
    tokens, experts, topk, hidden = 1024, 32, 4, 1024
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(tokens, experts, generator=gen)
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.where(routing_map, scores, 0.0)
    x = torch.randn(tokens, hidden, generator=gen)
    up = torch.randn(tokens, hidden, generator=gen)
    num_out = tokens * topk - (tokens * topk // 4 if drop else 0)

    def run(device, dt):
        xi = x.to(device, dt).requires_grad_(True)
        pi = probs.to(device, torch.float64 if dt == torch.float64 else torch.float32).requires_grad_(True)
        permuted, row_id_map = te.moe_permute(xi, routing_map.to(device), num_out_tokens=num_out)
        out = te.moe_unpermute(permuted * 1.5, row_id_map, merging_probs=pi)
        out.backward(up.to(device, dt))
        return [t.detach().double().cpu() for t in (permuted, out, xi.grad, pi.grad)]

    want = run("cpu", torch.float64)
    got = run(cuda, dtype)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    for name, g, w in zip(("permuted", "out", "grad x", "grad probs"), got, want):
        err = (g - w).abs().max().item() / max(w.abs().max().item(), 1.0)
        assert err < tol, (name, err)
    assert all(torch.equal(a, b) for a, b in zip(got, run(cuda, dtype))), "sums must be deterministic"
