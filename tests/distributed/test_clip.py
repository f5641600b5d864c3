"""Gradient norm and clipping across TP ranks (te.get_total_norm, te.clip_grad_norm_).

One 4-process launch (gloo on CPU, NCCL on GPUs) on a dp2 × tp2 mesh. A TP=2 + SP TransformerLayer
(GQA, SwiGLU, RMSNorm; the same full weights as a TP=1 layer built from the same seed) gives the same
total norm on every rank, bit for bit, equal to the norm of the TP=1 layer's gradients for the same
inputs; after 5 clipped SGD steps its whole (TP-replicated) parameters are bit-identical on the TP ranks
and all parameters match the TP=1 layer clipped by torch's clip_grad_norm_. Then the same under FSDP2
(dp2) × TP2, whose gradients are DTensors averaged over dp, against the TP=1 layer fed both dp ranks'
inputs. Norms of order 2, 1 and inf.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel.parallel.sharding import shard_layouts
from tests.distributed.harness import Checks, agree, spawn
from tests.distributed.test_dcp import assemble

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

HID, FFN, HEADS, GQA, S, B = 64, 128, 8, 4, 8, 2
MAX_NORM, LR, STEPS = 0.05, 0.5, 5  # small enough that every step clips
RTOL = 2e-5  # fp32: the same sums in another order


def _layer(group, sp, device):
    torch.manual_seed(0)  # the same full weights at any TP size (layout-independent init)
    return te.TransformerLayer(HID, FFN, HEADS, num_gqa_groups=GQA, activation="swiglu", normalization="RMSNorm",
                               hidden_dropout=0.0, attention_dropout=0.0, tp_group=group, set_parallel_mode=True,
                               sequence_parallel=sp, device=device)


def _input(step, dp_rank, device):
    return torch.randn(S, B, HID, generator=torch.Generator().manual_seed(100 * step + dp_rank)).to(device)


def _backward(net, x_full, tp_group):
    """loss = sum(y^2) over the full sequence; with SP each rank feeds and sums its chunk."""
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    y = net(x_full.chunk(tp, 0)[rank])
    y.pow(2).sum().backward()


def _same_on_group(value: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def _whole_param_names(net):
    return [n for n, lay in shard_layouts(net).items() if lay.is_replicated]


def _tp_case(rank, device, tp_group, everyone):
    """TP=2 + SP against TP=1, each dp replica on its own (the same data on both)."""
    net, ref = _layer(tp_group, True, device), _layer(None, False, device)
    x = _input(0, 0, device)
    _backward(net, x, tp_group)
    ref(x).pow(2).sum().backward()
    norms = {p: te.get_total_norm(net, p) for p in (2.0, 1.0, math.inf)}
    want = {p: torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()], p) for p in norms}
    same = {p: _same_on_group(n.reshape(1), everyone) for p, n in norms.items()}
    torch_own = torch.nn.utils.get_total_norm([q.grad for q in net.parameters()], 2.0)  # one rank's shards

    def local():
        for p in norms:
            assert same[p], f"order {p}: the norm differs between ranks"
            assert torch.allclose(norms[p], want[p], rtol=RTOL, atol=0), (p, norms[p].item(), want[p].item())
        assert not torch.allclose(torch_own, want[2.0], rtol=1e-3), "torch's own norm should miss the other shards"

    agree(everyone, device, local)

    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    totals = []
    for step in range(STEPS):
        for model, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
        x = _input(step + 1, 0, device)
        _backward(net, x, tp_group)
        ref(x).pow(2).sum().backward()
        totals.append((te.clip_grad_norm_(net, MAX_NORM), torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        ref_opt.step()
    whole = {n: p.detach() for n, p in net.named_parameters() if n in _whole_param_names(net)}
    identical = {n: _same_on_group(t, tp_group) for n, t in whole.items()}
    full = assemble(dict(net.named_parameters()), _Tp(tp_group))

    def after():
        assert whole, "no whole parameter to compare"
        assert all(identical.values()), f"whole parameters differ across TP ranks: {[n for n, ok in identical.items() if not ok]}"
        for got, want in totals:
            assert got > MAX_NORM and torch.allclose(got, want, rtol=1e-4), (got.item(), want.item())
        bad = [n for n, p in ref.named_parameters() if not torch.allclose(full[n], p.detach(), rtol=1e-4, atol=1e-6)]
        assert not bad, f"parameters differ from the TP=1 layer clipped by torch: {bad[:4]}"

    agree(everyone, device, after)


class _Tp:
    """What tests.distributed.test_dcp.assemble needs to know of a layout."""

    def __init__(self, group):
        self.tp_group, self.tp = group, dist.get_world_size(group)


def _fsdp_case(rank, device, mesh, tp_group, everyone):
    """FSDP2 (dp2) × TP2 + SP, each dp rank its own data, against TP=1 fed both dp ranks' inputs."""
    from torch.distributed.fsdp import fully_shard

    net, ref = _layer(tp_group, True, device), _layer(None, False, device)
    fully_shard(net, mesh=mesh["dp"])
    dp_rank = mesh.get_local_rank("dp")
    _backward(net, _input(0, dp_rank, device), tp_group)  # FSDP2 averages the dp ranks' gradients
    loss = sum(ref(_input(0, r, device)).pow(2).sum() for r in range(2)) / 2
    loss.backward()
    norm = te.get_total_norm(net)
    want = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()])
    same = _same_on_group(norm.reshape(1), everyone)
    clipped = te.clip_grad_norm_(net, MAX_NORM)
    after = te.get_total_norm(net)

    def local():
        assert same, "the norm differs between ranks"
        assert torch.allclose(norm, want, rtol=RTOL, atol=0), (norm.item(), want.item())
        assert torch.equal(clipped, norm)
        assert torch.allclose(after, torch.tensor(MAX_NORM, device=after.device), rtol=1e-4), after.item()

    agree(everyone, device, local)


