"""Expert-parallel MoE layers seen whole by PyTorch's tools: state_dict(), torch.distributed.checkpoint (plain and
through te.dcp_state_dict with the optimizer) and te.clip_grad_norm_, against one process holding all the experts
(gloo on CPU, NCCL on GPUs).

Layouts: EP=2 (2 processes); EP=4, EP=2 x TP=2 and FSDP2 over dp=4 with EP=2 (4 processes). Every parallel layer is
built with the seed of the one-process reference, which therefore has the same full weights.

- state_dict() holds each expert once, under its name in the one-process layer (expert e: weight{e}), on the rank
  that holds it; its entries (TP shards assembled with full_tensor()) equal the reference's state_dict.
- dcp.save of model.state_dict() at one EP size loads at another (EP=1 on every rank, EP=2, EP=4, EP=2 x TP=2,
  and EP=1 -> EP=2): the weights, assembled by all-gathers from the names alone, equal the reference's, and each
  rank's forward equals the reference's on the same batch.
- te.dcp_state_dict(model, optimizer) after an Adam step reloads at other EP sizes with every weight and Adam
  moment bit-equal to the saved ones (assembled the same way).
- te.get_total_norm / te.clip_grad_norm_ (orders 2, 1, inf) equal torch's norm of the reference's gradients (the
  replicated parameters' gradients summed over the ep ranks first, as data parallelism would), the same on every
  rank bit for bit; the clipped gradients equal the reference's clipped by torch.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

if dist.is_available():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

import te_parallel as te
from te_parallel.moe import MoELayer
from tests.distributed.harness import Checks, spawn, worlds

H, FFN, E, TOPK, S, B = 32, 64, 8, 2, 8, 2
SHARED = 32
ROUTING = dict(aux_loss_coeff=0.05, score_function="sigmoid", shared_expert_ffn_hidden_size=SHARED)
EXPERT = re.compile(r"^experts\.linear_fc[12]\.weight(\d+)$")


@dataclass(frozen=True)
class Lay:
    """How a layer is spread over the ranks: its ep group (with this rank's place) and TP group."""

    name: str
    ep_group: object = None
    ep: int = 1
    ep_rank: int = 0
    tp_group: object = None
    tp: int = 1
    tp_rank: int = 0
    ep_arg: object = None  # what MoELayer gets as ep_group (a mesh with an "ep" axis), default ep_group

    def build(self, device, seed):
        torch.manual_seed(seed)
        return MoELayer(H, FFN, E, TOPK, device=device, **ROUTING, tp_group=self.tp_group,
                        ep_group=self.ep_arg if self.ep_arg is not None else self.ep_group)


def _batch(i, device):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(S, B, H, generator=g).to(device), torch.randn(S, B, H, generator=g).to(device)


def _loss(m, x, g):
    y = m(x)
    return (y * g).sum() + m.aux_loss, y


def _whole(lay: Lay, tensors: dict) -> dict:
    """{local parameter name: local tensor (or FSDP2 DTensor)} -> {name in the one-process layer: full tensor}, put
    together from the names alone: TP shards all-gathered (fc1 rows [gate_r; up_r], fc2 columns), local expert g
    renamed offset + g (offset = ep_rank · E/ep), experts all-gathered over the ep group."""
    out = {}
    for name in sorted(tensors):
        t = tensors[name]
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if lay.tp > 1 and ("linear_fc1" in name or "linear_fc2" in name):
            parts = [torch.empty_like(t) for _ in range(lay.tp)]
            dist.all_gather(parts, t.contiguous(), group=lay.tp_group)
            if "linear_fc1" in name:
                halves = [p.chunk(2, 0) for p in parts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                t = torch.cat(parts, 1)
        found = EXPERT.match(name)
        if found is not None:
            e = lay.ep_rank * (E // lay.ep) + int(found.group(1))
            name = name[:found.start(1)] + str(e)
        out[name] = t.cpu()
    if lay.ep > 1:
        gathered = [None] * lay.ep
        dist.all_gather_object(gathered, {n: t for n, t in out.items() if EXPERT.match(n)}, group=lay.ep_group)
        for part in gathered:
            out.update(part)
    return out


def _params(m) -> dict:
    return dict(m.named_parameters())


def _equal(what, got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:4]}"
    bad = [k for k in want if not torch.equal(got[k].cpu(), want[k].cpu())]
    assert not bad, f"{what}: {len(bad)} of {len(want)} differ, e.g. {bad[:3]}"


def _close(what, got, want, tol=1e-5) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs max {scale:.3g} (got max {got.abs().max().item():.6g})"


def _reference(device):
    """The one-process layer, its state_dict and parameters (cpu), and its output per batch."""
    ref = Lay("one process").build(device, 11)
    with torch.no_grad():
        outs = [ref(_batch(i, device)[0]).cpu() for i in range(4)]
    return ref, {k: v.detach().cpu() for k, v in ref.state_dict().items()}, outs


# -- state_dict() -------------------------------------------------------------------------------------------------

def _state_dict_is_whole(device, lay: Lay, ref_sd: dict) -> None:
    m = lay.build(device, 11)
    sd = m.state_dict()
    keys = [None] * lay.ep
    dist.all_gather_object(keys, sorted(sd), group=lay.ep_group)  # (the ranks that together hold every expert)
    # (the experts' FP8 scaling state has one slot per local expert: its shape depends on the ep size)
    values = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in sorted(sd.items())
              if not k.startswith(("experts.linear_fc1.fp8_state.", "experts.linear_fc2.fp8_state."))}
    experts = sorted(k for k in ref_sd if EXPERT.match(k))
    held = sorted(k for ks in keys for k in ks if EXPERT.match(k))
    assert held == experts, (f"the ep group's ranks hold expert weights {held[:6]}..., not each of the layer's "
                             f"{len(experts)} once")
    extra = sorted(set(sd) - set(ref_sd))
    assert not extra, f"names the one-process layer does not have: {extra[:4]}"
    _equal("state_dict entries", values, {k: ref_sd[k] for k in values})


# -- plain dcp.save / dcp.load --------------------------------------------------------------------------------------

def _plain_save(device, lay: Lay, path) -> None:
    m = lay.build(device, 11)
    dcp.save({"model": m.state_dict()}, checkpoint_id=path)


def _plain_load(device, lay: Lay, path, saved_ep: int, ref_sd: dict, outs) -> None:
    m = lay.build(device, 5)  # other weights, overwritten by the load
    sd = m.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)
    with _fp8_state_warning(saved_ep, lay):
        m.load_state_dict(sd)
    whole = _whole(lay, _params(m))
    with torch.no_grad():
        y = m(_batch(lay.ep_rank, device)[0]).cpu()
    _equal(f"weights loaded at {lay.name}", whole, {k: ref_sd[k] for k in whole})
    _close(f"forward at {lay.name}", y, outs[lay.ep_rank])


