"""Data parallelism of the trainer through PyTorch's engines, over the ranks that see different tokens:
the mesh's "dp" axis, or with context parallelism "dp" and "cp" flattened into one (world.data_mesh; a cp
rank's gradient is that of its own tokens of the shared sequences, so it is averaged with the others).

- fsdp2 (the default): `fully_shard` on every transformer block and on the root, over world.data_mesh.
  Each block's parameters (this rank's TP shards) are further sharded along dim 0 over the DP ranks,
  all-gathered before the block runs and reduce-scattered (averaged) after its backward; the optimizer
  state is sharded with them. The root group holds the embedding, final norm and output layer.
- ddp: `DistributedDataParallel` over that mesh's process group: whole replicas, gradients all-reduced
  (averaged) in buckets during backward.

TP (+SP) stays inside the te_parallel modules, which see plain local tensors either way: FSDP2
hands them the unsharded parameters for their forward and backward.

With one such rank neither wraps: there is nothing to average, and the model then runs exactly as
a single replica would (no DTensor parameters, no hooks), which keeps the TP-only paths (parity
with TP=1, the comm-GEMM overlap) free of FSDP2's per-block all-gather bookkeeping.
"""
from __future__ import annotations

import inspect

from torch import nn

from te_parallel.examples.cli import DP_ENGINES


def apply_data_parallel(model: nn.Module, world, engine: str) -> nn.Module:
    """Wraps `model` (a GPT: `model.layers` are its blocks) for `engine` over world.data_mesh; returns
    the module to call (the same object under FSDP2, a DDP wrapper under DDP)."""
    if engine not in DP_ENGINES:
        raise ValueError(f"apply_data_parallel: engine {engine!r} is not one of {', '.join(DP_ENGINES)}")
    if world.data_mesh.size() == 1:
        return model
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        dp_mesh = world.data_mesh
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # No buffer broadcast before every forward: the only buffers are the FP8 scaling state (identical on
    # every rank, its amaxes are reduced over the whole mesh) and RoPE's constant frequencies. (Newer
    # torch names the switch forward_sync_buffers and deprecates broadcast_buffers.)
    sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else "broadcast_buffers")
    cuda = world.device.type == "cuda"
    return DistributedDataParallel(model, process_group=world.dp_group, device_ids=[world.device] if cuda else None,
                                   **{sync: False})

