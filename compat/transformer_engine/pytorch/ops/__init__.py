"""TE's operation-based API (`te.pytorch.ops`: Sequential, BasicLinear, fused activations, ...): import-only
in te_parallel (Megatron reaches it only with use_te_op_fuser / use_te_activation_func)."""
import torch

from transformer_engine.pytorch._missing import missing_class

_WHAT = "TE's operation-based API (te.pytorch.ops)"
FusibleOperation = missing_class("ops.FusibleOperation", _WHAT, torch.nn.Module)
_NAMES = ("Sequential", "BasicLinear", "Bias", "LayerNorm", "RMSNorm", "AllReduce", "ReduceScatter", "AllGather",
          "GELU", "GEGLU", "SiLU", "SwiGLU", "ReLU", "ReGLU", "Quantize", "Linear")
globals().update({name: missing_class(f"ops.{name}", _WHAT, FusibleOperation) for name in _NAMES})

__all__ = ["FusibleOperation", *_NAMES]
