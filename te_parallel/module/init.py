"""Layout-independent initialisers: every element's value is a pure function of a per-parameter key and
the element's index in the FULL (TP=1) tensor, so the same seed gives the same full weights at any
tensor-parallel size, and each rank computes only its own shard's values.

The key is drawn once per parameter from torch's default (CPU) generator, so it follows
`torch.manual_seed` and, with the same seed on every rank (as usual), is the same on every rank.
The value of full-tensor element i is

    w0..w3 = Philox4x32-10(counter=(i mod 2³², i div 2³², 0, 0), key=(key mod 2³², key div 2³²))
    u1 = (53 bits of w0,w1 + 1)·2⁻⁵³ ∈ (0, 1],  u2 = (53 bits of w2,w3)·2⁻⁵³ ∈ [0, 1)
    z  = sqrt(−2·ln u1)·cos(2π·u2)              (Box–Muller in fp64)
    w  = mean + std·z, rounded once to the parameter's dtype

Everything is elementwise torch arithmetic on int64/fp64 tensors. The 32×32-bit products are made
from 16-bit halves so no int64 product overflows, and ln and cos are evaluated with +, −, ×, ÷ and
sqrt only (range reduction, then polynomials): those are correctly rounded on every device and in
every vectorisation of torch's kernels, where torch.log / torch.cos are not (SLEEF on a CPU vector,
libm on its tail, libdevice on CUDA can differ in the last bit). So a value depends only on
(key, index, dtype), not on the shard it is computed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from te_parallel.parallel.sharding import ShardLayout, replicated

DEFAULT_INIT_STD = 0.023  # TE's default init: N(0, 0.023²)
# Elements generated per step, bounding the int64/fp64 temporaries: cache-sized on the CPU (0.2 µs per
# element on one core), large on a GPU, where each step is ~300 kernel launches.
_CHUNK_CPU, _CHUNK_DEVICE = 1 << 16, 1 << 22
_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_LOG_TERMS = tuple(1.0 / (2 * k + 1) for k in range(12))  # atanh series of ln
_COS_TERMS = tuple((-1) ** k / math.factorial(2 * k) for k in range(11))
_SIN_TERMS = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(11))

Box = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]  # (local start, full start, size) per dim


# --- the counter-based generator ------------------------------------------------------------------
def _mulhilo(a: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a·m for a in [0, 2³²) and a 32-bit constant m, with no int64 product
    above 2⁴⁸ (torch's int64 overflow is not something to rely on)."""
    p_lo, p_hi = a * (m & 0xFFFF), a * (m >> 16)
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (t >> 32), t & _M32


