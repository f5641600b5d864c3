"""Grouped block-scaled FP8 GEMM (Triton): the experts of a Mixture-of-Experts layer in one launch, with
DeepSeek-V3's scaling (1x128 tiles for activations and gradients, 128x128 blocks or 1x128 tiles for weights).

The rows of the routed tokens are sorted by expert; `offs` [G] (int32 or int64, on the GPU) holds the
cumulative end row of each group, as torch._grouped_mm takes it: group g is rows [offs[g-1], offs[g]) (from
row 0 for g = 0); offs must be non-decreasing and at most M. Two kinds of GEMM, per group g:

    kind "m" (fprop, dgrad)  out[rows_g]  = A[rows_g] · B[g]          A [M, K], B [G, K, N], out [M, N]
    kind "k" (wgrad)         out[g]       = A[:, rows_g] · B[rows_g]  A [N, M], B [M, K],    out [G, N, K]

with fprop y = x·Wᵀ (A = x, B[g] = W[g]ᵀ), dgrad dx = dy·W (A = dy, B[g] = W[g] as its transposed bytes)
and wgrad dW[g] = dy[rows_g]ᵀ·x[rows_g] (A = dyᵀ, B = x, both quantized along M). Operands come in the
layouts of te_parallel.ops.gemm's block_mm (its _rows_operand / _cols_operand / *_b helpers), no copy:

* kind "m": A [M, K] row-major, sa [M, ceil(K/128)] (1x128 tiles along K; any strides, [K/128, M]
  storage as the casts write it); B [G, K, N] with each B[g] column-major (the transpose of a contiguous
  [N, K] weight), sb [G, ceil(K/128), ceil(N/128)] (128x128 blocks, b_dim 2) or [G, ceil(K/128), N]
  (1x128 tiles along K, b_dim 1). Rows past offs[-1] are written as zeros.
* kind "k": A [N, M] row-major (dyᵀ), sa [N, ceil(M/128)]; B [M, K] column-major (x, from xᵀ's bytes),
  sb [ceil(M/128), K]. The tiles run along M on one grid for all groups (the column-wise casts of the
  whole dy and x). A group whose rows start or end inside a tile still gets the exact product of the
  dequantized values: that chunk's loads are masked to the group's rows (its scale is shared with the
  neighbouring group, which the algebra allows), so groups need not be padded to 128 rows. Groups of
  multiples of 128 rows never take that path (masked along M, it is slower than the main loop).

Math: scales are scale_inv (dequantization multipliers), so with one 128-wide K chunk c at a time

    out[i, j] = sum_c (sum_{k in c} A[i, k] B[k, j]) * sa[i, c] * sb[c, j]

Each chunk's FP8 product runs on the tensor cores from a zero accumulator and is promoted into the fp32
accumulator times its two scales ("split accumulation": the tensor cores' FP8 sums keep ~14 bits, so a
chunk never sums more than 128 products there). BLOCK_K is 128 in every config, one scale per step.

Programs and groups (one launch, no host sync, host work independent of G):

* kind "m": a 1-D grid over an upper bound of the (group, M tile, N tile) triples: each group's rows make
  ceil(rows/BLOCK_M) tiles of their own (a tile never straddles two groups: they use different B), so
  there are at most ceil(M/BLOCK_M) + G + 1 M tiles (the + 1: the rows past offs[-1], a tail "group"
  that writes zeros). Program p takes M tile u = p // n_tiles and finds its group on the device: from offs
  it sums the groups' tile counts in chunks of 128 groups (tl.cumsum) and counts the groups that end at or
  before u. Programs past the last tile return at once; inside a group the tiles are swizzled
  (GROUP_M M tiles per column of N tiles) so that neighbouring programs share A rows and B[g] columns in L2.
* kind "k": a 1-D grid of G * (N tiles) * (K tiles), group-major; program p's group is p // tiles, its
  reduction runs over the group's 128-row chunks (an empty group stores zeros).

Eager calls launch the kernel directly; traced code calls the custom op te_parallel::grouped_block_mm,
whose fake kernel gives the output's shape, so that torch.compile and CUDA graphs hold it as one node. The
kernels are autotuned over _CONFIGS (kind "k": _K_CONFIGS) on first use per shape key (N, K and the rows rounded
to a power of two): make that first call before capturing a CUDA graph. `autotune_candidates` narrows the
candidates inside a `with` block (one tile: no timing runs, one compilation per variant).

Per-tensor FP8 (te_parallel.ops.grouped_gemm's TRITON route) runs here too: a per-tensor scale is a block scale
that is the same in every tile, passed as a stride-0 view (sa [M, K/128] of one scale, sb [G, K/128, N/128] of
each expert's), so the same kernels serve E5M2 operands and device-sized wgrad groups.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from te_parallel.fp8.blockwise import BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: usable() is False
    triton = None

__all__ = ["usable", "usable_on", "grouped_block_mm_cuda", "grouped_block_mm_reference", "Tile",
           "autotune_candidates"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("m", "k")
_BLOCK_G = 128  # groups read per step of the group search
_I32_MAX = 2**31 - 1
_DEVICE_OK: dict = {}  # CUDA device index -> capability >= 9.0 and triton importable
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


@dataclass(frozen=True)
class Tile:
    """One launch configuration: the output tile per program (BLOCK_K is always 128, one scale per step)."""

    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# For the H200 (sm_90): 128x128 with 8 warps (two warpgroups of 64 rows) and 64x128 with 4 keep the chunk's
# product and the accumulator in registers (a split-accumulation dot holds both, 2 x 64 fp32 per thread); 256
# columns need 8 warps for the same (128x256 spills: ptxas, Triton 3.6). Every stage holds
# (BLOCK_M + BLOCK_N) x 128 FP8 bytes of shared memory.
_CONFIGS = (
    Tile(128, 128, num_warps=8, num_stages=3),
    Tile(128, 128, num_warps=8, num_stages=4),
    Tile(64, 128, num_warps=4, num_stages=3),
    Tile(64, 128, num_warps=4, num_stages=4),
    Tile(64, 256, num_warps=8, num_stages=3),
    Tile(64, 256, num_warps=8, num_stages=4),
)
# Kind "k" (wgrad) differs from kind "m" in two ways that these extra candidates address: each program's reduction
# is one group's rows only (Qwen3-like routing: ~1,024 rows, 8 chunks of 128, against 12-16 for fprop / dgrad),
# so a tile's prologue (the pipeline's first loads) and epilogue (its store) weigh about twice as much; and
# its promotion scales by an outer product sa[n] * sb[k] (one more fp32 tile in registers than kind "m"'s row
# scale). Smaller tiles and fewer stages let two or three programs share an SM, one's loads and stores running
# under another's tensor-core work; 128x64 keeps the long side on dyᵀ's rows.
_K_CONFIGS = _CONFIGS + (
    Tile(128, 64, num_warps=4, num_stages=3),
    Tile(128, 64, num_warps=4, num_stages=4),
    Tile(64, 128, num_warps=4, num_stages=2),
    Tile(128, 128, num_warps=8, num_stages=2),
)


def usable(t: torch.Tensor) -> bool:
    """True for a CUDA FP8 operand on an sm_90+ GPU with triton importable (asked once per device)."""
    return t.is_cuda and t.dtype in FP8_DTYPES and _device_ok(t.get_device())


def usable_on(device: torch.device) -> bool:
    """usable() for FP8 operands on `device`, without a tensor: a CUDA device of compute capability >= 9.0 with
    triton importable."""
    if device.type != "cuda":
        return False
    return _device_ok(device.index if device.index is not None else _current_device())


@torch.compiler.assume_constant_result
def _device_ok(index: int) -> bool:
    ok = _DEVICE_OK.get(index)
    if ok is None:
        ok = _DEVICE_OK[index] = triton is not None and torch.cuda.get_device_capability(index) >= (9, 0)
    return ok


Offsets = Union[torch.Tensor, Sequence[int]]


def grouped_block_mm_cuda(a: torch.Tensor, sa: torch.Tensor, a_dim: int, b: torch.Tensor, sb: torch.Tensor,
                          b_dim: int, offs: Offsets, out_dtype: torch.dtype, kind: str) -> torch.Tensor:
    """The grouped GEMM of the module doc in one kernel launch: out [M, N] (kind "m") or [G, N, K] ("k").

    offs: cumulative end rows [G] on a's device (no copy, no sync). A list or CPU tensor is checked on the
    host (non-decreasing, at most M) and copied to the device."""
    offs = _device_offsets(offs, a, kind)
    _check(a, sa, a_dim, b, sb, b_dim, offs, out_dtype, kind)
    if not usable(a):
        raise ValueError(f"grouped_block_mm_cuda: needs CUDA operands on an sm_90+ GPU with triton installed, got "
                         f"{a.device} tensors (the CPU computes grouped_block_mm_reference)")
    if torch.compiler.is_compiling():
        return torch.ops.te_parallel.grouped_block_mm(a, sa, a_dim, b, sb, b_dim, offs, out_dtype, kind)
    return _launch(a, sa, b, sb, b_dim, offs, out_dtype, kind)


@contextlib.contextmanager
def autotune_candidates(m_tiles: Sequence[Tile], k_tiles: Sequence[Tile]):
    """Inside the block the autotuned launches choose among m_tiles (kind "m") and k_tiles (kind "k") only, with
    choices made afresh; on leaving it, the candidates and the choices of before are back. A single tile per kind
    skips the timing runs and compiles one configuration per kernel variant instead of up to ten (what short test
    runs need; every tile computes the same product, in another summation order)."""
    for name, tiles in (("m_tiles", m_tiles), ("k_tiles", k_tiles)):
        if not tiles or not all(isinstance(t, Tile) for t in tiles):
            raise ValueError(f"autotune_candidates: {name} must be a non-empty sequence of Tile, got {tiles!r}")
    if triton is None:  # (no kernels to tune)
        yield
        return
    tuners = ((_grouped_m_tuned, m_tiles), (_grouped_k_tuned, k_tiles))
    saved = [(tuner.configs, tuner.cache) for tuner, _ in tuners]
    try:
        for tuner, tiles in tuners:
            tuner.configs, tuner.cache = [_config(t) for t in tiles], {}
        yield
    finally:
        for (tuner, _), (configs, cache) in zip(tuners, saved):
            tuner.configs, tuner.cache = configs, cache


def _device_offsets(offs: Offsets, a: torch.Tensor, kind: str) -> torch.Tensor:
    if isinstance(offs, torch.Tensor) and offs.device == a.device:
        return offs
    ends = [int(v) for v in (offs.tolist() if isinstance(offs, torch.Tensor) else offs)]
    rows = a.shape[0] if kind == "m" else a.shape[1]
    if any(e < s for s, e in zip([0] + ends, ends)) or (ends and ends[-1] > rows):
        raise ValueError(f"grouped_block_mm: offs {ends} must be non-decreasing cumulative row ends, at most the "
                         f"{rows} rows of the operand")
    return torch.tensor(ends, dtype=torch.int32, device=a.device)


def _out_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, kind: str):
    return (a.shape[0], b.shape[2]) if kind == "m" else (offs.shape[0], a.shape[0], b.shape[1])


def _check(a, sa, a_dim, b, sb, b_dim, offs, out_dtype, kind) -> None:
    """One-line errors for operands that do not fit the module doc's layouts."""
    where = f"grouped_block_mm(kind={kind!r})"
    if kind not in KINDS:
        raise ValueError(f"grouped_block_mm: kind must be 'm' (fprop, dgrad) or 'k' (wgrad), got {kind!r}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"{where}: a and b must be FP8 (e4m3fn or e5m2), got {a.dtype} and {b.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: offs must be a 1-D int32 (or int64) tensor, got {offs.dtype} "
                         f"{tuple(offs.shape)}")
    if sa.dtype != torch.float32 or sb.dtype != torch.float32:
        raise ValueError(f"{where}: scales must be float32 scale_inv, got {sa.dtype} and {sb.dtype}")
    groups = offs.shape[0]
    if a.dim() != 2 or b.dim() != (3 if kind == "m" else 2):
        raise ValueError(f"{where}: a must be 2-D and b {3 if kind == 'm' else 2}-D, got a {tuple(a.shape)} and "
                         f"b {tuple(b.shape)}")
    if kind == "m":
        (m, k), n = a.shape, b.shape[-1]
        kt, nb = -(-k // BLOCK), (-(-n // BLOCK) if b_dim == 2 else n)
        want = {"a_dim": (a_dim, 1), "b_dim": (b_dim, b_dim if b_dim in (1, 2) else "1 or 2"),
                "b": (tuple(b.shape), (groups, k, n)), "sa": (tuple(sa.shape), (m, kt)),
                "sb": (tuple(sb.shape), (groups, kt, nb))}
    else:
        (n, m), k = a.shape, b.shape[-1]
        mt = -(-m // BLOCK)
        want = {"a_dim": (a_dim, 1), "b_dim": (b_dim, 1), "b": (tuple(b.shape), (m, k)),
                "sa": (tuple(sa.shape), (n, mt)), "sb": (tuple(sb.shape), (mt, k))}
        if m * 256 > _I32_MAX:
            raise ValueError(f"{where}: {m} rows; the kernel's in-tile offsets need fewer than {_I32_MAX // 256}")
    bad = [f"{name} is {got}, need {need}" for name, (got, need) in want.items() if got != need]
    if bad:
        raise ValueError(f"{where}: a {tuple(a.shape)}, offs [{groups}]: " + "; ".join(bad))
    for name, t in (("sa", sa), ("b", b), ("sb", sb), ("offs", offs)):
        if t.device != a.device:
            raise ValueError(f"{where}: operands, scales and offs must be on one device: a is on {a.device}, "
                             f"{name} on {t.device}")


def _launch(a, sa, b, sb, b_dim, offs, out_dtype, kind, tile: Optional[Tile] = None) -> torch.Tensor:
    """The kernel of `kind` into a fresh output; `tile` fixes the configuration (else autotuned)."""
    out = torch.empty(_out_shape(a, b, offs, kind), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    launch = _launch_m if kind == "m" else _launch_k
    guard = contextlib.nullcontext()
    if a.is_cuda and a.get_device() != _current_device():  # (Triton launches on the current device)
        guard = torch.cuda.device(a.get_device())
    with guard:
        launch(a, sa, b, sb, b_dim, offs, out, tile)
    return out


def _meta(tile: Optional[Tile]) -> dict:
    if tile is None:
        return {}
    return dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, GROUP_M=tile.group_m, num_warps=tile.num_warps,
                num_stages=tile.num_stages)


def _launch_m(a, sa, b, sb, b_dim, offs, out, tile):
    (m, k), n, groups = a.shape, out.shape[1], offs.shape[0]

    def grid(meta):  # an upper bound of the M tiles of all groups and the tail, times the N tiles
        return ((-(-m // meta["BLOCK_M"]) + groups + 1) * -(-n // meta["BLOCK_N"]),)

    kernel = _grouped_m_tuned if tile is None else _grouped_m_kernel
    kernel[grid](a, sa, b, sb, out, offs, m, n, k, groups, _bucket(m), *a.stride(), *sa.stride(), *b.stride(),
                 *sb.stride(), *out.stride(), SB_BLOCKS=b_dim == 2, BLOCK_K=BLOCK, BLOCK_G=_BLOCK_G, **_meta(tile))


def _launch_k(a, sa, b, sb, b_dim, offs, out, tile):
    (n, m), k, groups = a.shape, out.shape[2], offs.shape[0]

    def grid(meta):
        return (groups * -(-n // meta["BLOCK_M"]) * -(-k // meta["BLOCK_N"]),)

    kernel = _grouped_k_tuned if tile is None else _grouped_k_kernel
    kernel[grid](a, sa, b, sb, out, offs, m, n, k, _bucket(m), *a.stride(), *sa.stride(), *b.stride(),
                 *sb.stride(), *out.stride(), BLOCK_K=BLOCK, **_meta(tile))


def _bucket(rows: int) -> int:
    """The autotuning key's row count: a power of two (the rows routed per step vary)."""
    return 1 << max(rows - 1, 0).bit_length()


# ------------------------------------------------------------------------------------------------
# The op of traced code (torch.compile, CUDA graphs made from compiled graphs): the same launch behind
# torch's dispatcher.
@torch.library.custom_op("te_parallel::grouped_block_mm", mutates_args=(), device_types="cuda")
def _grouped_block_mm_op(a: torch.Tensor, sa: torch.Tensor, a_dim: int, b: torch.Tensor, sb: torch.Tensor, b_dim: int,
                         offs: torch.Tensor, out_dtype: torch.dtype, kind: str) -> torch.Tensor:
    return _launch(a, sa, b, sb, b_dim, offs, out_dtype, kind)


@_grouped_block_mm_op.register_fake
def _(a, sa, a_dim, b, sb, b_dim, offs, out_dtype, kind):
    return a.new_empty(_out_shape(a, b, offs, kind), dtype=out_dtype)


# ------------------------------------------------------------------------------------------------
# The reference: per group, both operands dequantized and multiplied (fp32 by default; fp64 for tests).
def grouped_block_mm_reference(a: torch.Tensor, sa: torch.Tensor, a_dim: int, b: torch.Tensor, sb: torch.Tensor,
                               b_dim: int, offs: Offsets, out_dtype: torch.dtype, kind: str, *,
                               compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """grouped_block_mm_cuda's result from torch ops on any device: a loop over the groups (host offsets).
    out_dtype may also be float64 here (with compute_dtype float64: the exact product, rounded once)."""
    ends = [int(v) for v in (offs.tolist() if isinstance(offs, torch.Tensor) else offs)]
    _check(a, sa, a_dim, b, sb, b_dim, torch.tensor(ends, dtype=torch.int32, device=a.device),
           torch.float32 if out_dtype == torch.float64 else out_dtype, kind)
    a_val = _dequantize(a, sa, compute_dtype)  # [M, K] or [N, M]: tiles along dim 1
    rows = a.shape[0] if kind == "m" else a.shape[1]
    bounds = [(min(max(s, 0), rows), min(max(e, 0), rows)) for s, e in zip([0] + ends, ends)]
    if kind == "k":
        b_val = _dequantize(b.t(), sb.t(), compute_dtype).t()  # [M, K]
        out = torch.stack([a_val[:, r0:r1] @ b_val[r0:r1] for r0, r1 in bounds]) if bounds else \
            a_val.new_zeros(0, a.shape[0], b.shape[1])
        return out.to(out_dtype)
    out = a_val.new_zeros(a.shape[0], b.shape[2])
    for g, (r0, r1) in enumerate(bounds):
        if r1 > r0:
            b_val = _dequantize(b[g].t(), sb[g].t(), compute_dtype, blocks=b_dim == 2).t()  # [K, N]
            out[r0:r1] = a_val[r0:r1] @ b_val
    return out.to(out_dtype)


def _dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, blocks: bool = False) -> torch.Tensor:
    """data [R, C] times its scales [R, ceil(C/128)] (1x128 tiles along C) or [ceil(R/128), ceil(C/128)]
    (blocks), in `dtype` (fp8 values and fp32 scales widen exactly; the product is exact in fp64)."""
    r, c = data.shape
    s = scales.to(dtype).repeat_interleave(BLOCK, dim=1)[:, :c]
    if blocks:
        s = s.repeat_interleave(BLOCK, dim=0)[:r]
    return data.to(dtype) * s


# ------------------------------------------------------------------------------------------------
# The kernels (pointers, sizes and strides only). Tile offsets are int64, offsets inside a tile int32.
if triton is not None:

    @triton.jit
    def _group_rows(offs_ptr, g, G, M):
        """Rows [row0, row1) of group g (g == G: the rows past the last group), clamped to [0, M]."""
        row0 = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        row1 = tl.load(offs_ptr + g, mask=g < G, other=M)
        row0 = tl.minimum(tl.maximum(row0, 0), M)
        return row0, tl.maximum(tl.minimum(tl.maximum(row1, 0), M), row0)

    @triton.jit
    def _find_group(offs_ptr, G, M, u, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
        """(g, first M tile of g) for global M tile u: g is the number of groups whose tiles end at or before
        u (empty groups have none); g == G is the tail past offs[-1]."""
        g = 0
        tile0 = 0
        carry = 0
        for c0 in range(0, G, BLOCK_G):
            idx = c0 + tl.arange(0, BLOCK_G)
            inside = idx < G
            ends = tl.minimum(tl.maximum(tl.load(offs_ptr + idx, mask=inside, other=0), 0), M)
            starts = tl.minimum(tl.maximum(tl.load(offs_ptr + idx - 1, mask=inside & (idx > 0), other=0), 0), M)
            tiles = tl.where(inside, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0).to(tl.int32)
            before = inside & (tl.cumsum(tiles, 0) + carry <= u)
            g += tl.sum(before.to(tl.int32), 0)
            tile0 += tl.sum(tl.where(before, tiles, 0), 0)
            carry += tl.sum(tiles, 0)
        return g, tile0

    @triton.jit
    def _swizzle(local, row_tiles, col_tiles, GROUP_M: tl.constexpr):
        """(row tile, column tile) of a group's program `local`: GROUP_M row tiles per column, then across."""
        width = GROUP_M * col_tiles
        first = (local // width) * GROUP_M
        size = tl.minimum(row_tiles - first, GROUP_M)
        return first + (local % width) % size, (local % width) // size

    @triton.jit
    def _grouped_m_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offs_ptr, M, N, K, G, ROWS_BUCKET,
                          stride_am, stride_ak, stride_sam, stride_sak, stride_bg, stride_bk, stride_bn,
                          stride_sbg, stride_sbk, stride_sbn, stride_om, stride_on,
                          SB_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr):
        # out[rows_g, n] = sum_kt (A[rows_g, kt] . B[g][kt, n]) * sa[rows_g, kt] * sb[g][kt, n or n // 128]
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        g, tile0 = _find_group(offs_ptr, G, M, pid // n_tiles, BLOCK_M, BLOCK_G)
        row0, row1 = _group_rows(offs_ptr, g, G, M)
        m_tiles = tl.cdiv(row1 - row0, BLOCK_M)
        local = pid - tile0 * n_tiles
        if local >= m_tiles * n_tiles:  # past the last tile of all groups (the grid is an upper bound)
            return
        mi, ni = _swizzle(local, m_tiles, n_tiles, GROUP_M)
        m0 = (row0 + mi * BLOCK_M).to(tl.int64)
        n0 = ni.to(tl.int64) * BLOCK_N
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < row1 - m0
        col_ok = cols < N - n0
        a_tile = a_ptr + m0 * stride_am + (rows[:, None] * stride_am + ks[None, :] * stride_ak)
        b_tile = b_ptr + g.to(tl.int64) * stride_bg + n0 * stride_bn + (ks[:, None] * stride_bk
                                                                         + cols[None, :] * stride_bn)
        sa_rows = sa_ptr + m0 * stride_sam + rows * stride_sam
        # B's scales: one per 128x128 block (a tile of at most 128 columns lies in one block, n0 // 128: one
        # scalar per step, so the promotion is one FMA per element), or per column of each 1x128 tile
        ONE_BLOCK: tl.constexpr = SB_BLOCKS and BLOCK_N <= BLOCK_K
        if ONE_BLOCK:
            sb_cols = sb_ptr + g.to(tl.int64) * stride_sbg + (n0 // BLOCK_K) * stride_sbn
        elif SB_BLOCKS:
            sb_cols = sb_ptr + g.to(tl.int64) * stride_sbg + ((n0 + cols) // BLOCK_K) * stride_sbn
        else:
            sb_cols = sb_ptr + g.to(tl.int64) * stride_sbg + (n0 + cols) * stride_sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_steps = tl.where(g < G, tl.cdiv(K, BLOCK_K), 0)  # the tail past offs[-1] stores zeros
        for kt in range(0, k_steps):
            k_ok = ks < K - kt * BLOCK_K
            a = tl.load(a_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            sa = tl.load(sa_rows + kt * stride_sak, mask=row_ok, other=0.0)
            if ONE_BLOCK:
                acc += tl.dot(a, b) * (sa * tl.load(sb_cols + kt * stride_sbk))[:, None]
            else:
                sb = tl.load(sb_cols + kt * stride_sbk, mask=col_ok, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            a_tile += BLOCK_K * stride_ak
            b_tile += BLOCK_K * stride_bk
        out = out_ptr + m0 * stride_om + n0 * stride_on + (rows[:, None] * stride_om + cols[None, :] * stride_on)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _k_edge(acc, a_base, b_base, sa_base, sb_base, c, lo, hi, n_ok, k_ok, stride_an, stride_am, stride_bm,
                stride_bk, stride_san, stride_sam, stride_sbm, stride_sbk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc + (A[:, chunk c] . B[chunk c, :]) * sa[:, c] * sb[c, :] over rows [lo, hi) of chunk c only: a
        group edge inside a 128-row tile (masked loads along M, at most two per group, outside the main loop)."""
        ms = tl.arange(0, BLOCK_K)
        first = tl.cast(c, tl.int64) * BLOCK_K
        m_ok = (ms >= lo - first) & (ms < hi - first)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        a = tl.load(a_base + first * stride_am + (rows[:, None] * stride_an + ms[None, :] * stride_am),
                    mask=n_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(b_base + first * stride_bm + (ms[:, None] * stride_bm + cols[None, :] * stride_bk),
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_base + c * stride_sam + rows * stride_san, mask=n_ok, other=0.0)
        sb = tl.load(sb_base + c * stride_sbm + cols * stride_sbk, mask=k_ok, other=0.0)
        return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])

    @triton.jit
    def _grouped_k_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offs_ptr, M, N, K, ROWS_BUCKET,
                          stride_an, stride_am, stride_san, stride_sam, stride_bm, stride_bk, stride_sbm, stride_sbk,
                          stride_og, stride_on, stride_ok,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # out[g, n, k] = sum over the 128-row chunks c of group g: (A[n, c] . B[c, k]) * sa[n, c] * sb[c, k]
        # (BLOCK_M tiles out's rows = N, BLOCK_N its columns = K, BLOCK_K = 128 rows of M per step)
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BLOCK_M)
        k_tiles = tl.cdiv(K, BLOCK_N)
        g = pid // (n_tiles * k_tiles)
        ni, ki = _swizzle(pid % (n_tiles * k_tiles), n_tiles, k_tiles, GROUP_M)
        row0, row1 = _group_rows(offs_ptr, g, g + 1, M)
        n0 = ni.to(tl.int64) * BLOCK_M
        k0 = ki.to(tl.int64) * BLOCK_N
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ms = tl.arange(0, BLOCK_K)
        n_ok = rows < N - n0
        k_ok = cols < K - k0
        a_base = a_ptr + n0 * stride_an
        b_base = b_ptr + k0 * stride_bk
        sa_base = sa_ptr + n0 * stride_san
        sb_base = sb_ptr + k0 * stride_sbk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # whole chunks [full0, full1) unmasked along M; a group edge inside a chunk takes _k_edge
        full0 = tl.cdiv(row0, BLOCK_K)
        full1 = tl.maximum(row1 // BLOCK_K, full0)
        if (row0 < full0 * BLOCK_K) & (row0 < row1):  # the head chunk (the whole group if inside one chunk)
            acc = _k_edge(acc, a_base, b_base, sa_base, sb_base, full0 - 1, row0, row1, n_ok, k_ok, stride_an,
                          stride_am, stride_bm, stride_bk, stride_san, stride_sam, stride_sbm, stride_sbk,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        first = full0.to(tl.int64) * BLOCK_K
        a_tile = a_base + first * stride_am + (rows[:, None] * stride_an + ms[None, :] * stride_am)
        b_tile = b_base + first * stride_bm + (ms[:, None] * stride_bm + cols[None, :] * stride_bk)
        sa_rows = sa_base + rows * stride_san
        sb_cols = sb_base + cols * stride_sbk
        for c in range(full0, full1):
            a = tl.load(a_tile, mask=n_ok[:, None], other=0.0)
            b = tl.load(b_tile, mask=k_ok[None, :], other=0.0)
            sa = tl.load(sa_rows + c * stride_sam, mask=n_ok, other=0.0)
            sb = tl.load(sb_cols + c * stride_sbm, mask=k_ok, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            a_tile += BLOCK_K * stride_am
            b_tile += BLOCK_K * stride_bm
        if row1 > full1 * BLOCK_K:  # the tail chunk (full1 >= full0: never the head's)
            acc = _k_edge(acc, a_base, b_base, sa_base, sb_base, full1, row0, row1, n_ok, k_ok, stride_an,
                          stride_am, stride_bm, stride_bk, stride_san, stride_sam, stride_sbm, stride_sbk,
                          BLOCK_M, BLOCK_N, BLOCK_K)
        out = out_ptr + g.to(tl.int64) * stride_og + n0 * stride_on + k0 * stride_ok + (
            rows[:, None] * stride_on + cols[None, :] * stride_ok)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])

    def _config(t: Tile):
        return triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "GROUP_M": t.group_m},
                             num_warps=t.num_warps, num_stages=t.num_stages)

    def _autotuned(kernel, tiles, key):
        return triton.autotune(configs=[_config(t) for t in tiles], key=key)(kernel)

    _grouped_m_tuned = _autotuned(_grouped_m_kernel, _CONFIGS, ["N", "K", "ROWS_BUCKET", "SB_BLOCKS"])
    _grouped_k_tuned = _autotuned(_grouped_k_kernel, _K_CONFIGS, ["N", "K", "ROWS_BUCKET"])
