"""FSDP2 (`fully_shard` over the dp axis of a DeviceMesh) × te_parallel TP + SP × FP8, 4 processes.

Each composition trains a stack of TransformerLayers (GQA, swiglu, RMSNorm, sequence parallel) with
`fully_shard` per layer and on the root over mesh["dp"], against the same model (same TP layout, same
seed) without FSDP whose dp gradients are averaged by hand: the losses of every step must be
bit-equal. They are where the reduction is the same: FSDP's reduce-scatter and the reference's
all-reduce add dp=2 values in the one possible order, and dividing by a power of two is exact; at
dp=4 gloo sums in the same order too, NCCL may not (_loss_tol_dp4).
FP8 scales: with the default fp8_group (the TP group) they are identical across each TP group and,
as the inputs differ per dp rank, differ across dp; with fp8_group=mesh they are identical on all 4.
Also: FSDP2's MixedPrecisionPolicy(bf16 params, fp32 reduce) against a bf16 reference, FP8 parameters
(quantized_model_init) under FSDP2 with fp32 master weights, the bytes FSDP2 all-gathers for FP8
against bf16 parameters, and DeviceMesh arguments (tp_group, set_tensor_parallel_group, fp8_group).
One spawn of 4 processes runs every case (gloo on the CPU; NCCL with 4 GPUs).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.params import Float8Weight, MasterWeights, is_fp8_weight, quantized_model_init
from tests.distributed.harness import Checks, agree, spawn

S, B, HID, FFN, HEADS, GQA, LAYERS, STEPS = 8, 2, 64, 128, 8, 4, 2, 3  # TP=4: FP8 GEMM dims of 16
RECIPES = {"off": None, "delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling()}
MP_TOL = 0.0  # mixed precision: the reference makes the same bf16 casts and fp32 reduction (bit-equal)


def _loss_tol_dp4(device) -> float:
    """dp=4: gloo's reduce-scatter adds the 4 gradients in the order of its all-reduce (bit-equal,
    measured); NCCL's ring reduce-scatter and all-reduce may associate them differently."""
    return 0.0 if device.type == "cpu" else 1e-6


def _layer(tp, sp: bool, device, dtype=torch.float32):
    return te.TransformerLayer(HID, FFN, HEADS, num_gqa_groups=GQA, activation="swiglu", normalization="RMSNorm",
                               set_parallel_mode=True, sequence_parallel=sp, tp_group=tp, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=dtype, device=device,
                               init_method=lambda w: torch.nn.init.normal_(w, 0.0, 0.05))


def _stack(tp, device, fp8_params=None, dtype=torch.float32, sp: bool = True):
    """LAYERS layers, the same values on every rank of a TP position (same seed everywhere)."""
    torch.manual_seed(7)
    region = (quantized_model_init(recipe=fp8_params, preserve_high_precision_init_val=True)
              if fp8_params is not None else contextlib.nullcontext())
    with region:
        return torch.nn.Sequential(*[_layer(tp, sp, device, dtype) for _ in range(LAYERS)])


def _shard(model, dp, mp=None):
    kw = {} if mp is None else {"mp_policy": mp}
    for layer in model:
        fully_shard(layer, mesh=dp, **kw)
    fully_shard(model, mesh=dp, **kw)
    return model


def _batch(step: int, dp, tp, device, dtype=torch.float32):
    """This rank's input: its dp rank's batch (different per dp rank), its sequence shard (SP)."""
    g = torch.Generator().manual_seed(1000 + 10 * dp.get_local_rank() + step)
    x = torch.randn(S, B, HID, generator=g).to(device=device, dtype=dtype)
    return x.chunk(tp.size(), 0)[tp.get_local_rank()]


def _loss(y):
    return y.float().pow(2).mean()


def _forward(model, x, recipe, fp8_group=None):
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, fp8_group=fp8_group):
        return model(x)


