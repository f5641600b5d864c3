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
