"""Scaled dot-product attention: masks (True = masked out), the backend rule, and the dense kernels.

Two families of kernels:
  dense   q [b, h, s_q, d], k/v [b, g, s_kv, d] with a boolean mask or SDPA's is_causal flag:
          "cudnn", "flash", "efficient", "math" (PyTorch SDPA) and "unfused" (`attention_reference`);
  varlen  q [t_q, h, d], k/v [t_kv, g, d] with cu_seqlens: "cudnn_fe" (cuDNN frontend graphs,
          ops/attention_cudnn_fe.py) and "flash_varlen" (flash-attention's varlen kernels through aten,
          ops/attention_varlen.py).
Packed ("thd") inputs and padding masks are ragged by nature: a dense backend takes them padded, a
varlen backend takes bshd/sbhd inputs unpadded. GQA (g < h) runs natively everywhere except in the
memory-efficient kernel and the reference, which repeat K/V heads.

`choose_backend` is the rule for "auto" (timings in docs/attention.md):
  * CPU: "math".
  * CUDA fp16/bf16, dense input (no padding, no thd), no window, causal only with s_q == s_kv, on
    sm_90+ with head_dim <= 128 and a multiple of 8: "cudnn_fe" when the cuDNN frontend imports
    (outside torch.compile), else "cudnn" (SDPA's cuDNN kernels); GQA native; "flash" on older GPUs.
  * CUDA fp16/bf16 otherwise (thd, padding masks, sliding windows): "cudnn_fe" when the cuDNN
    frontend imports, the GPU is sm_90+ and head_dim <= 128 (dropout with a bottom-right diagonal
    only where s_q == s_kv); else "flash_varlen".
  * CUDA otherwise (arbitrary masks, fp32): "efficient"; fp64: "math".
When the chosen kernel refuses the input at run time, `fallback_of` names the next one; the switch
warns once with the reason. An explicit backend that cannot take the input is a ValueError
(`unsupported_reason` says what it needs).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
              "padding_causal_bottom_right", "arbitrary")
BACKENDS = ("auto", "cudnn", "cudnn_fe", "flash", "flash_varlen", "efficient", "math", "unfused")
DENSE_BACKENDS = ("cudnn", "flash", "efficient", "math", "unfused")
VARLEN_BACKENDS = ("cudnn_fe", "flash_varlen")
_SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
_HALF = (torch.float16, torch.bfloat16)
_WARNED = set()


def check_mask_type(owner: str, mask_type: str) -> None:
    if mask_type not in MASK_TYPES:
        raise ValueError(f"{owner}: attn_mask_type must be one of {MASK_TYPES}, got {mask_type!r}")


def check_window(owner: str, window_size) -> Optional[Tuple[int, int]]:
    if window_size is None:
        return None
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(isinstance(w, int) and w >= -1 for w in window_size)
    if not ok:
        raise ValueError(f"{owner}: window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}")
    return None if tuple(window_size) == (-1, -1) else tuple(window_size)


def warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


@dataclass(frozen=True)
class Band:
    """The keys query i of a sequence sees: j in [p - left, p + right] (-1 = unbounded), where
    p = i (top-left alignment) or p = i + s_kv - s_q (bottom-right), s_q/s_kv being that sequence's
    lengths. A causal mask is right = 0; a window adds `left` (and `right` when not causal)."""
    bottom_right: bool
    left: int
    right: int

    @property
    def full(self) -> bool:
        return self.left < 0 and self.right < 0

    @property
    def causal_only(self) -> bool:
        return self.left < 0 and self.right == 0


def make_band(mask_type: str, window: Optional[Tuple[int, int]]) -> Band:
    """TE's alignment: the causal diagonal, and with it the window, is top-left for "causal" and
    "padding_causal", bottom-right for the "*_bottom_right" types and for the non-causal ones."""
    causal = "causal" in mask_type
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0  # causal ∩ [p - left, p + right] keeps j <= p whatever right is
    bottom_right = not causal or mask_type.endswith("bottom_right")
    if left < 0 and right < 0:
        bottom_right = True  # nothing to align
    return Band(bottom_right, left, right)


def band_mask(band: Band, len_q, len_kv, sq: int, skv: int, device) -> Optional[torch.Tensor]:
    """bool [b|1, 1, sq, skv], True = outside the band; len_q/len_kv: int tensors [b] (per-sequence
    lengths, for the bottom-right shift) or None (= sq, skv). None when the band is full."""
    if band.full:
        return None
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    pos = i
    if band.bottom_right:
        lq = sq if len_q is None else len_q.view(-1, 1, 1, 1).long()
        lkv = skv if len_kv is None else len_kv.view(-1, 1, 1, 1).long()
        pos = i + (lkv - lq)
    out = torch.zeros((), dtype=torch.bool, device=device)
    if band.left >= 0:
        out = out | (j < pos - band.left)
    if band.right >= 0:
        out = out | (j > pos + band.right)
    return out


@dataclass(frozen=True)
class Case:
    """What decides the kernel: device, dtype, head size, the input's raggedness and mask."""
    device_type: str
    capability: Tuple[int, int]
    dtype: torch.dtype
    head_dim: int
    ragged: bool        # thd input or a padding mask
    arbitrary: bool     # a user mask of any shape
    band: Band
    same_lengths: bool  # every sequence has s_q == s_kv (top-left == bottom-right)
    dropout: bool
    cudnn_fe: bool      # the cuDNN frontend imports
    compiling: bool = False  # inside a torch.compile trace (the frontend's graphs are not traceable)

    @property
    def dense_ok(self) -> bool:
        """SDPA's fused kernels: no padding, no window, causal only as the is_causal flag."""
        return not self.ragged and not self.arbitrary and (self.band.full or (self.band.causal_only and self.same_lengths))