def _averaged_by_hand(params, dp) -> None:
    for p in params:
        if dp.size() > 1:
            dist.all_reduce(p.grad, group=dp.get_group())
        p.grad.div_(dp.size())


def _train_pair(ref, mod, dp, tp, device, recipe, fp8_group=None, masters=None):
    """STEPS SGD steps of both models; returns [(ref loss, FSDP loss)] per step."""
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mod = torch.optim.SGD((masters or mod).parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x = _batch(step, dp, tp, device)
        l_ref = _loss(_forward(ref, x, recipe, fp8_group))
        l_ref.backward()
        _averaged_by_hand(ref.parameters(), dp)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        l_mod = _loss(_forward(mod, x, recipe, fp8_group))
        l_mod.backward()
        if masters is not None:
            masters.step(opt_mod)
        else:
            opt_mod.step()
            opt_mod.zero_grad(set_to_none=True)
        losses.append((l_ref.detach(), l_mod.detach()))
    return losses


def _state_bits(model) -> torch.Tensor:
    bufs = [m.fp8_state.fwd_scale for m in model.modules() if hasattr(m, "fp8_state")]
    bufs += [m.fp8_state.bwd_scale for m in model.modules() if hasattr(m, "fp8_state")]
    return torch.cat(bufs).view(torch.int32)


def _same_on(bits: torch.Tensor, group) -> bool:
    everyone = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, bits, group=group)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _check_losses(losses, dp_size: int, device) -> None:
    for step, (a, b) in enumerate(losses):
        if dp_size <= 2:
            assert torch.equal(a, b), f"step {step}: FSDP loss {b.item():.9g} != hand-averaged {a.item():.9g}"
        else:
            err, tol = abs(a.item() - b.item()) / abs(a.item()), _loss_tol_dp4(device)
            assert err <= tol, f"step {step}: FSDP loss {b.item():.9g} vs {a.item():.9g} (rel {err:.1e} > {tol:.0e})"


def _composition(mesh, recipe_name: str, whole_mesh: bool, device) -> None:
    """dp × tp with SP: FSDP2 equals hand-averaged dp gradients; amaxes reduced over TP or the whole mesh."""
    dp, tp = mesh["dp"], mesh["tp"]
    recipe, group = RECIPES[recipe_name], (mesh if whole_mesh else None)
    ref, mod = _stack(tp, device), _shard(_stack(tp, device), dp)
    losses = _train_pair(ref, mod, dp, tp, device, recipe, group)
    world = dist.group.WORLD
    facts = {}
    if recipe is not None and recipe.delayed():  # the collectives before any local assert
        bits = _state_bits(mod)
        facts = {"tp": _same_on(bits, tp.get_group()), "all": _same_on(bits, world),
                 "ref": torch.equal(bits, _state_bits(ref))}

    def local():
        _check_losses(losses, dp.size(), device)
        if facts:
            assert facts["ref"] or dp.size() > 2, "FSDP model's FP8 scales differ from the hand-averaged model's"
            assert facts["tp"], "FP8 scales differ within a TP group"
            if whole_mesh:
                assert facts["all"], "fp8_group=mesh: FP8 scales differ across the mesh"
            elif dp.size() > 1:
                assert not facts["all"], "fp8_group=None: scales agree across dp although amaxes were not reduced there"
    agree(world, device, local)


def _bf16_reference_step(model, masters, x, recipe, dp):
    """What FSDP2's MixedPrecisionPolicy(bf16, fp32) does, by hand: bf16 copies of fp32 masters,
    bf16 compute, gradients reduced in fp32 and averaged over dp, the update on the masters."""
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters):
            p.copy_(m)
    loss = _loss(_forward(model, x, recipe))
    loss.backward()
    for p, m in zip(model.parameters(), masters):
        m.grad = p.grad.float()
        p.grad = None
    _averaged_by_hand(masters, dp)
    return loss.detach()