def _fp8_state_warning(saved_ep: int, lay: Lay):
    """At another ep size the experts' FP8 scaling state (one slot per local expert) starts fresh, with a warning."""
    if saved_ep == lay.ep:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match="another expert-parallel size")


# -- te.dcp_state_dict with the optimizer ---------------------------------------------------------------------------

def _sync_replicated_grads(m, lay: Lay) -> None:
    """Sum the gradients of the parameters every ep rank holds (router, shared expert) over the ep group, as data
    parallelism would: they are then the gradients of the loss over every ep rank's batch."""
    if lay.ep == 1:
        return
    for name, p in m.named_parameters():
        if not EXPERT.match(name) and p.grad is not None:
            dist.all_reduce(p.grad, group=lay.ep_group)


def _adam_step(device, lay: Lay):
    m = lay.build(device, 11)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x, g = _batch(lay.ep_rank, device)
    _loss(m, x, g)[0].backward()
    _sync_replicated_grads(m, lay)
    opt.step()
    return m, opt


def _moments(m, opt, key) -> dict:
    return {n: opt.state[p][key] for n, p in m.named_parameters()}


def _whole_state(lay, m, opt) -> dict:
    return {"param": _whole(lay, _params(m)), "exp_avg": _whole(lay, _moments(m, opt, "exp_avg")),
            "exp_avg_sq": _whole(lay, _moments(m, opt, "exp_avg_sq"))}


def _optim_save(device, lay: Lay, path) -> dict:
    m, opt = _adam_step(device, lay)
    dcp.save(te.dcp_state_dict(m, opt), checkpoint_id=path)
    return _whole_state(lay, m, opt)


def _optim_load(device, lay: Lay, path, saved_ep: int, saved: dict) -> None:
    m = lay.build(device, 5)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    sd = te.dcp_state_dict(m, opt)
    dcp.load(sd, checkpoint_id=path)
    with _fp8_state_warning(saved_ep, lay):
        te.load_dcp_state_dict(m, sd, opt)
    got = _whole_state(lay, m, opt)
    for key in saved:
        _equal(f"{key} loaded at {lay.name}", got[key], saved[key])
    steps = {float(opt.state[p]["step"]) for p in m.parameters()}
    assert steps == {1.0}, f"Adam's step counts after the load: {steps}"
    assert opt.param_groups[0]["lr"] == 1e-2, f"the param group's lr is {opt.param_groups[0]['lr']}, saved 1e-2"