def make_case(q: torch.Tensor, *, ragged: bool, arbitrary: bool, band: Band, same_lengths: bool,
              dropout: bool, cudnn_fe: bool) -> Case:
    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else (0, 0)
    return Case(q.device.type, cap, q.dtype, q.shape[-1], ragged, arbitrary, band, same_lengths, dropout, cudnn_fe,
                torch.compiler.is_compiling())


def unsupported_reason(backend: str, c: Case) -> Optional[str]:
    """None if `backend` takes the case, else what it needs (for the one-line error)."""
    if backend in ("math", "unfused"):
        return None
    if c.device_type != "cuda":
        return "a CUDA tensor"
    if backend == "efficient":
        return None if c.dtype in _HALF + (torch.float32,) else "float16, bfloat16 or float32"
    if c.dtype not in _HALF:
        return "float16 or bfloat16"
    if c.head_dim % 8:
        return "head_dim a multiple of 8"
    if backend in ("cudnn", "flash"):
        if c.head_dim > (128 if backend == "cudnn" else 256):
            return f"head_dim <= {128 if backend == 'cudnn' else 256}"
        if not c.dense_ok:
            return "a dense input (no thd, padding, arbitrary mask or window; causal only with s_q == s_kv)"
        return None
    if c.arbitrary:
        return "no arbitrary mask"
    if backend == "flash_varlen":
        if c.capability < (8, 0) or c.head_dim > 256:
            return "sm_80+ and head_dim <= 256"
        if not (c.band.bottom_right or c.same_lengths):
            return "a bottom-right causal diagonal or window where s_q != s_kv ('causal_bottom_right')"
        return None
    if not c.cudnn_fe:
        return "the cuDNN frontend (pip install nvidia-cudnn-frontend)"
    if c.capability < (9, 0) or c.head_dim > 128:
        return "sm_90+ and head_dim <= 128"
    if c.dropout and c.band.bottom_right and not c.band.full and not c.same_lengths:
        return "no attention dropout with a bottom-right diagonal where s_q != s_kv"
    return None


def choose_backend(c: Case) -> str:
    """The "auto" rule (see the module docstring)."""
    if c.device_type != "cuda":
        return "math"
    dense_fe = c.dense_ok and not c.compiling and c.capability >= (9, 0)
    for backend in ("cudnn_fe", "cudnn", "flash", "flash_varlen"):
        if backend == "cudnn" and c.capability < (9, 0) or backend == "cudnn_fe" and c.dense_ok and not dense_fe:
            continue
        if unsupported_reason(backend, c) is None:
            return backend
    return "efficient" if unsupported_reason("efficient", c) is None else "math"


def fallback_of(backend: str, c: Case) -> str:
    """The kernel to use, with a warning, when `backend` refuses the input at run time."""
    order = {"cudnn": ("flash", "efficient", "math"), "flash": ("efficient", "math"),
             "cudnn_fe": ("cudnn", "flash_varlen", "flash", "efficient", "math"), "flash_varlen": ("efficient", "math"),
             "efficient": ("math",), "math": ("unfused",)}[backend]
    return next(b for b in order if unsupported_reason(b, c) is None)


def attention_reference(q, k, v, mask: Optional[torch.Tensor], scale: float, dropout_p: float = 0.0,
                        is_causal: bool = False) -> torch.Tensor:
    """Unfused attention on [b, h, s, d] (k/v may have fewer heads: GQA), softmax in fp32 or wider.
    A query whose every key is masked attends to nothing (output 0, gradient 0)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if is_causal:
        sq, skv = scores.shape[-2:]
        mask = mask_union(mask, torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(1))
    empty = None
    if mask is not None:
        # finite fill: an all-masked row then softmaxes to a uniform row, which is zeroed below
        # (no NaN reaches the backward, unlike -inf)
        scores = scores.masked_fill(mask, torch.finfo(acc).min)
        empty = mask.all(-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


def mask_union(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """a | b of two boolean masks (True = masked out), either of which may be None (nothing masked)."""
    if a is None:
        return b
    return a if b is None else a | b


def dense_attention(q, k, v, mask: Optional[torch.Tensor], is_causal: bool, backend: str, scale: float,
                    dropout_p: float) -> torch.Tensor:
    """q [b, h, sq, d], k/v [b, g, skv, d], mask bool (True = masked out) -> [b, h, sq, d].

    Rows whose every key is masked give 0: before an SDPA kernel (some return NaN there) such a row
    is given its first key and its output is zeroed afterwards."""
    if backend == "unfused":
        return attention_reference(q, k, v, mask, scale, dropout_p, is_causal)
    empty = None
    if mask is not None:
        empty = mask.all(-1, keepdim=True)
        first = torch.arange(mask.shape[-1], device=mask.device) == 0
        mask = mask & ~(empty & first)
    gqa = k.shape[1] != q.shape[1]
    if gqa and backend == "efficient":
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
    with sdpa_kernel([_SDPA[backend]]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=gqa)
    return out if empty is None else out.masked_fill(empty, 0.0)


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale
