"""The row movements of MoE routing (te_parallel.ops.moe_rows): the torch references against plain fp64 loops,
and the Triton kernels against the references under the Triton interpreter (CPU) and on the GPU
(tests/gpu/test_moe_rows_cuda.py runs the same cases on CUDA tensors).

Cases: every token with exactly k rows (the MoE layer's case), a general layout with dropped rows, tokens with
no row and rows no token takes (padding), one token, no rows; bf16 / fp32 / fp64 rows; hidden sizes below,
at and past one tile."""
from __future__ import annotations

import pytest
import torch

from te_parallel.ops import moe_rows
from te_parallel.ops.moe_permute import _by_token, _sources, _token_of
from tests import triton_interpreter

F64 = torch.float64


def routing_case(kind: str, num_tokens: int, experts: int, topk: int, seed: int = 0):
    """(row_id_map [N, E], num_rows) of a mask routing: "exact" every token has topk rows; "general" random
    routing with a quarter of the rows dropped and 3 padding rows past them; "empty" no token routed."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "empty":
        return torch.full((num_tokens, experts), -1, dtype=torch.int64), 5
    if kind == "exact":
        routed = torch.zeros(num_tokens, experts, dtype=torch.bool)
        for t in range(num_tokens):
            routed[t, torch.randperm(experts, generator=gen)[:topk]] = True
    else:
        routed = torch.rand(num_tokens, experts, generator=gen) < topk / experts
    rank = torch.cumsum(routed.t().reshape(-1), 0).view(experts, num_tokens).t() - 1
    count = int(routed.sum())
    kept = count if kind == "exact" else count - count // 4
    row_id_map = torch.where(routed & (rank < kept), rank, -1)
    return row_id_map, kept + (0 if kind == "exact" else 3)


def loops_gather(x, index, scale=None, dot_with=None):
    """fp64 loops: rows x[index[j]] (zeros for index < 0) times scale[j]; dots with dot_with[j]."""
    out = torch.zeros(index.shape[0], x.shape[1], dtype=F64)
    for j, i in enumerate(index.tolist()):
        if i >= 0:
            out[j] = x[i].double() * (float(scale[j]) if scale is not None else 1.0)
    dots = None
    if dot_with is not None:
        dots = torch.tensor([float((x[i].double() * dot_with[j].double()).sum()) if i >= 0 else 0.0
                             for j, i in enumerate(index.tolist())], dtype=F64)
    return out, dots


def loops_segment_sum(x, perm, offsets, weight=None):
    out = torch.zeros(offsets.shape[0] - 1, x.shape[1], dtype=F64)
    for t in range(offsets.shape[0] - 1):
        for i in range(int(offsets[t]), int(offsets[t + 1])):
            out[t] += x[int(perm[i])].double() * (float(weight[i]) if weight is not None else 1.0)
    return out


CASES = [("exact", 6, 5, 2), ("general", 9, 4, 2), ("empty", 3, 4, 1), ("exact", 1, 4, 3), ("general", 1, 3, 3)]


def bound(dtype):
    """One rounding of dtype on top of fp32 sums: a relative tolerance."""
    return {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6, F64: 1e-12}[dtype]


def check(got, want, dtype):
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got.double().cpu() - want).abs().max().item() if want.numel() else 0.0
    assert err <= bound(dtype) * max(scale, 1.0) * 2, (err, scale, dtype)


def run_cases(gather, segment_sum, device="cpu", dtypes=(torch.bfloat16, torch.float32, F64), hiddens=(3, 64, 130)):
    """Every case through the given gather / segment-sum functions, against the fp64 loops."""
    for (kind, n, e, k), dtype, hidden in [(c, d, h) for c in CASES for d in dtypes for h in hiddens]:
        row_id_map, rows = routing_case(kind, n, e, k, seed=n + hidden)
        gen = torch.Generator().manual_seed(hidden)
        src = _sources(row_id_map, rows)
        token = _token_of(src, e)
        tokens = torch.randn(n, hidden, generator=gen, dtype=F64).to(dtype)
        permuted = torch.randn(rows, hidden, generator=gen, dtype=F64).to(dtype)
        weight = torch.rand(rows, generator=gen, dtype=F64).to(torch.promote_types(dtype, torch.float32))
        # permute's forward and unpermute's backward (scaled, with the dot products)
        want, _ = loops_gather(tokens, token)
        got, none = gather(tokens.to(device), token.to(device), None, None)
        assert none is None and got.dtype == dtype and torch.equal(got.cpu().double(), want)
        want, want_dots = loops_gather(tokens, token, weight, permuted)
        got, dots = gather(tokens.to(device), token.to(device), weight.to(device), permuted.to(device))
        check(got, want, dtype)
        check(dots, want_dots, torch.float32 if dtype != F64 else F64)
        # permute's backward and unpermute's forward: token by token, weighted or not
        perm, offsets = _by_token(token, src, n, e)
        for w in (None, weight.index_select(0, perm)):
            want = loops_segment_sum(permuted, perm, offsets, w)
            got = segment_sum(permuted.to(device), perm.to(device), offsets.to(device), None if w is None else
                              w.to(device))
            assert got.shape == (n, hidden) and got.dtype == dtype
            check(got, want, dtype)


def test_by_token_lists_each_tokens_rows_in_slot_order():
    for kind, n, e, k in CASES:
        row_id_map, rows = routing_case(kind, n, e, k)
        src = _sources(row_id_map, rows)
        perm, offsets = _by_token(_token_of(src, e), src, n, e)
        for t in range(n):
            want = [int(r) for r in row_id_map[t] if r >= 0]
            assert perm[int(offsets[t]):int(offsets[t + 1])].tolist() == want
        assert int(offsets[-1]) == int((row_id_map >= 0).sum())
        if kind == "exact":
            assert torch.equal(offsets, torch.arange(n + 1) * k)


def test_references_against_fp64_loops():
    run_cases(lambda *a: moe_rows.gather_rows_reference(*a), lambda *a: moe_rows.segment_sum_rows_reference(*a))


def test_no_rows_and_no_hidden():
    x = torch.randn(0, 4)
    out, _ = moe_rows.gather_rows(x, torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(out, torch.zeros(3, 4))
    assert moe_rows.segment_sum_rows(x, torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)).shape \
        == (2, 4)


def run_interpreted() -> None:
    """The kernels' launches on CPU tensors (TRITON_INTERPRET=1 set before triton is imported)."""
    run_cases(moe_rows._gather_launch, moe_rows._segment_sum_launch, hiddens=(3, 130))
    # a strided source (rows of a wider buffer) and a tile loop past one tile (hidden 2050 > 2048)
    wide = torch.randn(7, 2050 + 6)[:, 3:2053]
    index = torch.tensor([6, -1, 0, 3, 3], dtype=torch.int64)
    got, _ = moe_rows._gather_launch(wide, index, None, None)
    assert torch.equal(got, moe_rows.gather_rows_reference(wide, index)[0])


@pytest.mark.skipif(moe_rows.triton is None, reason="needs triton (import triton failed)")
def test_kernels_under_the_triton_interpreter():
    triton_interpreter.run_interpreted("tests.test_moe_rows", "run_interpreted", timeout=800)