def philox4x32(counter: Sequence[torch.Tensor], key: int, rounds: int = 10) -> List[torch.Tensor]:
    """Random123's Philox4x32 on int64 tensors holding 32-bit words; key is a 64-bit int."""
    c0, c1, c2, c3 = counter
    k0, k1 = key & _M32, (key >> 32) & _M32
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def _horner(x: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    out = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        out = out * x + c
    return out


def _log(u: torch.Tensor) -> torch.Tensor:
    """ln u for u > 0 in fp64: u = m·2ᵉ with m ∈ [√½, √2), ln m = 2·atanh((m−1)/(m+1)) as a series."""
    m, e = torch.frexp(u)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    return 2.0 * s * _horner(s * s, _LOG_TERMS) + e * math.log(2.0)


def _cos_turns(t: torch.Tensor) -> torch.Tensor:
    """cos(2π·t) for t ∈ [0, 1) in fp64: quarter turn q and fraction f exactly, then sin/cos of an angle
    in [0, π/4] by their series."""
    q = torch.floor(t * 4.0)
    f = t * 4.0 - q
    upper = f > 0.5
    x = torch.where(upper, 1.0 - f, f) * (math.pi / 2)
    x2 = x * x
    cos_x, sin_x = _horner(x2, _COS_TERMS), x * _horner(x2, _SIN_TERMS)
    cos_a, sin_a = torch.where(upper, sin_x, cos_x), torch.where(upper, cos_x, sin_x)  # of the angle f·π/2
    return torch.where(q == 0, cos_a, torch.where(q == 1, -sin_a, torch.where(q == 2, -cos_a, sin_a)))


def counter_normal(key: int, index: torch.Tensor) -> torch.Tensor:
    """Standard normal fp64 values of the full-tensor linear indices `index` (int64, ≥ 0) under `key`."""
    zero = torch.zeros_like(index)
    w0, w1, w2, w3 = philox4x32((index & _M32, index >> 32, zero, zero), key)
    u1 = (((w0 << 21) | (w1 >> 11)) + 1).to(torch.float64) * 2.0 ** -53
    u2 = ((w2 << 21) | (w3 >> 11)).to(torch.float64) * 2.0 ** -53
    return torch.sqrt(-2.0 * _log(u1)) * _cos_turns(u2)


def draw_key() -> int:
    """A 63-bit key from torch's default CPU generator (follows torch.manual_seed; the same on every
    rank seeded alike). On the CPU whatever the ambient default device, so a meta context cannot eat it."""
    return int(torch.empty((), dtype=torch.int64, device="cpu").random_())


# --- where the local values come from -------------------------------------------------------------
def layout_boxes(layout: ShardLayout, region: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None) -> List[Box]:
    """The local tensor as boxes of the full tensor. region: (offset, shape) of the part of the local
    tensor held here (an FSDP2 shard of it); None: all of it. Local starts are relative to the region."""
    local_shape = layout.local_shape
    offset, shape = region if region is not None else ((0,) * len(local_shape), local_shape)
    boxes = []
    for loc, index in layout.global_slices():
        # local coordinate x is full coordinate x, except along the split dim: global_start + (x - local_start)
        lo, hi = list(offset), [o + n for o, n in zip(offset, shape)]
        full = list(lo)
        if layout.dim is not None:  # intersect the region with this piece along the split dim
            d = layout.dim
            lo[d], hi[d] = max(lo[d], loc.start), min(hi[d], loc.stop)
            full[d] = index[d].start + lo[d] - loc.start
        size = tuple(max(h - l, 0) for l, h in zip(lo, hi))
        if all(size):
            boxes.append((tuple(l - o for l, o in zip(lo, offset)), tuple(full), size))
    return boxes


def _box_indices(full_shape: Sequence[int], full_start: Sequence[int], size: Sequence[int], rows: Tuple[int, int],
                 device) -> torch.Tensor:
    """Full-tensor linear indices of rows [rows) (along dim 0) of a box."""
    strides = [1] * len(full_shape)
    for d in range(len(full_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * full_shape[d + 1]
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (start, n, stride) in enumerate(zip(full_start, size, strides)):
        a, b = rows if d == 0 else (0, n)
        ar = (torch.arange(a, b, dtype=torch.int64, device=device) + start) * stride
        index = index.unsqueeze(-1) + ar
    return index


def fill_boxes(local: torch.Tensor, full_shape: Sequence[int], boxes: Sequence[Box], key: int, mean: float,
               std: float) -> None:
    """Write mean + std·z(key, full index) into every box of `local`, a chunk of rows at a time."""
    if local.dim() == 0:  # a scalar parameter: full index 0
        local.copy_(counter_normal(key, torch.zeros((), dtype=torch.int64, device=local.device)) * std + mean)
        return
    chunk = _CHUNK_CPU if local.device.type == "cpu" else _CHUNK_DEVICE
    for local_start, full_start, size in boxes:
        view = local[tuple(slice(s, s + n) for s, n in zip(local_start, size))]
        step = max(chunk // max(math.prod(size[1:]), 1), 1)
        for a in range(0, size[0], step):
            b = min(a + step, size[0])
            index = _box_indices(full_shape, full_start, size, (a, b), local.device)
            view[a:b].copy_(counter_normal(key, index) * std + mean)


# --- the initialisers -----------------------------------------------------------------------------
class ShardedInit:
    """Base of the initialisers the modules recognise as `init_method`: they generate from full-tensor
    indices through a parameter's ShardLayout. Called as a plain init_method (TE's contract,
    `init(tensor)`), the tensor is taken as a whole parameter."""

    def fill_(self, param: torch.Tensor, layout: Optional[ShardLayout] = None) -> None:
        raise NotImplementedError

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.fill_(tensor, None)
        return tensor


@dataclass(frozen=True)
class NormalInit(ShardedInit):
    """N(mean, std²), layout-independent (see the module docstring)."""

    std: float = DEFAULT_INIT_STD
    mean: float = 0.0

    @torch.no_grad()
    def fill_(self, param: torch.Tensor, layout: Optional[ShardLayout] = None) -> None:
        """Draw this parameter's key and write its local values. Nothing is drawn or written on the
        meta device (no storage yet): reset_parameters() after to_empty draws the key then."""
        if param.is_meta:
            return
        local, region = _local_part(param)
        layout = layout or replicated(local.shape if region is None else param.shape)
        if region is None and tuple(local.shape) != layout.local_shape:
            raise ValueError(f"NormalInit: tensor of shape {tuple(local.shape)} does not match its layout's "
                             f"local shape {layout.local_shape}")
        fill_boxes(local, layout.full_shape, layout_boxes(layout, region), draw_key(), self.mean, self.std)


def normal_(std: float = DEFAULT_INIT_STD, mean: float = 0.0) -> NormalInit:
    """init_method giving N(mean, std²) weights that are the same at every TP size for the same seed."""
    if not (isinstance(std, (int, float)) and std >= 0):
        raise ValueError(f"te_parallel.init.normal_: std must be a number >= 0, got {std!r}")
    return NormalInit(float(std), float(mean))


def scaled_normal_(sigma: float, num_layers: int) -> NormalInit:
    """Megatron's / TE's scaled init for output layers: N(0, (sigma / sqrt(2·num_layers))²)."""
    if not (isinstance(num_layers, int) and num_layers >= 1):
        raise ValueError(f"te_parallel.init.scaled_normal_: num_layers must be a positive int, got {num_layers!r}")
    return normal_(sigma / math.sqrt(2.0 * num_layers))


DEFAULT_INIT = NormalInit()


def _local_part(param: torch.Tensor):
    """(local tensor, region) of a parameter: for a DTensor (e.g. sharded by FSDP2) its local shard and
    where that shard sits in the DTensor's global shape; for a plain tensor (param, None)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return param, None
    if not isinstance(param, DTensor):
        return param, None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:  # private helper; present from torch 2.2 through 2.13
        raise RuntimeError("te_parallel.init: this torch has no compute_local_shape_and_global_offset, needed to "
                           "place a DTensor's shard in the full parameter") from e
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"te_parallel.init: DTensor local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
    return local, (tuple(offset), tuple(shape))


def reset_children(module: torch.nn.Module) -> None:
    """reset_parameters() of a module built from others: each child's, in registration order, which is
    the order the constructor built them in, so keys are drawn in the same order as at construction."""
    for child in module.children():
        fn = getattr(child, "reset_parameters", None)
        if callable(fn):
            fn()