# -- te.clip_grad_norm_ ---------------------------------------------------------------------------------------------

def _reference_grads(device, batches, scale=1.0) -> dict:
    ref = Lay("one process").build(device, 11)
    for x, g in batches:
        (_loss(ref, x, g)[0] * scale).backward()
    return ref


def _same_everywhere(value: torch.Tensor) -> bool:
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, value.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def _clip(device, lay: Lay) -> None:
    ref = _reference_grads(device, [_batch(i, device) for i in range(lay.ep)])
    m = lay.build(device, 11)
    x, g = _batch(lay.ep_rank, device)
    _loss(m, x, g)[0].backward()
    _sync_replicated_grads(m, lay)
    _check_norms(m, ref, lay)


def _check_norms(m, ref, lay: Lay) -> None:
    ref_grads = [p.grad for p in ref.parameters()]
    want_norms = {p: torch.nn.utils.get_total_norm(ref_grads, p).cpu() for p in (2.0, 1.0, math.inf)}
    norms = {p: te.get_total_norm(m, p) for p in (2.0, 1.0, math.inf)}
    same = {p: _same_everywhere(v) for p, v in norms.items()}
    max_norm = 0.5 * norms[2.0].item()  # (every gradient is scaled)
    total = te.clip_grad_norm_(m, max_norm)
    want_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    got = _whole(lay, {n: p.grad for n, p in m.named_parameters()})
    for p, v in norms.items():
        assert same[p], f"norm of order {p} differs across ranks"
        _close(f"norm of order {p}", v.cpu(), want_norms[p])
    _close("clip_grad_norm_'s total", total.cpu(), want_total.cpu())
    want = {n: p.grad.cpu() for n, p in ref.named_parameters()}
    assert sorted(got) == sorted(want), f"gradient names differ: {sorted(set(got) ^ set(want))[:4]}"
    for n in want:
        _close(f"clipped gradient of {n}", got[n], want[n])


def _fsdp_clip(device, world) -> None:
    """FSDP2 over dp=4, the experts split over ep=2 and sharded over the edp=2 ranks holding them: gradients are
    the data-parallel mean, so the reference is the mean over the 4 batches."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    ep_mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("edp", "ep"))
    lay = Lay("FSDP2 dp4, EP=2", ep_mesh["ep"].get_group(), 2, ep_mesh.get_local_rank("ep"), ep_arg=ep_mesh)
    ref = _reference_grads(device, [_batch(i, device) for i in range(world)], scale=1.0 / world)
    m = lay.build(device, 11)
    fully_shard(m.experts, mesh=ep_mesh["edp"])
    m.experts.set_gradient_divide_factor(float(world))
    m.experts.set_force_sum_reduction_for_comms(True)
    fully_shard(m, mesh=mesh)
    x, g = _batch(dist.get_rank(), device)
    _loss(m, x, g)[0].backward()
    _check_norms(m, ref, lay)


def _fsdp_save_load(device, world, path, ref_sd, outs) -> None:
    """FSDP2 (dp4, EP=2) state_dict() saved with dcp.save loads at EP=1 on every rank."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    ep_mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("edp", "ep"))
    lay = Lay("FSDP2 dp4, EP=2", ep_mesh["ep"].get_group(), 2, ep_mesh.get_local_rank("ep"), ep_arg=ep_mesh)
    m = lay.build(device, 11)
    fully_shard(m.experts, mesh=ep_mesh["edp"])
    fully_shard(m, mesh=mesh)
    dcp.save({"model": m.state_dict()}, checkpoint_id=path)
    _plain_load(device, Lay("EP=1"), path, 2, ref_sd, outs)


# -- the suites -----------------------------------------------------------------------------------------------------

