"""Grouped GEMMs of a Mixture-of-Experts layer: G GEMMs sharing K and N, one launch per GEMM kind.

The rows of the 2-D operands are sorted by expert: group g owns rows [offs[g-1], offs[g]) (offs: the int32
cumulative ends on the operands' device, offs[-1] = M; `GroupSplits`). With W [G, N, K] the experts'
weights (N = out, K = in features on this rank) and x [M, K], dy [M, N]:

    fprop  y[rows_g]  = x[rows_g] · W[g]ᵀ         kind "m": A [M, K] grouped along M, B [G, K, N]  -> [M, N]
    dgrad  dx[rows_g] = dy[rows_g] · W[g]         kind "m": A [M, N] grouped along M, B [G, N, K]  -> [M, K]
    wgrad  dW[g]      = dy[rows_g]ᵀ · x[rows_g]   kind "k": A [N, M], B [M, K], grouped along M    -> [G, N, K]

Each is ONE call whatever G is: torch._grouped_mm (high precision), torch._scaled_grouped_mm (per-tensor FP8 on
CUDA where it takes the operands) or the block-scaled grouped kernel (Float8BlockScaling, and the other per-tensor
FP8 GEMMs, on CUDA). Nothing here reads the group sizes on the host: `offs` stays on the device, so a forward and
backward with device-side m_splits never synchronise (with bf16 or FP8 operands: torch runs fp32 / fp16 grouped
GEMMs on CUDA as a loop that reads offs on the host).

Routes, decided in one place per operand kind (`fp8_route`, `grouped_block_mm`):
* high precision: torch._grouped_mm, any device. Feature dims are zero-padded to 16 bytes where they are not
  (its stride rule); rows need no alignment (the wgrad operands are laid out so that groups split strided dims).
* per-tensor FP8 (delayed / current scaling): operands in cuBLAS's "TN" layouts (A row-major, B column-major),
  one fp32 scale_inv for x (or dy) and one per expert for W. On CUDA, torch._scaled_grouped_mm where it takes
  the operands (E4M3 both, compute capability 9.0 / 10.0, and for wgrad every group a multiple of 16 rows, known
  on the host); everything else (HYBRID's E5M2 gradients, wgrad over groups of unknown size, GPUs torch's kernel
  does not run on) goes to the block-scaled grouped kernel below with constant scales: a per-tensor scale is a
  block scale that is the same in every tile, so the kernel reads stride-0 views of the scalars (no copy, no
  widened operands), promotes every 128-deep chunk into fp32 and writes the output dtype itself. On the CPU both
  operands are dequantized to fp32 and multiplied by torch._grouped_mm in fp32 (as ops.gemm does for one GEMM).
* block scaling (1x128 tiles of x and dy, 128x128 blocks or 1x128 tiles of W): `grouped_block_mm`, the CPU's
  fp32 dequantized product or te_parallel.ops.grouped_block_gemm.grouped_block_mm_cuda on CUDA.

Every route has its fp64 reference here (`grouped_mm_reference`, a loop over the groups, for the tests).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from te_parallel.fp8.blockwise import BLOCK, BlockwiseTensor
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import gemm
from te_parallel.ops.linear import _accumulate_main_grad
from te_parallel.parallel.collectives import all_reduce
from te_parallel.recipe import MMParams

EXACT = gemm.EXACT
KINDS = ("m", "k")


# --- the groups ----------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class GroupSplits:
    """How the M rows of a grouped GEMM's operands divide among its G groups.

    sizes [G] int64 and offs [G] int32 (cumulative ends, torch._grouped_mm's `offs`) live on the operands'
    device; `counts` holds the sizes on the host where they were given there (a list, or a CPU tensor with
    CPU operands), else None: then no code reads them on the host."""

    sizes: torch.Tensor
    offs: torch.Tensor
    rows: int
    counts: Optional[Tuple[int, ...]] = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_groups(self) -> int:
        return self.offs.shape[0]

    def group_ids(self) -> torch.Tensor:
        """[M] int64: the group of each row, made on the device (output_size given: no synchronisation)."""
        ids = self._cache.get("ids")
        if ids is None:
            groups = torch.arange(self.num_groups, device=self.sizes.device)
            ids = self._cache["ids"] = torch.repeat_interleave(groups, self.sizes, output_size=self.rows)
        return ids

    def aligned(self, multiple: int) -> Optional[bool]:
        """Whether every group is a multiple of `multiple` rows; None where the sizes are only on the device."""
        if self.counts is None:
            return None
        return all(c % multiple == 0 for c in self.counts)


def make_splits(m_splits, num_gemms: int, rows: int, device: torch.device, owner: str = "GroupedLinear") -> GroupSplits:
    """GroupSplits from TE's m_splits: a list of ints, or an int tensor [num_gemms]. A list and a CPU tensor (with
    CPU operands) are checked on the host (length, non-negative, sum = rows); a tensor on the operands' GPU is
    used as it is, with its length checked: its values are the caller's contract (no synchronisation)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.numel() != num_gemms:
            raise ValueError(f"{owner}: m_splits has shape {tuple(m_splits.shape)}; need one entry per GEMM "
                             f"([{num_gemms}] for num_gemms={num_gemms})")
        if m_splits.is_floating_point() or m_splits.is_complex() or m_splits.dtype == torch.bool:
            raise TypeError(f"{owner}: m_splits must hold integers, got a {m_splits.dtype} tensor")
        if m_splits.device.type == "cpu":
            return _host_splits([int(v) for v in m_splits.tolist()], num_gemms, rows, device, owner)
        if m_splits.device != device:
            raise ValueError(f"{owner}: m_splits is on {m_splits.device} but the input is on {device}; pass it on "
                             f"the input's device (or as a list)")
        sizes = m_splits.to(torch.int64)
        return GroupSplits(sizes, torch.cumsum(sizes, 0, dtype=torch.int32), rows)
    if not isinstance(m_splits, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                            for v in m_splits):
        raise TypeError(f"{owner}: m_splits must be a list of ints or an int tensor, got {_describe(m_splits)}")
    return _host_splits(list(m_splits), num_gemms, rows, device, owner)


