"""Tensor and sequence parallelism, TP = 2 and 4, launched from pytest (gloo on CPU, NCCL on GPUs)."""
import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe as R
from tests.distributed.harness import Checks, spawn, worlds
from tests.distributed.tp_cases import all_cases, run_case
from tests.distributed.tp_transformer_cases import run_transformer_case


def _suite(rank, world, device):
    group = dist.new_group(list(range(world)))
    checks = Checks(rank)
    for case in all_cases():
        checks.run(str(case), run_case, case, rank, world, group, device)
    for sp in (False, True):
        for rec in ("off", "delayed", "current"):
            checks.run(f"TransformerLayer sp={sp} fp8={rec}", run_transformer_case, sp, rec, rank, world, group, device)
    checks.run("amax outlier on one rank", _outlier, rank, world, group, device)
    checks.run("standalone norms under SP + gathered ln_out", _norms_sp, rank, world, group, device)
    checks.run("bad input", _bad_input, rank, world, group, device)
    checks.run("FP8 gather == high-precision gather then cast", _gather_paths_agree, rank, world, group, device)
    checks.run("LayerNormMLP SP with one local row", _mlp_short_local_sequence, rank, world, group, device)
    checks.raise_if_failed()


def _outlier(rank, world, group, device):
    """Delayed scaling: an outlier on rank 1's sequence shard sets every rank's scale."""
    m = te.Linear(32, 16 * world, parallel_mode="column", sequence_parallel=True, tp_group=group, device=device)
    x = torch.randn(16 // world, 4, 32, device=device)
    if rank == 1:
        x[0, 0, 0] = 1000.0
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        y = m(x)
    y.sum().backward()
    scale = m.fp8_state.fwd_scale[0].item()
    assert scale == pytest.approx(448.0 / 1000.0), f"rank {rank}: input scale {scale}, want 448/1000"


def _norms_sp(rank, world, group, device):
    """te.LayerNorm / RMSNorm with sequence_parallel and a tp_group: γ/β grads summed over the ranks;
    LayerNormLinear(return_layernorm_output_gathered) returns the full-sequence norm output."""
    x = torch.randn(8 * world, 2, 32, generator=torch.Generator().manual_seed(0)).to(device)
    for cls in (te.LayerNorm, te.RMSNorm):
        ref, sp = cls(32, device=device), cls(32, sequence_parallel=True, tp_group=group, device=device)
        with torch.no_grad():
            ref.weight.normal_()
            sp.weight.copy_(ref.weight)
        ref(x).pow(2).sum().backward()
        sp(x.chunk(world, 0)[rank]).pow(2).sum().backward()
        assert torch.allclose(sp.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5), cls.__name__
        assert sp.weight.sequence_parallel
    m = te.LayerNormLinear(32, 64, parallel_mode="column", sequence_parallel=True, tp_group=group, device=device,
                           return_layernorm_output=True, return_layernorm_output_gathered=True)
    out, ln_out = m(x.chunk(world, 0)[rank])
    assert ln_out.shape == x.shape and out.shape == (x.shape[0], 2, 64 // world)


def _mlp_short_local_sequence(rank, world, group, device):
    """LayerNormMLP under SP reduce-scatters the gathered sequence (world × local rows), so one local row
    is a valid input at any tp_size (the check once looked at the local rows)."""
    m = te.LayerNormMLP(32, 16 * world, set_parallel_mode=True, sequence_parallel=True, tp_group=group, device=device)
    x = torch.randn(1, 2, 32, device=device, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape


def _gather_paths_agree(rank, world, group, device):
    """Casting then gathering FP8 bytes gives the same bytes as gathering then casting (shared scale)."""
    outs = []
    for fp8_gather in (True, False):
        torch.manual_seed(5)
        m = te.Linear(32, 16 * world, parallel_mode="column", sequence_parallel=True, tp_group=group, device=device)
        m.fp8_all_gather = fp8_gather
        x = torch.randn(16 // world, 4, 32, device=device, requires_grad=True)
        for recipe in (R.DelayedScaling(), R.Float8CurrentScaling()):
            with te.fp8_autocast(fp8_recipe=recipe):
                y = m(x)
            y.backward(torch.ones_like(y))
        outs.append((y, x.grad, m.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b), "FP8 gather and high-precision gather differ"


def _bad_input(rank, world, group, device):
    def raises(exc, text, fn):
        try:
            fn()
        except exc as e:
            assert text in str(e) and "\n" not in str(e), str(e)
            return
        raise AssertionError(f"no {exc.__name__} raised (wanted: {text})")

    raises(ValueError, f"tp_size=3 but tp_group has {world} ranks",
           lambda: te.Linear(32, 48, tp_group=group, tp_size=3, parallel_mode="column", device=device))
    odd = 8 * world + 1
    raises(ValueError, f"out_features={odd} is not divisible by tp_size={world}",
           lambda: te.Linear(32, odd, tp_group=group, parallel_mode="column", device=device))
    raises(ValueError, f"in_features={odd} is not divisible by tp_size={world}",
           lambda: te.Linear(odd, 32, tp_group=group, parallel_mode="row", device=device))
    row = te.Linear(32, 32, tp_group=group, parallel_mode="row", sequence_parallel=True, device=device)
    raises(ValueError, f"sequence length {world + 1} (dim 0) is not divisible by tp_size={world}",
           lambda: row(torch.randn(world + 1, 2, 32 // world, device=device)))
    from te_parallel.parallel.groups import check_group_device
    if dist.get_backend(group) == "gloo":
        raises(ValueError, "backend 'gloo', which cannot communicate CUDA tensors",
               lambda: check_group_device("Linear", group, torch.device("cuda")))


@pytest.mark.parametrize("world", worlds(2, 4, 8))
def test_tensor_parallel_suite(world):
    spawn(_suite, world)
