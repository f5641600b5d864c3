"""Comm-GEMM overlap over CUDA IPC (csrc/comm_gemm_overlap; C API te_parallel/comm_gemm_overlap.h).

The communicator of one TP group (an IPC-shared buffer and uint32 flags per rank; copy-engine copies,
stream waits and signals on them), the fused schedules that run a whole GEMM + reduce-scatter or
all-gather + GEMM in one call, and the fp32 sum of reduce-scatter partials. The protocol that uses
them (regions, ready and busy flags) is te_parallel.parallel.ub_transport's.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from te_parallel.native import DTYPES, HIGH_PRECISION_DTYPES, available, describe, require
from te_parallel.native import gemm as _gemm

__all__ = ["usable", "Communicator", "reduce_sum"]


def usable() -> bool:
    """True if the IPC transport can be tried here: the extension is loaded. (Whether the GPUs can map
    each other's memory, constructing the Communicator finds out: it raises RuntimeError.)"""
    return available()


def _codes(where: str, **tensors: Optional[torch.Tensor]) -> list:
    """The tep_dtype codes of the given tensors, or a one-line ValueError naming the one without a code."""
    codes = []
    for name, t in tensors.items():
        code = DTYPES.get(t.dtype)
        if code is None:
            raise ValueError(f"{where}: {name} is {describe(t)}; need one of {tuple(map(str, DTYPES))}")
        codes.append(code)
    return codes


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


class Communicator:
    """te_parallel._C.Communicator: the IPC buffer and flags shared by one TP group.

    Collective: every rank of the group constructs it together (allgather(bytes) -> bytes, every rank's
    bytes in rank order, exchanges the IPC handles). RuntimeError if a peer's memory cannot be mapped.
    The stream operations are the binding's own methods (no wrapper frame: an overlapped layer step
    issues dozens): buffer(peer) and flags(peer) give device addresses; copy(dst, src, nbytes, stream)
    is a copy-engine copy; signal(peer, flag, value, stream) fences, then sets peer's flags[flag];
    wait(flag, value, stream) makes the stream wait until the own flags[flag] >= value;
    claim(flags, stream), one batch, waits until each own flag is 0 and sets it to 1;
    release(flag, peer, peer_flag, stream), one batch, clears the own flags[flag], then (fenced) peer's
    flags[peer_flag]. Addresses and streams (cudaStream_t) are ints. Every value is fixed by the call
    site, never by a count of earlier calls, so all of it can be captured in a CUDA graph.
    """

    def __init__(self, rank: int, world_size: int, buffer_bytes: int, num_flags: int,
                 allgather: Callable[[bytes], bytes]) -> None:
        module = require("Communicator", "comm_overlap")
        self._comm = comm = module.Communicator(rank, world_size, buffer_bytes, num_flags, allgather)
        self.buffer, self.flags, self.copy, self.signal, self.wait = (comm.buffer, comm.flags, comm.copy,
                                                                      comm.signal, comm.wait)
        self.claim, self.release = comm.claim, comm.release

    def close(self) -> None:
        """Synchronises the device, unmaps the peers and frees the buffer."""
        self._comm.close()

    def gemm_rs(self, a: torch.Tensor, a_scale_inv: Optional[torch.Tensor], b: torch.Tensor,
                b_scale_inv: Optional[torch.Tensor], out: torch.Tensor, received: torch.Tensor, *,
                send_offset: int, slot_stride: int, piece_starts: Sequence[int], own_group: int, ready_flag: int,
                busy_flag: int, stream: int, side_stream: int, fast_accum: bool = False) -> None:
        """tep_comm_gemm_rs: out [m, n] = this rank's rows of the sum over ranks of a·bᵀ, the whole
        row-parallel GEMM + reduce-scatter schedule in one call. a [tp·m, k], b [n, k] contiguous, both
        FP8 (with their fp32 scale_inv) or both bf16/fp16; received: [tp-1, m, n] of out's dtype, written
        on side_stream; piece_starts: [0, ..., m] row bounds of the pieces, or [] for whole partials."""
        a_code, b_code, out_code = _codes("gemm_rs", a=a, b=b, out=out)
        workspace, scratch = _gemm.workspace(out.device, stream)  # (scratch: held through the call)
        self._comm.gemm_rs(a.data_ptr(), a_code, b.data_ptr(), b_code, _ptr(a_scale_inv), _ptr(b_scale_inv),
                           a.shape[1], b.shape[0], fast_accum, workspace, _gemm.WORKSPACE_BYTES, out.shape[0],
                           out_code, out.data_ptr(), received.data_ptr(), send_offset, slot_stride, list(piece_starts),
                           own_group, ready_flag, busy_flag, stream, side_stream)

    def ag_gemm(self, a: torch.Tensor, a_scale_inv: Optional[torch.Tensor], b: torch.Tensor,
                b_scale_inv: Optional[torch.Tensor], bias: Optional[torch.Tensor], out: torch.Tensor,
                gathered: Optional[torch.Tensor], *, recv_offset: int, slot_bytes: int, ready_flag: int,
                busy_flag: int, stream: int, side_stream: int, fast_accum: bool = False) -> None:
        """tep_comm_ag_gemm: out [tp·m, n] = AG(a)·bᵀ (+ bias), the whole all-gather + GEMM ring in one
        call. a [m, k] (this rank's chunk) and b [n, k] as in gemm_rs; bias None or [n] of out's dtype;
        gathered: None, or [tp·m, k] of a's dtype that receives the gathered a."""
        a_code, b_code, out_code = _codes("ag_gemm", a=a, b=b, out=out)
        workspace, scratch = _gemm.workspace(out.device, stream)  # (scratch: held through the call)
        self._comm.ag_gemm(a.data_ptr(), a_code, b.data_ptr(), b_code, _ptr(a_scale_inv), _ptr(b_scale_inv),
                           a.shape[1], b.shape[0], _ptr(bias), fast_accum, workspace, _gemm.WORKSPACE_BYTES,
                           a.shape[0], out_code, out.data_ptr(), _ptr(gathered), recv_offset, slot_bytes, ready_flag,
                           busy_flag, stream, side_stream)


def reduce_sum(parts: Sequence[torch.Tensor], out: torch.Tensor, stream: int) -> None:
    """out = sum of parts (1..8 contiguous CUDA tensors of one high-precision dtype, out.numel() elements
    each; a peer GPU's memory may be read in place where peer access is on), accumulated in fp32 in list
    order and rounded once to out's dtype, on `stream` (a cudaStream_t int of out's device):
    te_parallel.parallel.ub_transport.reduce_sum_reference's math, bit for bit."""
    module = require("reduce_sum", "comm_overlap")
    dtype = parts[0].dtype if parts else out.dtype
    for i, p in enumerate(parts):
        if not (p.dtype == dtype and p.numel() == out.numel() and p.is_contiguous() and p.is_cuda):
            raise ValueError(f"reduce_sum: parts[{i}] is {describe(p)}; need a contiguous {dtype} CUDA tensor of "
                             f"{out.numel()} elements")
    if (dtype not in HIGH_PRECISION_DTYPES or out.dtype not in HIGH_PRECISION_DTYPES or not out.is_contiguous()
            or not out.is_cuda):
        raise ValueError(f"reduce_sum: parts are {dtype}, out is {describe(out)}; need float32/float16/bfloat16 "
                         f"parts and a contiguous float32/float16/bfloat16 CUDA out")
    module.reduce_sum([p.data_ptr() for p in parts], DTYPES[dtype], out.data_ptr(), DTYPES[out.dtype], out.numel(),
                      stream)
