"""The overlapped schedules of LinearFunction (te_parallel/parallel/overlap.py has the communicator).

Shapes on one rank, tp ranks, me = this rank, M = tokens of the whole sequence, m = M/tp:

  ag_gemm   column fprop   x_local [m, K] -> y [M, N/tp]   y[rows of r] = x_r · Wᵀ
            row dgrad      dy_local [m, N] -> dx [M, K/tp]  dx[rows of r] = dy_r · W
      step k = 0..tp-1 multiplies the chunk of rank (me+k) % tp while the chunk of step k+1 is pulled;
      each GEMM writes its own rows of the output, so nothing is concatenated afterwards.
  gemm_rs   row fprop      x [M, K/tp] -> y_local [m, N]    partial_d = x[rows of d] · Wᵀ
      step k = 1..tp computes the partial for d = (me+k) % tp (own chunk last) straight into the
      shared send slot of d; d pulls it while step k+1 computes; then each rank adds its tp partials.
      At TP=2, in row pieces: piece j of the peer's partial is pulled while piece j+1 is computed,
      and the own partial's GEMM adds the pulled pieces in its epilogue (no separate sum).
      A pull waits for a peer's flag, so it is issued after the GEMM that follows it (see gemm_rs).
  dgrad_rs  column bwd     dy [M, N/tp] -> dx_local [m, K]  gemm_rs's schedule on dgrad (ub_overlap_rs_dgrad)
  bulk      column bwd     AG(x_local) under dgrad, RS(dx) under wgrad (side streams; the default).

The collective moves "a tensor": FP8 operands travel as their uint8 bytes and are re-wrapped with the
shared scale_inv (every rank cast with the same, TP-reduced scale), so FP8 gathers move half the bytes.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from te_parallel.native import gemm as native_gemm
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import gemm
from te_parallel.parallel.overlap_config import DEFAULT_OVERLAP, OverlapConfig
from te_parallel.recipe import MMParams

Operand = object  # torch.Tensor or Float8Tensor


def _bytes(t: Operand) -> torch.Tensor:
    return t.data.view(torch.uint8) if isinstance(t, Float8Tensor) else t


def _wrap(chunk: torch.Tensor, like: Operand) -> Operand:
    if isinstance(like, Float8Tensor):
        return Float8Tensor(chunk.view(like.data.dtype), like.scale_inv)
    return chunk


def fprop_into(x: Operand, w: Operand, bias: Optional[torch.Tensor], out: torch.Tensor,
               accumulate: Optional[torch.Tensor] = None, mm: MMParams = gemm.EXACT) -> None:
    """out [rows, N] = x [rows, K] · Wᵀ (+ bias) (+ accumulate, added in the GEMM's epilogue)."""
    if isinstance(x, Float8Tensor):
        gemm.fprop(x, w, out.dtype, bias, out=out, accumulate=accumulate, mm=mm)
    elif accumulate is not None:
        torch.addmm(accumulate, x, w.t(), out=out)
        if bias is not None:
            out.add_(bias.to(out.dtype))
    elif bias is None:
        torch.matmul(x, w.t(), out=out)
    else:
        torch.addmm(bias.to(out.dtype), x, w.t(), out=out)


def dgrad_into(dy: Operand, w: Operand, out: torch.Tensor, accumulate: Optional[torch.Tensor] = None,
               mm: MMParams = gemm.EXACT) -> None:
    """out [rows, K] = dy [rows, N] · W (+ accumulate, added in the GEMM's epilogue)."""
    if isinstance(dy, Float8Tensor):
        gemm.dgrad(dy, w, out.dtype, out=out, accumulate=accumulate, mm=mm)
    elif accumulate is not None:
        torch.addmm(accumulate, dy, w, out=out)
    else:
        torch.matmul(dy, w, out=out)


def ag_gemm(ub, a_local: Operand, gemm_into: Callable[[Operand, torch.Tensor], None], n_out: int,
            out_dtype: torch.dtype, keep_gathered: bool, w: Optional[Operand] = None,
            bias: Optional[torch.Tensor] = None, mm: MMParams = gemm.EXACT,
            cfg: Optional[OverlapConfig] = None) -> Tuple[torch.Tensor, Optional[Operand]]:
    """(out [tp·m, n_out], the gathered A [tp·m, K] if keep_gathered else None).
    w (+ bias): B as [n_out, K] (gemm_into's math: A·wᵀ + bias), for the native schedule, whose FP8
    GEMMs accumulate as `mm` says, as gemm_into's do. cfg: this GEMM's OverlapConfig."""
    tp, me = ub.tp_size, ub.rank
    if isinstance(a_local, torch.Tensor):
        a_local = a_local.contiguous()
    if (cfg or DEFAULT_OVERLAP).native_schedule and w is not None and ub.transport_name == "ipc" and native_gemm.usable():
        ops = _native_operands(a_local, w, out_dtype, fp8_only=True)
        if ops is not None and (bias is None or (out_dtype != torch.float32 and bias.dtype == out_dtype)):
            out, gathered = ub.ag_gemm(*ops, bias, out_dtype, keep_gathered, mm.fast_accum)
            return out, (Float8Tensor(gathered, a_local.scale_inv) if keep_gathered else None)
    local = _bytes(a_local)
    m = local.shape[0]
    full = torch.empty((tp * m, *local.shape[1:]), dtype=local.dtype, device=local.device) if keep_gathered else None
    out = torch.empty((tp * m, n_out), dtype=out_dtype, device=local.device)
    # The own chunk's GEMM is launched first, so the GPU starts multiplying while the host issues
    # the exchange; the exchange waits only for what preceded that GEMM (a_local is ready).
    inputs_ready = ub.mark_inputs_ready()
    gemm_into(a_local, out[me * m : (me + 1) * m])
    handle = ub.all_gather(local, full, after=inputs_ready)
    for k in range(1, tp):
        src = (me + k) % tp
        gemm_into(_wrap(handle.chunk(src), a_local), out[src * m : (src + 1) * m])
        handle.release(src)  # (copies the chunk into `full` first when it is kept)
    gathered = _wrap(handle.wait(), a_local) if keep_gathered else None
    return out, gathered


def _native_operands(a: Operand, w: Operand, out_dtype: torch.dtype, fp8_only: bool = False):
    """(a, a_scale_inv, w, w_scale_inv) as tep_gemm takes them, or None where it cannot (or, with
    fp8_only, where the operands are not FP8: a bf16 all-gather + GEMM stays bit-exact with the
    gather-then-GEMM path only with torch's own GEMM)."""
    if isinstance(a, Float8Tensor) and isinstance(w, Float8Tensor):
        if a.data.is_contiguous() and w.data.is_contiguous() and a.data.shape[1] == w.data.shape[1]:
            return a.data, gemm._scalar_f32(a.scale_inv), w.data, gemm._scalar_f32(w.scale_inv)
        return None
    if (not fp8_only and isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor)
            and a.dtype == w.dtype and a.dtype in (torch.bfloat16, torch.float16) and out_dtype in (a.dtype, torch.float32)
            and a.is_contiguous() and w.is_contiguous() and a.dim() == 2 and w.dim() == 2 and a.shape[1] == w.shape[1]):
        return a, None, w, None
    return None


