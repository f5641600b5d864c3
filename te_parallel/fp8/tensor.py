"""Float8Tensor: FP8 bytes plus the scale that decodes them (value = data * scale_inv)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from te_parallel.native import cast as native_cast


@dataclass
class Float8Tensor:
    """A quantized 2-D operand of an FP8 GEMM.

    `data` is the row-major FP8 matrix [rows, cols]; `data_t` (when asked for) is its transpose
    stored contiguously [cols, rows]. cuBLASLt FP8 GEMMs only take the "TN" layout (A row-major,
    B column-major), so dgrad and wgrad read the transposed copies (te_parallel/ops/gemm.py).
    `scale_inv` is the fp32 scalar the bytes were encoded with (decoded value = data * scale_inv);
    it travels with the bytes, so a cached tensor stays valid after the module's scale moves on.
    `scale` (weights only) is a snapshot of the encoding scale itself: re-encoding the same source
    with it gives the same bytes (how backward makes Wᵀ without keeping W: ops/fp8_gemm_config).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def transposed(self) -> torch.Tensor:
        """The [cols, rows] contiguous copy, made on first use and kept (one-pass native kernel on CUDA;
        torch's strided FP8 copy runs at a fraction of the bandwidth). Under torch.compile it is not kept:
        a backward that wrote it onto a tensor of its forward would be a side effect the graph cannot
        hold, and the compiler shares one transpose between its uses anyway."""
        if self.data_t is not None:
            return self.data_t
        data_t = _transpose(self.data)
        if not torch.compiler.is_compiling():
            self.data_t = data_t
        return data_t

    def with_transpose(self) -> "Float8Tensor":
        """The same bytes with the transposed copy alongside, made now if missing, without storing it on
        self (a cached weight stays [N, K] only: its Wᵀ lives as long as the backward that made it)."""
        if self.data_t is not None:
            return self
        other = Float8Tensor(self.data, self.scale_inv)
        other.data_t = other.transposed()
        return other

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)


def _transpose(data: torch.Tensor) -> torch.Tensor:
    return native_cast.transpose_fp8(data) if native_cast.usable(data) else data.t().contiguous()