def _layouts(world, device):
    rank = dist.get_rank()
    everyone = dist.new_group(list(range(world)))
    out = {"EP=1": Lay("EP=1"), f"EP={world}": Lay(f"EP={world}", everyone, world, rank)}
    if world == 4:
        pairs = init_device_mesh(device.type, (2, 2), mesh_dim_names=("edp", "ep"))
        out["EP=2"] = Lay("EP=2 (two replicas)", pairs["ep"].get_group(), 2, pairs.get_local_rank("ep"), ep_arg=pairs)
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("ep", "tp"))
        out["EP=2xTP=2"] = Lay("EP=2 x TP=2", mesh["ep"].get_group(), 2, mesh.get_local_rank("ep"),
                               mesh["tp"].get_group(), 2, mesh.get_local_rank("tp"), ep_arg=mesh)
    return out


def _suite(rank, world, device, tmp):
    checks = Checks(rank)
    lays = _layouts(world, device)
    _, ref_sd, outs = _reference(device)
    multi = [name for name in lays if name != "EP=1"]
    for name in multi:
        checks.run(f"state_dict() at {name} is the whole layer's", _state_dict_is_whole, device, lays[name], ref_sd)
    for save in multi + ["EP=1"]:
        path = f"{tmp}/plain_{save}"
        checks.run(f"dcp.save at {save}", _plain_save, device, lays[save], path)
        for load in lays:
            if load != save:
                checks.run(f"plain checkpoint of {save} loads at {load}", _plain_load, device, lays[load], path,
                           lays[save].ep, ref_sd, outs)
    saved = {}
    for save in multi:
        path = f"{tmp}/optim_{save}"
        checks.run(f"te.dcp_state_dict with Adam at {save}", lambda s=save, p=path: saved.update(
            {s: _optim_save(device, lays[s], p)}))
        for load in lays:
            if load != save and save in saved:
                checks.run(f"te.dcp_state_dict of {save} loads at {load}", _optim_load, device, lays[load], path,
                           lays[save].ep, saved[save])
    for name in multi:
        checks.run(f"te.clip_grad_norm_ at {name}", _clip, device, lays[name])
    if world == 4:
        checks.run("FSDP2 dp4 x EP=2: clip_grad_norm_", _fsdp_clip, device, world)
        checks.run("FSDP2 dp4 x EP=2: state_dict() saved, loaded at EP=1", _fsdp_save_load, device, world,
                   f"{tmp}/fsdp", ref_sd, outs)
    checks.raise_if_failed()


@pytest.mark.parametrize("world", worlds(2, 4))
def test_ep_checkpoint_and_clip(world, tmp_path):
    spawn(_suite, world, str(tmp_path))


def test_one_process_state_dict_is_unchanged():
    """Without expert parallelism the names are the local ones and a state dict round-trips."""
    ref = Lay("one process").build(torch.device("cpu"), 11)
    other = Lay("one process").build(torch.device("cpu"), 5)
    other.load_state_dict(ref.state_dict())
    _equal("round trip", {k: v for k, v in other.state_dict().items()}, dict(ref.state_dict()))
    assert [k for k in ref.state_dict() if EXPERT.match(k)] == (
        [f"experts.linear_fc1.weight{e}" for e in range(E)] + [f"experts.linear_fc2.weight{e}" for e in range(E)])


# -- the example trainer --------------------------------------------------------------------------------------------

def test_trainer_saves_and_resumes_expert_parallel_runs(tmp_path):
    """--experts 4 --ep 2 over 2 data-parallel replicas (FSDP2): a run stopped after 2 of 4 steps and resumed gives
    the uninterrupted run's losses and gradient norms bit for bit; resumed at --ep 1 (the checkpoint resharded,
    every replica holding every expert) it gives them to within the rounding of another summation order."""
    import json

    from te_parallel.examples.train_gpt import main

    args = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "2",
            "--corpus-bytes", "65536", "--device", "cpu", "--quiet", "--no-plot", "--fp8", "off", "--nproc", "2",
            "--tp", "1", "--experts", "4", "--topk", "2", "--steps", "4", "--warmup", "1", "--eval-every", "4",
            "--eval-batches", "1"]
    log = lambda d: json.loads((d / "log.json").read_text())["log"]  # noqa: E731
    full, first, second, third, ckpt = (tmp_path / n for n in ("full", "first", "second", "third", "ckpt"))
    main(args + ["--ep", "2", "--out", str(full)])
    main(args + ["--ep", "2", "--out", str(first), "--save", str(ckpt), "--stop-after", "2"])
    main(args + ["--ep", "2", "--out", str(second), "--resume", str(ckpt)])
    want, got = log(full), log(second)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    main(args + ["--ep", "1", "--out", str(third), "--resume", str(ckpt)])
    other = log(third)
    assert len(other) == 4
    for a, b in zip(other[2:], want[2:]):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a[key], b[key])