def _mixed_precision(mesh, device) -> None:
    """fp32 parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the modules compute in
    bf16 (the unsharded parameters' dtype), equal to a bf16 model with fp32 masters, averaged by hand."""
    dp, tp = mesh["dp"], mesh["tp"]
    recipe = RECIPES["delayed"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mod = _shard(_stack(tp, device), dp, mp)
    ref = _stack(tp, device, dtype=torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in _stack(tp, device).parameters()]
    opt_ref, opt_mod = torch.optim.SGD(masters, lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    results = []
    for step in range(STEPS):
        x = _batch(step, dp, tp, device)
        l_ref = _bf16_reference_step(ref, masters, x.bfloat16(), recipe, dp)
        opt_ref.step()
        y = _forward(mod, x, recipe)
        l_mod = _loss(y)
        l_mod.backward()
        opt_mod.step()
        opt_mod.zero_grad(set_to_none=True)
        results.append((l_ref, l_mod.detach(), y.dtype))

    def local():
        for step, (a, b, dtype) in enumerate(results):
            assert dtype == torch.bfloat16, f"step {step}: output dtype {dtype}, want the unsharded params' bf16"
            err = abs(a.item() - b.item()) / abs(a.item())
            assert err <= MP_TOL, f"step {step}: FSDP bf16 loss {b.item():.9g} vs bf16 reference {a.item():.9g}"
    agree(dist.group.WORLD, device, local)


def _fp8_params(mesh, recipe_name: str, device) -> None:
    """quantized_model_init + FSDP2 + fp32 MasterWeights equals the high-precision model whose weights
    are cast to FP8 each forward, hand-averaged (the same FP8 bytes of every weight every step)."""
    dp, tp = mesh["dp"], mesh["tp"]
    recipe = RECIPES[recipe_name]
    ref = _stack(tp, device)
    mod = _shard(_stack(tp, device, fp8_params=recipe), dp)
    kinds = {type(p._local_tensor).__name__ for n, p in mod.named_parameters() if n.endswith("weight") and p.dim() == 2}
    masters = MasterWeights(mod.parameters())
    losses = _train_pair(ref, mod, dp, tp, device, recipe, masters=masters)

    def local():
        assert kinds == {"Float8Weight"}, f"FSDP shards of the GEMM weights are {kinds}"
        _check_losses(losses, dp.size(), device)
    agree(dist.group.WORLD, device, local)


@contextlib.contextmanager
def _count_all_gathers(group, counted: list):
    """Count the bytes FSDP2 all-gathers over `group` (torch 2.13 calls all_gather_single, older releases
    all_gather_into_tensor; one call may go through the other, so only the outermost is counted)."""
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    depth = [0]

    def wrap(fn):
        def counting(output_tensor, input_tensor, group=None, async_op=False, **kw):
            if depth[0] == 0 and group is target:
                counted.append(output_tensor.numel() * output_tensor.element_size())
            depth[0] += 1
            try:
                return fn(output_tensor, input_tensor, group=group, async_op=async_op, **kw)
            finally:
                depth[0] -= 1
        return counting
    target = group
    for n in names:
        setattr(dist, n, wrap(originals[n]))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _gathered_bytes(model, dp, tp, device) -> int:
    counted = []
    with _count_all_gathers(dp.get_group(), counted):
        y = _forward(model, _batch(0, dp, tp, device), RECIPES["delayed"])
    _loss(y).backward()  # (backward re-gathers too; the forward's gathers are counted)
    return sum(counted)


def _all_gather_bytes(mesh, device) -> None:
    """FSDP2 moves 1 byte per element of an FP8 weight, half of the 2 of bf16 (mixed precision bf16
    gathers for everything else), and nothing for its scale."""
    dp, tp = mesh["dp"], mesh["tp"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plain = _shard(_stack(tp, device), dp, mp)
    fp8 = _shard(_stack(tp, device, fp8_params=RECIPES["delayed"]), dp, mp)
    fp8_numel = sum(p.numel() for p in fp8.parameters() if is_fp8_weight(p))
    other_numel = sum(p.numel() for p in fp8.parameters() if not is_fp8_weight(p))
    got_plain, got_fp8 = _gathered_bytes(plain, dp, tp, device), _gathered_bytes(fp8, dp, tp, device)

    def local():
        assert got_plain == 2 * (fp8_numel + other_numel), f"bf16 model gathered {got_plain} bytes"
        assert got_fp8 == fp8_numel + 2 * other_numel, f"FP8-weight model gathered {got_fp8} bytes"
        assert got_fp8 - 2 * other_numel == (got_plain - 2 * other_numel) // 2, "FP8 weights did not move half"
    agree(dist.group.WORLD, device, local)


def _mesh_arguments(mesh, device) -> None:
    """DeviceMesh in: tp_group=mesh["tp"] (the mesh kept as tp_mesh), set_tensor_parallel_group(mesh["tp"]),
    a 2-D mesh refused in one line, fp8_group=mesh's group made once and kept on the mesh, initialize_ub."""
    tp = mesh["tp"]
    layer = _layer(tp, True, device)
    late = te.TransformerLayer(HID, FFN, HEADS, tp_size=tp.size(), set_parallel_mode=True, sequence_parallel=True,
                               output_layernorm=True, device=device)
    late.set_tensor_parallel_group(tp)
    groups = [te.fp8_autocast(fp8_group=mesh).fp8_group for _ in range(2)]
    size = dist.get_world_size(groups[0])
    ub = te.initialize_ub([S * B, HID], tp, use_fp8=False, dtype=torch.float32)
    try:
        te.Linear(HID, HID, tp_group=mesh, device=device)
        error = None
    except ValueError as e:
        error = str(e)

    def local():
        qkv = layer.self_attention.layernorm_qkv
        assert qkv.tp_group is tp.get_group() and qkv.tp_mesh is tp and layer.tp_mesh is tp
        assert all(m.tp_group is tp.get_group() for m in late.modules() if hasattr(m, "_tp_checked"))
        assert groups[0] is groups[1] and size == mesh.size(), "fp8_group=mesh: one group of all the mesh's ranks"
        assert ub.tp_group is tp.get_group()
        assert error is not None and "mesh['tp']" in error and "\n" not in error, error
    agree(dist.group.WORLD, device, local)


def _suite(rank, world, device):
    checks = Checks(rank)
    meshes = {shape: init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
              for shape in ((2, 2), (1, 4), (4, 1))}
    # dp=2 without TP: pairs of consecutive ranks (two independent dp=2 jobs), tp of one rank
    pairs = init_device_mesh(device.type, (2, 2, 1), mesh_dim_names=("job", "dp", "tp"))
    checks.run("DeviceMesh arguments", _mesh_arguments, meshes[(2, 2)], device)
    for shape, mesh in meshes.items():
        for recipe_name in ("delayed", "current"):
            checks.run(f"dp{shape[0]} x tp{shape[1]} {recipe_name}", _composition, mesh, recipe_name, False, device)
    checks.run("dp2 x tp2 delayed fp8_group=mesh", _composition, meshes[(2, 2)], "delayed", True, device)
    checks.run("dp4 x tp1 delayed fp8_group=mesh", _composition, meshes[(4, 1)], "delayed", True, device)
    checks.run("dp2 x tp2 no FP8", _composition, meshes[(2, 2)], "off", False, device)
    checks.run("mixed precision bf16/fp32", _mixed_precision, meshes[(2, 2)], device)
    for recipe_name in ("delayed", "current"):
        checks.run(f"FP8 params dp2 {recipe_name}", _fp8_params, pairs, recipe_name, device)
        checks.run(f"FP8 params dp2 x tp2 {recipe_name}", _fp8_params, meshes[(2, 2)], recipe_name, device)
    checks.run("all-gather bytes: FP8 vs bf16 weights", _all_gather_bytes, pairs, device)
    checks.raise_if_failed()


def test_fsdp2_compositions():
    spawn(_suite, 4)
