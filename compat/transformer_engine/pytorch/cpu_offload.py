"""TE's `get_cpu_offload_context`: activations saved for backward go to host memory.

te_parallel's version is torch's `save_on_cpu` over the whole region (TE pipelines it layer by layer
with `num_layers` layers in flight); on the CPU it changes nothing. Weight offloading is not implemented.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["get_cpu_offload_context", "CPUOffloadEnabled"]

CPUOffloadEnabled = False  # TE's module flag, toggled by Megatron's fine-grained offloading


def _identity(tensor):
    return tensor


class _OffloadActivations:
    """Activations saved for backward inside this context live in host memory (torch's save_on_cpu).
    `inside_context` is TE's attribute, read by Megatron's layers."""

    def __init__(self) -> None:
        self.inside_context = False
        self._hooks = None

    def __enter__(self):
        self._hooks = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        self._hooks.__enter__()
        self.inside_context = True
        return self

    def __exit__(self, *exc):
        self.inside_context = False
        hooks, self._hooks = self._hooks, None
        return hooks.__exit__(*exc)


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, **kwargs):
    """(context, sync function): the context offloads the activations saved inside it; the sync
    function is the identity (torch moves them back when backward needs them)."""
    if not enabled:
        return contextlib.nullcontext(), _identity
    if offload_weights:
        raise NotImplementedError("get_cpu_offload_context: offload_weights=True is not implemented in te_parallel; "
                                  "offload activations only")
    if not offload_activations:
        return contextlib.nullcontext(), _identity
    return _OffloadActivations(), _identity
