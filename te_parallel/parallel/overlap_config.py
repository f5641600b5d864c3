"""OverlapConfig: how one comm-GEMM-overlapped GEMM is scheduled.

`initialize_ub(..., config=OverlapConfig(...))` sets the default of every overlapped GEMM of the
communicator; `ub_cfgs={"<ub_name>_<fprop|dgrad>": {...}}` overrides fields for one GEMM (TE's
dictionary form: its keys that tune SM-driven communication kernels are accepted and ignored, since
the copies here run on the copy engines). The modules hand each GEMM its config; nothing reads a
module-level setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

METHODS = ("ring_exchange", "pipeline", "bulk", "off")


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """Schedule of one overlapped GEMM ("<ub_name>_<fprop|dgrad|wgrad>").

    method: "off" disables the overlap of this GEMM; the other TE names all mean "overlap" (the
    schedule is chosen by the GEMM's place: a ring for all-gather + GEMM, per-destination chunks for
    GEMM + reduce-scatter, side streams for the column backward).

    GEMM + reduce-scatter at TP=2 runs in row pieces: the peer's partial is computed piece by piece,
    each piece pulled by the peer as soon as it is written, and the own partial's GEMM adds the
    received piece in its epilogue (cuBLASLt's C input), so no pass sums the partials.
    rs_pieces: pieces of a GEMM with inner dimension K >= rs_short_k. Two: more lose more to shorter
    GEMMs (an FP8 GEMM of 1024 rows ran ~25% below the whole GEMM's rate on an H200) and to launches
    than the earlier pulls win back (docs/overlap.md).
    rs_pieces_short_k: pieces when K < rs_short_k. Such a GEMM is copy-bound (at K = 2048 pulling a
    row over NVLink takes about twice as long as computing it), so smaller pieces start the pulls
    sooner and leave a shorter last own GEMM behind them.
    rs_min_piece_rows: no piece has fewer rows (fewer pieces are used instead; one piece is the
    unpieced schedule, with an fp32 sum pass).
    rs_own_group: pulled pieces added per GEMM of the own partial (native schedule).
    native_schedule: enqueue the whole schedule with one native call where it can be (CUDA IPC
    transport, the native GEMM usable, the weight given). Issued step by step from Python the
    schedule costs ~0.1 ms of host time per GEMM; False issues it from Python (for comparison).
    """

    method: str = "ring_exchange"
    rs_pieces: int = 2
    rs_pieces_short_k: int = 4
    rs_short_k: int = 4096
    rs_min_piece_rows: int = 256
    rs_own_group: int = 1
    native_schedule: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"OverlapConfig.method={self.method!r}; need one of {METHODS}")
        for name in ("rs_pieces", "rs_pieces_short_k", "rs_short_k", "rs_min_piece_rows", "rs_own_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"OverlapConfig.{name}={value!r}; need an int >= 1")
        if not isinstance(self.native_schedule, bool):
            raise TypeError(f"OverlapConfig.native_schedule={self.native_schedule!r}; need a bool")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def rs_pieces_for(self, tp: int, m: int, k: Optional[int] = None) -> int:
        """Row pieces of a TP=tp reduce-scatter whose chunks have m rows, from a GEMM with inner
        dimension k (1: the unpieced schedule; pieces are used at TP=2 only)."""
        if tp != 2:
            return 1
        want = self.rs_pieces_short_k if k is not None and k < self.rs_short_k else self.rs_pieces
        return max(1, min(want, m // self.rs_min_piece_rows))


DEFAULT_OVERLAP = OverlapConfig()
