"""Master weights on the optimizer's side: fp32 copies of a model's parameters for any torch optimizer, with
its FP8 weight parameters (te_parallel.fp8.params) written back quantized after each step."""
from __future__ import annotations

from typing import Iterable, List

import torch
from torch import nn

from te_parallel.fp8.params import DTensor, Float8Weight, _local, is_fp8_weight, write_fp8_weights

__all__ = ["MasterWeights"]


class MasterWeights:
    """High-precision (fp32) master copies of a model's parameters for any torch optimizer, with the FP8
    weights written back quantized after each step (what TE's FusedAdam(master_weights=True) does).

        masters = te.MasterWeights(model.parameters())
        opt = torch.optim.AdamW(masters.parameters(), lr=...)
        loss.backward()
        masters.step(opt)        # grads -> masters, opt.step(), FP8 weights re-quantized, grads cleared

    An FP8 weight's master starts from its preserved initial value when the model was built with
    preserve_high_precision_init_val=True, else from its dequantized value. Parameters already in the
    master dtype are their own masters (no copy); others (bf16 norms) get an fp32 copy. FSDP2-sharded
    parameters get sharded masters (DTensors like them)."""

    def __init__(self, params: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.model_params = [p for p in params if p.requires_grad]
        self.masters = [self._master(p) for p in self.model_params]

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        if not is_fp8_weight(p) and p.dtype == self.dtype:
            return p
        local = _local(p)
        if isinstance(local, Float8Weight):
            init = local.get_high_precision_init_val()
            value = local.dequantize(self.dtype) if init is None else init.to(local.device, self.dtype)
        else:
            value = local.detach().to(self.dtype)
        if isinstance(p, DTensor):
            value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
        return nn.Parameter(value.detach().clone(), requires_grad=True)

    def parameters(self) -> List[torch.Tensor]:
        return list(self.masters)

    def copy_grads(self) -> None:
        """Move the model's gradients onto the masters (in the master dtype); the model's are cleared."""
        for p, m in zip(self.model_params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.to(self.dtype)
                p.grad = None

    def write_back(self) -> None:
        """Write the masters into the model: FP8 weights quantized (together, see write_fp8_weights),
        other parameters copied."""
        with torch.no_grad():
            write_fp8_weights([(p, m) for p, m in zip(self.model_params, self.masters) if is_fp8_weight(p)])
            for p, m in zip(self.model_params, self.masters):
                if m is not p and not is_fp8_weight(p):
                    p.copy_(m)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.copy_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.write_back()
