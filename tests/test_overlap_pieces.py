"""The row pieces of gemm_rs's TP=2 reduce-scatter schedule (pure functions; the schedule itself runs
in tests/distributed/test_overlap.py on two GPUs)."""
from hypothesis import given
from hypothesis import strategies as st

import pytest
import torch

from te_parallel.ops import linear_overlap as ov
from te_parallel.parallel.overlap_config import OverlapConfig
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
    cfg = OverlapConfig()
    rs_pieces, short_k, min_rows = cfg.rs_pieces_for, cfg.rs_short_k, cfg.rs_min_piece_rows
    assert rs_pieces(2, 4096) == cfg.rs_pieces == 2
    assert rs_pieces(2, 4096, k=short_k) == 2  # K at or above rs_short_k: compute-bound pieces
    assert rs_pieces(2, 4096, k=short_k - 16) == cfg.rs_pieces_short_k == 4  # copy-bound: smaller pieces
    assert rs_pieces(2, 3 * min_rows, k=2048) == 3  # never a piece under rs_min_piece_rows rows
    assert rs_pieces(4, 4096, k=2048) == 1
    assert rs_pieces(2, 2 * min_rows) == 2
    assert rs_pieces(2, min_rows) == 1  # one piece: the unpieced schedule (fp32 sum pass)
    assert rs_pieces(4, 4096) == rs_pieces(8, 4096) == 1
    assert row_pieces(4096, 4) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    small = OverlapConfig(rs_pieces=4, rs_min_piece_rows=16)  # a config is passed, not a global rewritten
    assert small.rs_pieces_for(2, 64, k=8192) == 4 and OverlapConfig().rs_pieces_for(2, 64, k=8192) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="ring"), "method"), (dict(rs_pieces=0), "rs_pieces"), (dict(rs_min_piece_rows=True), "rs_min_piece_rows"),
    (dict(native_schedule=1), "native_schedule"),
])
def test_bad_overlap_config(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        OverlapConfig(**kwargs)


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


class _LoggedReduceScatter:
    """Records the order in which gemm_rs issues its GEMMs, signals and pulls (what a stream sees)."""

    def __init__(self, log, tp, me, m, cols, pieces):
        self.log, self.tp, self.me, self.m = log, tp, me, m
        self.pieces = row_pieces(m, pieces)
        self.slots = torch.zeros(tp, m, cols)

    def slot(self, d):
        return self.slots[d]

    def ready(self, d, piece=None):
        self.log.append(("ready", d, piece))

    def pull_step(self, k, piece=None):
        self.log.append(("pull", (self.me - k) % self.tp, piece))

    def received(self, src, piece):
        self.log.append(("pull", src, piece))
        a, b = self.pieces[piece]
        return torch.zeros(b - a, self.slots.shape[2])

    def finish_accumulated(self, out):
        return out

    def finish(self, dtype):
        return self.slots[self.me].to(dtype)


class _LoggedUb:
    transport_name = "p2p"  # the Python-issued schedule

    def __init__(self, tp, me, log):
        self.tp_size, self.rank, self.log = tp, me, log

    def reduce_scatter(self, rows, cols, dtype, device, pieces=1):
        return _LoggedReduceScatter(self.log, self.tp_size, self.rank, rows // self.tp_size, cols, pieces)


@pytest.mark.parametrize("tp,me,k", [(2, 0, 4096), (2, 1, 2048), (4, 1, 4096), (8, 5, 4096)])
def test_gemm_rs_issues_each_pull_after_the_gemm_that_follows_it(tp, me, k):
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 all streams feed one hardware queue and a wait that is not
    satisfied yet holds back everything issued after it (benchmarks/bench_p2p.py --ipc shows the same
    for a kernel queued behind a copy). So a pull, which waits for a peer's flag, must not be issued
    before a GEMM that does not need it: a late peer would stall that GEMM too."""
    log = []
    m = 1024
    a = torch.randn(tp * m, k)
    w = torch.randn(64, k)

    def gemm_into(a_rows, out, accumulate=None):
        log.append(("gemm", "own" if accumulate is not None else None, a_rows.data_ptr()))
        ov.fprop_into(a_rows, w, None, out, accumulate)

    ov.gemm_rs(_LoggedUb(tp, me, log), a, gemm_into, 64, torch.float32, w=None)
    kinds = [e[0] for e in log]
    gemms = [i for i, kind in enumerate(kinds) if kind == "gemm"]
    pulls = [i for i, kind in enumerate(kinds) if kind == "pull"]
    readies = [i for i, e in enumerate(log) if e[0] == "ready" and e[1] != me]  # (ready(me) is a no-op)
    assert pulls and readies and max(readies) < max(gemms)
    if tp == 2:  # pieces: every GEMM for the peer and its signal come before the first pull
        peer_gemms = [i for i in gemms if log[i][1] is None]
        assert len(peer_gemms) == OverlapConfig().rs_pieces_for(tp, m, k)
        assert max(peer_gemms) < min(pulls) and max(readies) < min(pulls)
        # piece j of the own partial is pulled right before the own GEMM that adds it
        own = [i for i in gemms if log[i][1] == "own"]
        assert [i + 1 for i in pulls] == own
    else:  # whole partials: the pull of step k comes after the GEMM of step k+1 (and its signal)
        assert len(pulls) == tp - 1 and len(gemms) == tp
        for step, p in enumerate(pulls, start=1):
            assert gemms[step] < p
            assert log[p][1] == (me - step) % tp