def _suite(rank, world, device):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device.type, [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    everyone = dist.new_group(list(range(world)))
    checks = Checks(rank)
    checks.run("TP=2 + SP: the global norm, then 5 clipped steps", _tp_case, rank, device, mesh["tp"].get_group(),
               everyone)
    checks.run("FSDP2 (dp2) x TP2", _fsdp_case, rank, device, mesh, mesh["tp"].get_group(), everyone)
    checks.raise_if_failed()


def test_clip_across_tp_and_fsdp2():
    spawn(_suite, 4)


def test_bad_input():
    net = te.Linear(16, 16, device="cpu")
    with pytest.raises(TypeError, match="pass the model .* got generator"):
        te.clip_grad_norm_(net.parameters(), 1.0)
    with pytest.raises(ValueError, match="max_norm must be a positive number, got -1"):
        te.clip_grad_norm_(net, -1)
    with pytest.raises(ValueError, match="norm_type must be positive"):
        te.get_total_norm(net, 0)
    net(torch.randn(4, 16)).sum().backward()
    net.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="total norm of order 2.0 of the gradients is nan"):
        te.clip_grad_norm_(net, 1.0, error_if_nonfinite=True)


def test_one_process_matches_torch():
    """tp=1: torch's clip_grad_norm_'s norm and clipped gradients, to fp32's last bit (te's sums are fp64)."""
    torch.manual_seed(0)
    a = te.LayerNormMLP(32, 64, device="cpu")
    b = te.LayerNormMLP(32, 64, device="cpu")
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 32)
    for m in (a, b):
        m(x).pow(2).sum().backward()
    got, want = te.clip_grad_norm_(a, 0.1), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    assert torch.allclose(got, want, rtol=2.5e-7, atol=0), (got.item(), want.item())
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=5e-7, atol=0)