def gemm_rs(ub, a_full: Operand, gemm_into: Callable[..., None], n_out: int, out_dtype: torch.dtype,
            cfg: Optional[OverlapConfig] = None, w: Optional[Operand] = None,
            mm: MMParams = gemm.EXACT) -> torch.Tensor:
    """[m, n_out]: this rank's rows of sum over ranks of A·B, computed by destination chunk.
    gemm_into(a_rows, out, accumulate=None) writes a_rows·B (+ accumulate) into out; w: B's weight
    [n_out, K] (Wᵀ = B), for the native schedule (the same math, one call), whose FP8 GEMMs
    accumulate as `mm` says. cfg: this GEMM's OverlapConfig (pieces, native schedule)."""
    cfg = cfg or DEFAULT_OVERLAP
    tp, me = ub.tp_size, ub.rank
    rows, inner = _bytes(a_full).shape
    m = rows // tp
    device = _bytes(a_full).device
    pieces = cfg.rs_pieces_for(tp, m, inner)
    if cfg.native_schedule and w is not None and ub.transport_name == "ipc" and native_gemm.usable():
        ops = _native_operands(a_full, w, out_dtype)
        if ops is not None:
            return ub.gemm_rs(*ops, out_dtype, pieces, mm.fast_accum, cfg.rs_own_group)
    rs = ub.reduce_scatter(rows, n_out, out_dtype, device, pieces=pieces)
    # Each pull is issued after the next GEMM (as the native call does): with CUDA_DEVICE_MAX_CONNECTIONS=1
    # a wait for a late peer would otherwise hold back a GEMM that does not need the peer's data.
    if len(rs.pieces) > 1:  # TP=2 (rs_pieces): the peer's partial in pieces, then the own one adds them
        peer = 1 - me
        for j, (a, b) in enumerate(rs.pieces):
            gemm_into(_rows(a_full, peer * m + a, peer * m + b), rs.slot(peer)[a:b])
            rs.ready(peer, j)
        out = torch.empty((m, n_out), dtype=out_dtype, device=device)
        for j, (a, b) in enumerate(rs.pieces):  # received() pulls piece j, under the GEMM before
            gemm_into(_rows(a_full, me * m + a, me * m + b), out[a:b], rs.received(peer, j))
        return rs.finish_accumulated(out)
    for k in range(1, tp + 1):
        d = (me + k) % tp
        a_rows = _rows(a_full, d * m, (d + 1) * m)
        gemm_into(a_rows, rs.slot(d))
        rs.ready(d)
        if k > 1:  # what rank me-k+1 computed for me at its step k-1, under this GEMM's successor
            rs.pull_step(k - 1)
    return rs.finish(out_dtype)


