"""TE's `general_gemm` for high-precision operands: one GEMM in torch, with TE's layout convention and outputs.

TE names the operands for cuBLAS's column-major view; in row-major terms `layout` says which of A and B
enter transposed:

    "TN": out = B·Aᵀ   fprop: A = W [out, in], B = x [t, in]   -> [t, out]
    "NN": out = B·A    dgrad: A = W [out, in], B = dy [t, out] -> [t, in]
    "NT": out = Bᵀ·A   wgrad: A = x [t, in],   B = dy [t, out] -> [out, in]

Clients call it for GEMMs of their own outside TE's modules (Megatron-core's MoE router gating, forward and
backward). FP8 operands or output (`quantization_params`), the GELU epilogue and comm-GEMM overlap (`ub*`,
`extra_output`) are refused in one line: te_parallel's FP8 GEMMs are reached through its modules.
"""
from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.pytorch.tensor.quantized_tensor import QuantizedTensor

__all__ = ["general_gemm"]

LAYOUTS = ("TN", "NN", "NT")


def _refuse(what: str) -> None:
    raise NotImplementedError(f"transformer_engine.pytorch.cpp_extensions.general_gemm: {what} is not implemented in "
                              f"te_parallel (high-precision operands only; FP8 GEMMs run inside te_parallel's modules)")


def _check(A, B, layout: str, quantization_params, gelu: bool, gelu_in, ub, ub_type, extra_output,
           bulk_overlap: bool, alpha: float, beta) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"general_gemm: layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("A", A), ("B", B)):
        if isinstance(t, QuantizedTensor):
            _refuse(f"an FP8 operand ({name} is a {type(t).__name__})")
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"general_gemm: {name} is {got}; need a 2-D floating-point tensor")
    if quantization_params is not None:
        _refuse("an FP8 output (quantization_params)")
    if gelu or gelu_in is not None:
        _refuse("the GELU epilogue (gelu / gelu_in)")
    if ub is not None or ub_type is not None or extra_output is not None or bulk_overlap:
        _refuse("comm-GEMM overlap (ub / ub_type / extra_output / bulk_overlap)")
    if alpha != 1.0 or beta not in (None, 0.0, 1.0):
        _refuse(f"alpha={alpha!r} / beta={beta!r} (scaled GEMM outputs)")


def general_gemm(A: torch.Tensor, B: torch.Tensor, workspace: Optional[torch.Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None, quantization_params=None, gelu: bool = False,
                 gelu_in: Optional[torch.Tensor] = None, alpha: float = 1.0, beta: Optional[float] = None,
                 accumulate: bool = False, layout: str = "TN", out: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, use_split_accumulator: bool = False, grad: bool = False,
                 ub=None, ub_type=None, extra_output: Optional[torch.Tensor] = None, bulk_overlap: bool = False):
    """out = B·Aᵀ, B·A or Bᵀ·A by `layout` (module doc), returned as TE returns it:
    (out, bias_grad, gelu_input, extra_output).

    The product is taken in fp32 (fp64 for fp64 operands) and rounded once to out_dtype (default: the wider
    of A's and B's dtypes). bias: added to the product (grad=False), or, with grad=True (wgrad, "NT" only),
    bias_grad = the sum of B's rows (dy summed over the tokens). out: written (or added to, accumulate=True)
    in place and returned. workspace and use_split_accumulator concern cuBLAS and change nothing here."""
    _check(A, B, layout, quantization_params, gelu, gelu_in, ub, ub_type, extra_output, bulk_overlap, alpha, beta)
    acc = torch.promote_types(torch.promote_types(A.dtype, B.dtype), torch.float32)
    dtype = out_dtype if out_dtype is not None else torch.promote_types(A.dtype, B.dtype)
    a = A.to(acc).t() if layout[0] == "T" else A.to(acc)  # [k, n]
    b = B.to(acc).t() if layout[1] == "T" else B.to(acc)  # [m, k]
    if b.shape[1] != a.shape[0]:
        product = {"TN": "B·Aᵀ", "NN": "B·A", "NT": "Bᵀ·A"}[layout]
        raise ValueError(f"general_gemm: A {tuple(A.shape)} and B {tuple(B.shape)} do not multiply in layout "
                         f"{layout!r} (out = {product})")
    product = b @ a  # [m, n]
    bias_grad = None
    if bias is not None and grad:
        if layout != "NT":
            _refuse(f"a bias gradient in layout {layout!r} (TE computes it in wgrad, layout 'NT')")
        bias_grad = B.to(acc).sum(dim=0).to(bias.dtype)  # [n_out]: dy summed over the tokens
    elif bias is not None:
        product = product + bias.to(acc)
    if out is None:
        out = product.to(dtype)
    elif accumulate or beta == 1.0:
        out.add_(product.to(out.dtype))
    else:
        out.copy_(product)
    return out, bias_grad, None, None
