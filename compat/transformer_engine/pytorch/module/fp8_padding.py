"""TE's Fp8Padding / Fp8Unpadding (pad each expert's tokens for grouped FP8 GEMMs): import-only."""
import torch

from transformer_engine.pytorch._missing import missing_class

Fp8Padding = missing_class("Fp8Padding", "Fp8Padding (MoE token padding)", torch.nn.Module)
Fp8Unpadding = missing_class("Fp8Unpadding", "Fp8Unpadding (MoE token padding)", torch.nn.Module)

__all__ = ["Fp8Padding", "Fp8Unpadding"]
