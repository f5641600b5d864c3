"""Float8BlockScaling under tensor and sequence parallelism, TP = 2 and 4 (gloo on CPU, NCCL on GPUs).

At sizes where every rank's 1x128 tiles and 128x128 blocks are the one process's (BLOCK_DIMS), each TP module
against the one-process module built from the same full weights (tp_cases.run_case: outputs, input gradient,
every parameter gradient); the same at sequence shards of 96 rows (BLOCK_DIMS_GATHER_HP, TP=2), where the
sequence-parallel input is gathered in high precision and cast after. Then the FP8 all-gather itself: the
block-scaled bytes and scales a rank receives equal the one-process cast of the gathered tensor, bit for bit.
"""
import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.blockwise import quantize_blockwise_reference
from te_parallel.ops import linear as linear_ops
from tests.distributed.harness import Checks, spawn, worlds
from tests.distributed.tp_cases import BLOCK_DIMS, BLOCK_DIMS_GATHER_HP, block_cases, run_case


def _suite(rank, world, device):
    group = dist.new_group(list(range(world)))
    checks = Checks(rank)
    for case in block_cases():
        if world > 2 and not (case.sp and case.bias and case.module in ("linear-column", "mlp")):
            continue  # (TP=4: the two sequence-parallel cases that gather, for CI's time)
        checks.run(f"{case} (tiles whole on every rank)", run_case, case, rank, world, group, device, BLOCK_DIMS)
    if world == 2:
        for case in block_cases():
            if case.sp:
                checks.run(f"{case} (96-row shards: gathered in high precision)", run_case, case, rank, world, group,
                           device, BLOCK_DIMS_GATHER_HP)
    checks.run("FP8 all-gather of tiles and scales", _gather_bits, rank, world, group, device)
    checks.run("the SP input is gathered as FP8 where tiles are whole", _fp8_on_the_wire, rank, world, group, device)
    checks.raise_if_failed()


def _gather_bits(rank, world, group, device):
    g = torch.Generator().manual_seed(7)
    full = (torch.randn(128 * world, 384, generator=g) * 2.0 ** torch.randint(-8, 8, (128 * world, 1), generator=g))
    full = full.to(torch.bfloat16).to(device)
    mine = full.chunk(world, 0)[rank]
    fp8 = torch.float8_e4m3fn
    local = quantize_blockwise_reference(mine.cpu(), fp8, 1, columnwise=True)
    local = type(local)(*(None if t is None else t.to(device) for t in (local.data, local.scale_inv, local.data_t,
                                                                         local.scale_inv_t)),
                        local.block_dim, local.fp8_dtype, local.shape)
    got = linear_ops._gather(local, group)[0]
    want = quantize_blockwise_reference(full.cpu(), fp8, 1, columnwise=True)
    for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        a, b = getattr(got, name).cpu(), getattr(want, name)
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a.view(torch.uint8) if a.dtype == fp8 else a, b.view(torch.uint8) if b.dtype == fp8 else b), \
            f"{name} differs from the one-process cast"
    assert got.shape == (128 * world, 384)


def _fp8_on_the_wire(rank, world, group, device):
    """Column-parallel SP under block scaling gathers FP8 bytes (not bf16) when the shard is whole tiles."""
    moved = []
    real = linear_ops.all_gather_dim0

    def spy(t, grp, async_op=False):
        moved.append(t.dtype)
        return real(t, grp, async_op)

    m = te.Linear(128, 128 * world, parallel_mode="column", sequence_parallel=True, tp_group=group, device=device,
                  params_dtype=torch.bfloat16)
    x = torch.randn(128, 1, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    linear_ops.all_gather_dim0 = spy
    try:
        with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
            y = m(x)
        y.float().sum().backward()
    finally:
        linear_ops.all_gather_dim0 = real
    assert torch.bfloat16 not in moved, f"high-precision bytes were gathered: {moved}"
    assert torch.float8_e4m3fn in moved or torch.uint8 in moved, f"no FP8 bytes were gathered: {moved}"


@pytest.mark.parametrize("world", worlds(2, 4))
def test_block_scaling_tp(world):
    spawn(_suite, world)