def dgrad_rs(ub, dy: Operand, w: Operand, out_dtype: torch.dtype, cfg: Optional[OverlapConfig] = None,
             mm: MMParams = gemm.EXACT) -> torch.Tensor:
    """Column-parallel dgrad with its reduce-scatter pipelined (TE's ub_overlap_rs_dgrad): this rank's
    rows of sum over ranks of dy·W, by gemm_rs's schedule (at TP=2 the received pieces are added in
    the own GEMM's epilogue: no summing pass, and the pulls end under the dgrad, not after it)."""
    w_t = None  # B = Wᵀ [K, N] for the native call (FP8 keeps one; bf16 would need a copy of W)
    if isinstance(w, Float8Tensor):
        w_t = Float8Tensor(w.transposed(), w.scale_inv)
    return gemm_rs(ub, dy, lambda a, out, c=None: dgrad_into(a, w, out, c, mm), w.shape[1], out_dtype, cfg, w=w_t,
                   mm=mm)


def _rows(a: Operand, start: int, stop: int) -> Operand:
    if isinstance(a, Float8Tensor):
        return Float8Tensor(a.data[start:stop], a.scale_inv)
    return a[start:stop]


class BulkBackward:
    """Column-parallel backward: gather x under dgrad, reduce-scatter dx under wgrad.

        start(x_local)        AG of x begins on its side stream
        dgrad_rs(dy, w)       dx partial [M, K] written into the RS send slots, RS begins
        x_full()              waits for the gather (before wgrad)
        dx_local()            waits for the RS (after wgrad)
    """

    def __init__(self, ub, x_local: Optional[Operand]) -> None:
        self.ub = ub
        self.x_like = x_local
        self.gather = None
        if x_local is not None:
            local = _bytes(x_local).contiguous()
            full = torch.empty((ub.tp_size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
            self.gather = ub.all_gather(local, full)
        self.rs = None

    def dgrad_rs(self, dy: Operand, w: Operand, rows: int, cols: int, out_dtype: torch.dtype, device,
                 mm: MMParams = gemm.EXACT) -> None:
        ub = self.ub
        rs = ub.reduce_scatter(rows, cols, out_dtype, device)
        full = rs.full()
        if full is not None:
            dgrad_into(dy, w, full, mm=mm)
        else:
            m = rows // ub.tp_size
            for d in range(ub.tp_size):
                dgrad_into(_rows(dy, d * m, (d + 1) * m), w, rs.slot(d), mm=mm)
        for k in range(1, ub.tp_size + 1):  # step order, the same on every rank (P2P pairs messages by step)
            rs.ready((ub.rank + k) % ub.tp_size)
        rs.finish(out_dtype, async_op=True)  # the pulls now, the sum in dx_local (after wgrad is issued)
        self.rs = rs

    def x_full(self) -> Operand:
        return _wrap(self.gather.wait(), self.x_like)

    def dx_local(self) -> torch.Tensor:
        return self.rs.wait()
