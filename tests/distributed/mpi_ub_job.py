"""Run under mpirun (tests/distributed/test_overlap.py::test_mpi_bootstrap): initialize_ub with the MPI
bootstrap, then an overlapped column Linear against the plain one on the same rank."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch"))
from common import init_distributed  # noqa: E402

import te_parallel as te  # noqa: E402


def main() -> None:
    rank, world, _, device = init_distributed()
    group = dist.new_group(list(range(world)))
    ub = te.initialize_ub([32, 64], group, dtype=torch.float32, bootstrap_backend="mpi", timeout=60)
    kw = dict(parallel_mode="column", sequence_parallel=True, tp_group=group, device=device)
    ref = te.Linear(64, 32 * world, **kw)
    ovl = te.Linear(64, 32 * world, ub_overlap_ag=True, ub_comm=ub, **kw)
    ovl.load_state_dict(ref.state_dict())
    x = torch.randn(32 // world, 64, generator=torch.Generator().manual_seed(rank), device="cpu").to(device)
    # fp32 GEMMs of M/tp rows and of M rows may take different cuBLAS kernels: compare closely, not
    # bit for bit (the bit-exact bf16 comparison is test_overlap.py's)
    y, y_ref = ovl(x), ref(x)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-5), f"overlapped output differs by {(y - y_ref).abs().max()}"
    ub.destroy()
    dist.barrier()
    print(f"mpi bootstrap ok rank={rank} transport={ub.transport_name}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