def _describe(v) -> str:
    if isinstance(v, (list, tuple)):
        return f"a {type(v).__name__} holding {sorted({type(e).__name__ for e in v})}"
    return type(v).__name__


def _host_splits(counts, num_gemms: int, rows: int, device: torch.device, owner: str) -> GroupSplits:
    if len(counts) != num_gemms:
        raise ValueError(f"{owner}: m_splits has {len(counts)} entries; need one per GEMM (num_gemms={num_gemms})")
    if any(c < 0 for c in counts):
        raise ValueError(f"{owner}: m_splits {counts} has a negative entry; each is an expert's row count (>= 0)")
    if sum(counts) != rows:
        raise ValueError(f"{owner}: m_splits {counts} adds up to {sum(counts)}, but the input has {rows} rows; "
                         f"they must be equal")
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    both = torch.tensor(counts + ends, dtype=torch.int64).to(device)  # (one copy to the device)
    return GroupSplits(both[:num_gemms], both[num_gemms:].to(torch.int32), rows, tuple(counts))


# --- high precision: torch._grouped_mm -------------------------------------------------------------------
def _pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """t zero-padded along `dim` to a multiple of `multiple` (t itself when it is one)."""
    size = t.shape[dim]
    extra = -size % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


def _aligned_ptr(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it on CUDA when its data does not start on a 16-byte boundary (grouped GEMMs need it)."""
    return t.clone() if t.is_cuda and t.data_ptr() % 16 else t


def _elems16(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, splits: GroupSplits, role: str) -> torch.Tensor:
    """One high-precision grouped GEMM by torch._grouped_mm, in the operands' dtype (they share it).

    role "fprop": a = x [M, K], b = W [G, N, K] -> y [M, N]; "dgrad": a = dy [M, N], b = W [G, N, K] -> dx [M, K];
    "wgrad": a = dy [M, N], b = x [M, K] -> dW [G, N, K]. Feature dims that are not 16 bytes are zero-padded
    (torch._grouped_mm's stride rule); the result is cut back."""
    g = splits.num_groups
    align = _elems16(a.dtype)
    if role == "wgrad":
        (m, n), k = a.shape, b.shape[1]
        if m == 0:
            return a.new_zeros(g, n, k)
        dy, x = _aligned_ptr(_pad_dim(a.contiguous(), 1, align)), _aligned_ptr(_pad_dim(b.contiguous(), 1, align))
        # A = dyᵀ [N, M] column-major and B = x [M, K] row-major: the groups split their strided dim, which
        # needs no alignment of the group sizes (a row-major A would need every group a multiple of 16 bytes)
        out = torch._grouped_mm(dy.t(), x, offs=splits.offs)  # [G, Np, Kp]
        return out[:, :n, :k] if out.shape[1:] != (n, k) else out
    m = a.shape[0]
    w = b.contiguous()
    if role == "fprop":  # y = x·W[g]ᵀ: B = W[g]ᵀ [K, N], column-major
        n = w.shape[1]
        if m == 0:
            return a.new_zeros(0, n)
        x = _aligned_ptr(_pad_dim(a.contiguous(), 1, align))
        w = _aligned_ptr(_pad_dim(_pad_dim(w, 2, align), 1, align))
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=splits.offs)  # [M, Np]
    elif role == "dgrad":  # dx = dy·W[g]: B = W[g] [N, K], row-major
        n = w.shape[2]
        if m == 0:
            return a.new_zeros(0, n)
        dy = _aligned_ptr(_pad_dim(a.contiguous(), 1, align))
        w = _aligned_ptr(_pad_dim(_pad_dim(w, 2, align), 1, align))
        out = torch._grouped_mm(dy, w, offs=splits.offs)  # [M, Kp]
    else:
        raise ValueError(f"grouped_mm: role must be 'fprop', 'dgrad' or 'wgrad', got {role!r}")
    return out[:, :n].contiguous() if out.shape[1] != n else out


# --- per-tensor FP8 -------------------------------------------------------------------------------------
class FP8Route(enum.Enum):
    """How one per-tensor FP8 grouped GEMM runs (fp8_route)."""

    SCALED = "torch._scaled_grouped_mm"          # CUDA: FP8 tensor cores, scales in the epilogue
    TRITON = "the grouped FP8 kernel with constant block scales"  # CUDA: grouped_block_gemm, stride-0 scales
    DEQUANTIZED = "fp32 grouped GEMM of the dequantized operands"  # the CPU


def scaled_grouped_mm_available(device: torch.device) -> Tuple[bool, str]:
    """(True, "") where torch._scaled_grouped_mm runs on `device`, else (False, why) (asked once per GPU)."""
    return _scaled_available(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _scaled_available(index: int) -> Tuple[bool, str]:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
    cap = torch.cuda.get_device_capability(index)
    if cap not in ((9, 0), (10, 0)):
        return False, (f"torch._scaled_grouped_mm runs on compute capability 9.0 or 10.0; this GPU has "
                       f"{cap[0]}.{cap[1]}")
    return True, ""


def fp8_route(a_dtype: torch.dtype, b_dtype: torch.dtype, device: torch.device, splits: GroupSplits,
              kind: str) -> FP8Route:
    """The route of one per-tensor FP8 grouped GEMM (see the module doc). Raises where CUDA has none."""
    if device.type != "cuda":
        return FP8Route.DEQUANTIZED
    scaled, why = scaled_grouped_mm_available(device)
    e4m3 = a_dtype == torch.float8_e4m3fn and b_dtype == torch.float8_e4m3fn
    # wgrad: the groups split the contiguous dim of both FP8 operands, so each group must be 16 rows (bytes)
    if scaled and e4m3 and (kind == "m" or splits.aligned(16)):
        return FP8Route.SCALED
    from te_parallel.ops import grouped_block_gemm

    if grouped_block_gemm.usable_on(device):
        return FP8Route.TRITON
    why = why or f"its {a_dtype} x {b_dtype} {'wgrad' if kind == 'k' else 'fprop/dgrad'} is not one it takes"
    raise RuntimeError(f"FP8 grouped GEMMs on CUDA need torch._scaled_grouped_mm ({why}) or the Triton grouped "
                       f"kernel (triton and compute capability >= 9.0); run GroupedLinear outside fp8_autocast here")


def fp8_grouped_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, splits: GroupSplits,
                   out_dtype: torch.dtype, kind: str, mm: MMParams = EXACT) -> torch.Tensor:
    """(A · sa) grouped-times (B · sb), fp32 accumulation, in out_dtype; sa, sb are scale_inv (decode multipliers).

    kind "m": a [M, K] FP8 row-major, sa 0-d (one scale of the whole operand); b [G, K, N] FP8 with each b[g]
    column-major, sb [G] (one scale per group) -> [M, N].
    kind "k": a [N, M] FP8 row-major (dyᵀ), b [M, K] FP8 column-major (x from xᵀ's bytes), sa, sb 0-d
    -> [G, N, K]. torch._scaled_grouped_mm rounds its output to bf16 on the way (it writes bf16 only); the Triton
    kernel writes out_dtype (fp32 for a fused wgrad accumulation) and always promotes per 128-deep chunk
    (mm.fast_accum does not apply to it)."""
    g = splits.num_groups
    if kind == "m":
        (m, k), n = a.shape, b.shape[2]
        if m == 0:
            return torch.zeros(0, n, dtype=out_dtype, device=a.device)
    else:
        (n, m), k = a.shape, b.shape[1]
        if m == 0:
            return torch.zeros(g, n, k, dtype=out_dtype, device=a.device)
    route = fp8_route(a.dtype, b.dtype, a.device, splits, kind)
    sa, sb = sa.to(torch.float32), sb.to(torch.float32)
    if route is FP8Route.DEQUANTIZED:
        return _dequantized_mm(a, sa, b, sb, splits, out_dtype, kind)
    if route is FP8Route.TRITON:
        from te_parallel.ops.grouped_block_gemm import grouped_block_mm_cuda

        return grouped_block_mm_cuda(*constant_block_scales(a, sa, b, sb, kind), splits.offs, out_dtype, kind)
    if kind == "m":  # torch's rowwise scales: one per row of A [M], one per column of each B[g] [G, N]
        scale_a = sa.reshape(1).expand(m).contiguous()
        scale_b = sb.reshape(g, 1).expand(g, n).contiguous()
    else:  # 2-D x 2-D: one per row of A per group [G·N], one per column of B per group [G·K]
        scale_a = sa.reshape(1).expand(g * n).contiguous()
        scale_b = sb.reshape(1).expand(g * k).contiguous()
    out = torch._scaled_grouped_mm(_aligned_ptr(a), b, scale_a, scale_b, offs=splits.offs,
                                   out_dtype=torch.bfloat16, use_fast_accum=mm.fast_accum)
    return out.to(out_dtype)


def constant_block_scales(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, kind: str):
    """fp8_grouped_mm's per-tensor operands as the block-scaled grouped kernel's (a, sa, a_dim, b, sb, b_dim):
    each scale a stride-0 view of the grouped kernel's scale shape (kind "m": sa [M, ceil(K/128)] of the one
    scale, sb [G, ceil(K/128), ceil(N/128)] 128x128 blocks of expert g's scale; kind "k": sa [N, ceil(M/128)],
    sb [ceil(M/128), K]). The kernel's promotion multiplies each chunk by sa·sb, the same number every time."""
    if kind == "m":
        (m, k), (g, _, n) = a.shape, b.shape
        kt, nt = -(-k // BLOCK), -(-n // BLOCK)
        return a, sa.reshape(1, 1).expand(m, kt), 1, b, sb.reshape(g, 1, 1).expand(g, kt, nt), 2
    (n, m), k = a.shape, b.shape[1]
    mt = -(-m // BLOCK)
    return a, sa.reshape(1, 1).expand(n, mt), 1, b, sb.reshape(1, 1).expand(mt, k), 1


def _dequantized_mm(a, sa, b, sb, splits: GroupSplits, out_dtype, kind: str) -> torch.Tensor:
    """The CPU route: both operands dequantized to fp32 (FP8 values widen exactly), torch._grouped_mm in fp32."""
    if kind == "m":
        a_f = a.to(torch.float32) * sa
        b_f = b.to(torch.float32) * sb.reshape(-1, 1, 1)
        return torch._grouped_mm(a_f, b_f, offs=splits.offs).to(out_dtype)
    n, m = a.shape
    a_f = torch.empty_strided((n, m), (1, n), dtype=torch.float32, device=a.device).copy_(a).mul_(sa)
    b_f = torch.empty(b.shape, dtype=torch.float32, device=b.device).copy_(b).mul_(sb)
    return torch._grouped_mm(a_f, b_f, offs=splits.offs).to(out_dtype)


# --- block scaling ------------------------------------------------------------------------------------------
def grouped_block_mm(a: torch.Tensor, sa: torch.Tensor, a_dim: int, b: torch.Tensor, sb: torch.Tensor, b_dim: int,
                     splits: GroupSplits, out_dtype: torch.dtype, kind: str) -> torch.Tensor:
    """The block-scaled grouped GEMM (Float8BlockScaling): the dispatch point of its CUDA kernel.

    Operands in the layouts te_parallel.ops.gemm's block_mm reads, stacked per group (no copy):
    * kind "m" (fprop, dgrad): a [M, K] row-major with sa [M, ceil(K/128)] (1x128 tiles, a_dim 1, as
      gemm._rows_operand gives them: any strides); b [G, K, N], each b[g] column-major, with sb
      [G, ceil(K/128), ceil(N/128)] (128x128 blocks, b_dim 2) or [G, ceil(K/128), N] (1x128 tiles along K,
      b_dim 1), each sb[g] what gemm._rows_operand_b / _cols_operand_b give for one weight -> out [M, N].
    * kind "k" (wgrad): a = dyᵀ [N, M] row-major with sa [N, ceil(M/128)] (gemm._cols_operand); b = x [M, K]
      column-major with sb [ceil(M/128), K] (gemm._cols_operand_b), a_dim = b_dim = 1; the groups split the
      reduction dim M -> out [G, N, K].
    On CUDA: te_parallel.ops.grouped_block_gemm.grouped_block_mm_cuda(a, sa, a_dim, b, sb, b_dim, offs,
    out_dtype, kind), one launch, offs read on the device. Elsewhere both operands are dequantized and multiplied
    in fp32 (ops.gemm.block_mm's CPU numerics)."""
    if kind not in KINDS:
        raise ValueError(f"grouped_block_mm: kind must be 'm' (fprop, dgrad) or 'k' (wgrad), got {kind!r}")
    if a.is_cuda:
        from te_parallel.ops.grouped_block_gemm import grouped_block_mm_cuda

        return grouped_block_mm_cuda(a, sa, a_dim, b, sb, b_dim, splits.offs, out_dtype, kind)
    if kind == "m":
        if a.shape[0] == 0:
            return torch.zeros(0, b.shape[2], dtype=out_dtype, device=a.device)
        a_f = _dequantize(a, sa, (1, BLOCK) if a_dim == 1 else (BLOCK, BLOCK))
        b_f = _dequantize(b, sb, (BLOCK, 1) if b_dim == 1 else (BLOCK, BLOCK))
        return torch._grouped_mm(a_f, b_f, offs=splits.offs).to(out_dtype)
    (n, m), k = a.shape, b.shape[1]
    if m == 0:
        return torch.zeros(splits.num_groups, n, k, dtype=out_dtype, device=a.device)
    a_f = _dequantize(a, sa, (1, BLOCK))  # [N, M]
    b_f = _dequantize(b, sb, (BLOCK, 1))  # [M, K]
    # (A column-major, B row-major: the layouts in which torch._grouped_mm splits strided dims)
    return torch._grouped_mm(a_f.t().contiguous().t(), b_f.contiguous(), offs=splits.offs).to(out_dtype)


def _dequantize(data: torch.Tensor, scales: torch.Tensor, tile: Tuple[int, int]) -> torch.Tensor:
    """fp32 values of data [..., R, C] with one scale per (rows, cols) = `tile` tile: scales
    [..., ceil(R/tile[0]), ceil(C/tile[1])] (the edge tiles ragged)."""
    r, c = data.shape[-2:]
    s = scales.to(torch.float32)
    if tile[0] > 1:
        s = s.repeat_interleave(tile[0], dim=-2)[..., :r, :]
    if tile[1] > 1:
        s = s.repeat_interleave(tile[1], dim=-1)[..., :c]
    return data.to(torch.float32) * s


# --- the three GEMMs of a grouped linear layer, by operand type ------------------------------------------
# x and dy are high-precision tensors, Float8Tensors (one scale) or 1x128-tiled BlockwiseTensors (the cast of
# all the experts' rows at once); W is [G, N, K] in high precision, or a GroupedFloat8Weight / GroupedBlockWeight
# (ops.grouped_fp8). The pair decides the route, as in ops.gemm.
def grouped_fprop(x, w, splits: GroupSplits, out_dtype: torch.dtype, mm: MMParams = EXACT) -> torch.Tensor:
    """y [M, N]: y[rows_g] = x[rows_g] · W[g]ᵀ."""
    if type(x) is BlockwiseTensor:
        a, sa, a_dim = gemm._rows_operand(x)
        return grouped_block_mm(a, sa, a_dim, *w.rows_operand_b(), splits, out_dtype, "m")
    if isinstance(x, Float8Tensor):
        return fp8_grouped_mm(x.data, x.scale_inv, w.data.transpose(1, 2), w.scale_inv, splits, out_dtype, "m", mm)
    return grouped_mm(x, w, splits, "fprop")


def grouped_dgrad(dy, w, splits: GroupSplits, out_dtype: torch.dtype, mm: MMParams = EXACT) -> torch.Tensor:
    """dx [M, K]: dx[rows_g] = dy[rows_g] · W[g]."""
    if type(dy) is BlockwiseTensor:
        a, sa, a_dim = gemm._rows_operand(dy)
        return grouped_block_mm(a, sa, a_dim, *w.cols_operand_b(), splits, out_dtype, "m")
    if isinstance(dy, Float8Tensor):
        b = w.transposed().transpose(1, 2)  # [G, N, K], each W[g] column-major (from Wᵀ's bytes)
        return fp8_grouped_mm(dy.data, dy.scale_inv, b, w.scale_inv, splits, out_dtype, "m", mm)
    return grouped_mm(dy, w, splits, "dgrad")


def grouped_wgrad(dy, x, splits: GroupSplits, out_dtype: torch.dtype, mm: MMParams = EXACT) -> torch.Tensor:
    """dW [G, N, K]: dW[g] = dy[rows_g]ᵀ · x[rows_g] (zero for an empty group)."""
    if type(dy) is BlockwiseTensor:
        a, sa, a_dim = gemm._cols_operand(dy)
        b, sb, b_dim = gemm._cols_operand_b(x)
        return grouped_block_mm(a, sa, a_dim, b, sb, b_dim, splits, out_dtype, "k")
    if isinstance(dy, Float8Tensor):
        return fp8_grouped_mm(dy.transposed(), dy.scale_inv, x.transposed().t(), x.scale_inv, splits, out_dtype,
                              "k", mm)
    return grouped_mm(dy, x, splits, "wgrad").to(out_dtype)


# --- the fp64 reference ----------------------------------------------------------------------------------
def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], role: str) -> torch.Tensor:
    """What grouped_mm computes, in fp64 by a loop over the groups (for tests): the roles and shapes of
    grouped_mm, with a, b already dequantized where they were FP8."""
    a, b = a.double(), b.double()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    parts = [(s, s + c) for s, c in zip(starts, counts)]
    if role == "wgrad":
        return torch.stack([a[r0:r1].t() @ b[r0:r1] for r0, r1 in parts])
    if role == "fprop":
        rows = [a[r0:r1] @ b[g].t() for g, (r0, r1) in enumerate(parts)]
    else:
        rows = [a[r0:r1] @ b[g] for g, (r0, r1) in enumerate(parts)]
    return torch.cat(rows) if rows else a.new_zeros(0, b.shape[1] if role == "fprop" else b.shape[2])


# --- the autograd Function of a grouped linear layer ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class GroupedPlan:
    """How one grouped linear call runs (made by module.grouped_linear.GroupedLinear, read by GroupedLinearFunction).

    fp8: its FP8 casts (ops.grouped_fp8.GroupedFP8), or None in high precision; targets: where a fused wgrad
    accumulates (ops.linear.WgradTarget rows of dW [G·N, K]; None: dW is returned); par: the TP split
    (ops.linear.LinearParallel); reduce: this layer sums over par.group itself (row-parallel: y after fprop;
    column-parallel: dx after dgrad), else the caller does (TE's GroupedLinear leaves it to the MoE layer's
    combine); grad: autograd is recording; defer: delay_wgrad_compute's store, handed the weight gradient as a
    thunk to run later (None: it runs in backward); recast_input: x is kept in high precision and cast again
    for wgrad (TE's save_original_input)."""

    fp8: Optional[object]
    targets: Optional[list]
    par: object
    reduce: bool
    grad: bool
    defer: Optional[object] = None
    recast_input: bool = False


class _Saved:
    """What the backward of one GroupedLinearFunction forward needs."""

    __slots__ = ("x", "w", "splits", "plan", "act_dtype", "weight_dtype", "bias_dtype", "quantized", "shape_nk")


def _wgrad_operand(q):
    """Of a cast x, only what wgrad reads: the transposed bytes (per tensor) or the columnwise tiles (block)."""
    if type(q) is BlockwiseTensor:
        return q.only_columnwise()
    data_t = q.transposed()
    return Float8Tensor(data_t.t(), q.scale_inv, data_t)


class GroupedLinearFunction(torch.autograd.Function):
    """y[rows_g] = x[rows_g]·W[g]ᵀ (+ b[g]) for every expert g in one grouped GEMM per pass.

    inp [..., K] (its rows, flattened, grouped by `splits`); weight [G·N, K] (expert g's rows at g·N; the
    experts' parameters concatenated without a copy); bias [G, N] or None. Tensor parallelism (plan.reduce):
    row-parallel y [M, N] is a partial sum over the K shards, all-reduced before the bias is added;
    column-parallel dx [M, K] is a partial sum over the N shards, all-reduced in backward (async, under wgrad)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, splits: GroupSplits, plan: GroupedPlan):
        g = splits.num_groups
        n, k = weight.shape[0] // g, weight.shape[1]
        act, fp8 = inp.dtype, plan.fp8
        x2d = inp.reshape(-1, k)  # [M, K]
        quantized = fp8 is not None and fp8.compute and splits.rows > 0
        need_wgrad = plan.grad and (weight.requires_grad or bool(plan.targets))
        if quantized:
            keep_cast = need_wgrad and not plan.recast_input
            x_op, w_op = fp8.cast_input(x2d, transpose=keep_cast), fp8.weight
            y = grouped_fprop(x_op, w_op, splits, act, fp8.recipe.fp8_gemm_fprop)
            x_saved = _wgrad_operand(x_op) if keep_cast else x2d
        else:
            if fp8 is not None and splits.rows:  # calibration: the amax the cast would record
                fp8.record_amax(x2d, backward=False)
            w_op = weight.view(g, n, k)
            w_op = w_op if w_op.dtype == act else w_op.to(act)
            y = grouped_fprop(x2d, w_op, splits, act)
            x_saved = x2d
        if plan.reduce and plan.par.active and plan.par.mode == "row":
            all_reduce(y, plan.par.group)
        if bias is not None:  # each row gets its expert's bias
            y = y.add_(bias.to(act).index_select(0, splits.group_ids()))
        s = _Saved()
        s.x = x_saved if need_wgrad else None
        s.w = w_op if ctx.needs_input_grad[0] else None
        s.splits, s.plan, s.act_dtype, s.quantized, s.shape_nk = splits, plan, act, quantized, (n, k)
        s.weight_dtype, s.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        ctx.s, ctx.inp_shape = s, inp.shape
        return y.view(*inp.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        s = ctx.s
        plan, splits, n = s.plan, s.splits, s.shape_nk[0]
        dy2d = grad_out.reshape(-1, n).to(s.act_dtype).contiguous()  # [M, N]
        need_dx, need_w, need_b = ctx.needs_input_grad[:3]
        need_dw = need_w or bool(plan.targets)
        dbias = group_sums(dy2d, splits).to(s.bias_dtype) if need_b else None
        fp8 = plan.fp8
        if s.quantized:
            dy = fp8.cast_grad(dy2d, rowwise=need_dx, transpose=need_dw)
        else:
            if fp8 is not None and splits.rows:
                fp8.record_amax(dy2d, backward=True)
            dy = dy2d
        dx, handle = None, None
        if need_dx:
            mm = fp8.recipe.fp8_gemm_dgrad if s.quantized else EXACT
            dx = grouped_dgrad(dy, s.w, splits, s.act_dtype, mm)
            if plan.reduce and plan.par.active and plan.par.mode == "column":
                handle = all_reduce(dx, plan.par.group, async_op=True)  # overlaps wgrad
        s.w = None
        dw = None
        if need_dw:
            if plan.defer is not None:  # delay_wgrad_compute: the module's backward_dw() runs it
                plan.defer(lambda: _wgrad(s, dy))
            else:
                dw = _wgrad(s, dy)
        if handle is not None:
            handle.wait()
        ctx.s = None
        return (None if dx is None else dx.view(ctx.inp_shape)), (dw if need_w else None), dbias, None, None


def _wgrad(s: _Saved, dy) -> Optional[torch.Tensor]:
    """dW [G·N, K] of one backward, or None where it went into the weights' main_grad (fused accumulation)."""
    plan, splits, (n, k) = s.plan, s.splits, s.shape_nk
    x = s.x
    if s.quantized and plan.recast_input:  # (current / block scaling: the same bytes as the forward's cast)
        x = _wgrad_operand(plan.fp8.cast_input(x, transpose=True))
    mm = plan.fp8.recipe.fp8_gemm_wgrad if s.quantized else EXACT
    dw = grouped_wgrad(dy, x, splits, torch.float32 if plan.targets else s.weight_dtype, mm)
    dw = dw.reshape(splits.num_groups * n, k)
    s.x = None
    if plan.targets:
        _accumulate_main_grad(plan.targets, dw)
        return None
    return dw


def group_sums(t: torch.Tensor, splits: GroupSplits) -> torch.Tensor:
    """[G, C] fp32: the sum of each group's rows of t [M, C] (each expert's bias gradient)."""
    out = torch.zeros(splits.num_groups, t.shape[1], dtype=torch.float32, device=t.device)
    return out.index_add_(0, splits.group_ids(), t.to(torch.float32))
