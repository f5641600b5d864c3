"""FSDP2 (`fully_shard` over dp=2) of modules whose weights are FP8 under Float8BlockScaling
(quantized_model_init): 128x128 blocks and 1x128 tiles, a Linear and a LayerNormMLP. 2 processes (gloo on
the CPU; NCCL with 2 GPUs).

- The all-gather: the unsharded weights FSDP2 rebuilds hold the bytes and block scales of the same module
  built without FSDP, bit for bit, and FSDP2 moves 1 byte per FP8 weight element plus 4 per block scale.
- Training: two steps (fp32 MasterWeights + SGD) equal the one-process reference: the same FP8-weight
  module, unsharded, fed both dp ranks' batches, its gradients averaged by hand (losses, then every
  weight's bytes and scales, bit-equal: each block is quantized from the same master values on the rank
  that holds its rows, and no scale is reduced across ranks).
- Refusals on every rank alike, in one line, before any collective: shards that cut a 128x128 block
  (at fully_shard) and unequal shards (at the first all-gather).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.params import Float8Weight, MasterWeights, quantized_model_init
from tests.distributed.harness import Checks, agree, spawn
from tests.distributed.test_fsdp2 import _count_all_gathers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

WORLD, STEPS, TOKENS = 2, 2, 32
# rows per shard: multiples of 128 for 128x128 blocks; any equal split (and ragged K tiles) for 1x128 tiles
SIZES = {2: dict(hidden=256, out=512, ffn=512), 1: dict(hidden=144, out=160, ffn=208)}
MODULES = {
    "Linear": lambda s, device: te.Linear(s["hidden"], s["out"], device=device),
    "LayerNormMLP": lambda s, device: te.LayerNormMLP(s["hidden"], s["ffn"], activation="swiglu",
                                                      normalization="RMSNorm", device=device),
}


def _recipe(dim):
    return R.Float8BlockScaling(w_block_scaling_dim=dim)


def _build(name, dim, device):
    torch.manual_seed(7)  # the same values on both ranks and in the reference
    with quantized_model_init(recipe=_recipe(dim), preserve_high_precision_init_val=True):
        return MODULES[name](SIZES[dim], device)


def _batches(dim, device):
    g = torch.Generator().manual_seed(5)
    return [[torch.randn(TOKENS, SIZES[dim]["hidden"], generator=g).to(device) for _ in range(WORLD)]
            for _ in range(STEPS)]


def _loss(module, x, dim):
    with te.fp8_autocast(fp8_recipe=_recipe(dim)):
        return module(x).float().pow(2).mean()


def _fp8_state(module):
    """name -> (bytes, scale_inv) of every FP8 weight (FSDP2's unsharded ones while unsharded)."""
    return {n: (p._data.view(torch.uint8).clone(), p.scale_inv.clone()) for n, p in module.named_parameters()
            if isinstance(p, Float8Weight)}


def _same_state(got, want) -> list:
    bad = [n for n in want if n not in got or not (torch.equal(got[n][0], want[n][0])
                                                   and torch.equal(got[n][1], want[n][1]))]
    return bad + [n for n in got if n not in want]


def _gathered(mesh, name, dim, device) -> None:
    """Unsharded by FSDP2: the bytes and scales of the module built without FSDP; the bytes moved."""
    ref = _build(name, dim, device)
    mod = fully_shard(_build(name, dim, device), mesh=mesh)
    kinds = {type(p.to_local()).__name__ for p in mod.parameters() if p.dim() == 2}
    fp8_numel = sum(p.numel() for p in ref.parameters() if isinstance(p, Float8Weight))
    scales_numel = sum(p.scale_inv.numel() for p in ref.parameters() if isinstance(p, Float8Weight))
    other_numel = sum(p.numel() for p in ref.parameters() if not isinstance(p, Float8Weight))
    counted = []
    with _count_all_gathers(mesh.get_group(), counted):
        mod.unshard()
    got = _fp8_state(mod)
    mod.reshard()

    def local():
        assert kinds == {"Float8Weight"}, f"FSDP2 shards of the weights are {kinds}"
        bad = _same_state(got, _fp8_state(ref))
        assert not bad, f"gathered bytes or block scales differ from the unsharded module's: {bad}"
        want = fp8_numel + 4 * scales_numel + 4 * other_numel
        assert sum(counted) == want, f"FSDP2 gathered {sum(counted)} bytes, want {want} (1 per FP8 element + scales)"
    agree(dist.group.WORLD, device, local)


def _reference_step(ref, masters, opt, xs, dim):
    """One process: both dp ranks' batches, the gradients summed and halved (FSDP2's average)."""
    losses = []
    for x in xs:
        loss = _loss(ref, x, dim)
        loss.backward()
        losses.append(loss.detach())
    for p in ref.parameters():
        p.grad.div_(len(xs))
    masters.step(opt)
    return losses


def _training(mesh, name, dim, device) -> None:
    rank = mesh.get_local_rank()
    ref = _build(name, dim, device)
    mod = fully_shard(_build(name, dim, device), mesh=mesh)
    masters_ref, masters_mod = MasterWeights(ref.parameters()), MasterWeights(mod.parameters())
    opt_ref = torch.optim.SGD(masters_ref.parameters(), lr=0.5)
    opt_mod = torch.optim.SGD(masters_mod.parameters(), lr=0.5)
    losses = []
    for step, xs in enumerate(_batches(dim, device)):
        want = _reference_step(ref, masters_ref, opt_ref, xs, dim)[rank]
        loss = _loss(mod, xs[rank], dim)
        loss.backward()
        masters_mod.step(opt_mod)
        losses.append((step, loss.detach(), want))
    mod.unshard()
    got = _fp8_state(mod)
    mod.reshard()

    def local():
        for step, a, b in losses:
            assert torch.equal(a, b), f"step {step}: FSDP2 loss {a.item():.9g} != one-process {b.item():.9g}"
        bad = _same_state(got, _fp8_state(ref))
        assert not bad, f"after {STEPS} steps the FP8 weights differ from the one-process reference: {bad}"
    agree(dist.group.WORLD, device, local)


def _refusals(mesh, device) -> None:
    """128x128 blocks cut by FSDP2's ceil(N/2)-row shards: at fully_shard; unequal shards: at the first
    all-gather (unshard), 128x128 blocks and 1x128 tiles; the same line on both ranks."""
    errors = []
    for dim, out in ((2, 384), (2, 255), (1, 129)):
        torch.manual_seed(0)
        with quantized_model_init(recipe=_recipe(dim)):
            m = te.Linear(256, out, device=device)
        try:
            fully_shard(m, mesh=mesh).unshard()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))

    def local():
        want = [r"a view of its rows 192\.\.384 would start inside a block",
                r"FSDP2 over 2 ranks: the FP8 weight of shape \(255, 256\) in 128x128 blocks needs equal shards",
                r"FSDP2 over 2 ranks: the FP8 weight of shape \(129, 256\) in 1x128 tiles needs equal shards"]
        for pattern, error in zip(want, errors):
            assert error is not None and re.search(pattern, error) and "\n" not in error, (pattern, error)
    agree(dist.group.WORLD, device, local)


def _suite(rank, world, device):
    checks = Checks(rank)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    for dim in (2, 1):
        for name in MODULES:
            checks.run(f"all-gather {name} w_block_scaling_dim={dim}", _gathered, mesh, name, dim, device)
            checks.run(f"training {name} w_block_scaling_dim={dim}", _training, mesh, name, dim, device)
    checks.run("refusals", _refusals, mesh, device)
    checks.raise_if_failed()


def test_fsdp2_block_scaled_fp8_weights():
    spawn(_suite, WORLD)
