"""A small job for the launchers: proves the world is wired and te_parallel runs on every rank.

    NPROC=2 launch/torchrun.sh launch/check_world.py
    NP=2 launch/mpirun.sh launch/check_world.py
    sbatch launch/slurm.sbatch

Rank 0 prints "check_world: ok world=N backend=B"; any failure raises, so the exit status is non-zero.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import init_distributed  # launch/common.py: this file's directory is sys.path[0]


def check_all_reduce(rank: int, world_size: int, device: torch.device) -> None:
    # Rank r contributes [0, 1, 2, 3] + 10 r; small integers, so the float sum is exact.
    x = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    dist.all_reduce(x)
    expected = world_size * torch.arange(4, dtype=torch.float32) + 10 * world_size * (world_size - 1) / 2
    if not torch.equal(x.cpu(), expected):
        raise RuntimeError(f"all_reduce on rank {rank}: got {x.tolist()}, expected {expected.tolist()}")


def check_linear(rank: int, device: torch.device) -> None:
    """te_parallel.Linear forward + backward on one device (tp_size=1) against F.linear."""
    import te_parallel as te

    torch.manual_seed(1000 + rank)
    layer = te.Linear(32, 16, bias=True, device=device)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = layer.weight.detach().clone().requires_grad_(True)
    y_ref = F.linear(x_ref, w_ref, layer.bias.detach())
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, msg=lambda m: f"Linear output on rank {rank}: {m}")
    torch.testing.assert_close(x.grad, x_ref.grad, msg=lambda m: f"Linear dgrad on rank {rank}: {m}")
    torch.testing.assert_close(layer.weight.grad, w_ref.grad, msg=lambda m: f"Linear wgrad on rank {rank}: {m}")
    torch.testing.assert_close(layer.bias.grad, dy.sum(0), msg=lambda m: f"Linear bias grad on rank {rank}: {m}")


def main() -> int:
    rank, world_size, _, device = init_distributed()
    try:
        check_all_reduce(rank, world_size, device)
        check_linear(rank, device)
        dist.barrier()  # rank 0 reports ok only once every rank has passed
        if rank == 0:
            print(f"check_world: ok world={world_size} backend={dist.get_backend()}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
