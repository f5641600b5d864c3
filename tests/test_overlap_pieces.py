"""The row pieces of gemm_rs's TP=2 reduce-scatter schedule (pure functions; the schedule itself runs
in tests/distributed/test_overlap.py on two GPUs)."""
from hypothesis import given
from hypothesis import strategies as st

from te_parallel.ops.linear_overlap import RS_MIN_PIECE_ROWS, RS_PIECES, rs_pieces
from te_parallel.parallel.ub_transport import row_pieces


@given(m=st.integers(1, 10_000), pieces=st.integers(1, 8))
def test_row_pieces_cover_the_rows_in_16_row_steps(m, pieces):
    got = row_pieces(m, pieces)
    assert 1 <= len(got) <= pieces
    assert got[0][0] == 0 and got[-1][1] == m
    for (a, b), (c, _) in zip(got, got[1:]):
        assert b == c  # contiguous
    for a, b in got:
        assert a < b and a % 16 == 0  # never empty; every piece but the last starts and ends on 16 rows
    if m % 16 == 0 and m >= 16 * pieces:
        assert len(got) == pieces and all((b - a) % 16 == 0 for a, b in got)


def test_rs_pieces_only_at_tp2_and_for_long_chunks():
    assert rs_pieces(2, 4096) == RS_PIECES == 2
    assert rs_pieces(2, 2 * RS_MIN_PIECE_ROWS) == 2
    assert rs_pieces(2, RS_MIN_PIECE_ROWS) == 1  # one piece: the unpieced schedule (fp32 sum pass)
    assert rs_pieces(4, 4096) == rs_pieces(8, 4096) == 1
    assert row_pieces(4096, 4) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]


def test_native_operands_picks_what_tep_gemm_takes():
    import torch

    from te_parallel.fp8.tensor import Float8Tensor
    from te_parallel.ops.linear_overlap import _native_operands

    one = torch.ones(())
    a8 = Float8Tensor(torch.zeros(32, 64).to(torch.float8_e4m3fn), one)
    w8 = Float8Tensor(torch.zeros(48, 64).to(torch.float8_e4m3fn), one)
    got = _native_operands(a8, w8, torch.bfloat16)
    assert got[0] is a8.data and got[2] is w8.data and got[1].dim() == 0 and got[3].dim() == 0
    # a strided FP8 operand or another K: the Python schedule
    strided = Float8Tensor(torch.zeros(64, 64).to(torch.float8_e4m3fn)[:, :32], one)
    assert _native_operands(strided, w8, torch.bfloat16) is None
    assert _native_operands(a8, Float8Tensor(torch.zeros(48, 32).to(torch.float8_e4m3fn), one), torch.bfloat16) is None
    a16, w16 = torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16)
    assert _native_operands(a16, w16, torch.bfloat16) == (a16, None, w16, None)
    assert _native_operands(a16, w16, torch.float32) is not None
    assert _native_operands(a16, w16, torch.float16) is None  # bf16 operands give bf16 or fp32
    assert _native_operands(a16, w16, torch.bfloat16, fp8_only=True) is None  # the bf16 ring stays bit-exact
    assert _native_operands(a16, w16.to(torch.float16), torch.bfloat16) is None
    assert _native_operands(torch.zeros(64, 32, dtype=torch.bfloat16).t(), w16, torch.bfloat16) is None  # strided
