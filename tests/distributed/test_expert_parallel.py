"""te_parallel.MoELayer under expert parallelism (EP = 2, 4), EP = 2 × TP = 2 (with and without sequence
parallelism) and FSDP2, against one process holding all the experts (gloo on CPU, NCCL on GPUs).

Each EP rank routes its own batch (the EP ranks are data-parallel ranks). The one-process reference runs every
rank's batch through the full layer: a rank's output, input gradient, load-balancing loss and router gradient
are those of its own batch; an expert's gradient is the sum over all batches (the all-to-all's backward brings
every rank's tokens' gradients to the expert's rank). The parallel layers are built with the same seed as the
reference, and their local weights are first checked against the full ones (the same seed gives the same full
weights at any EP and TP size). The layers have a shared expert (every token's; whole on every EP rank, split
over TP like the others). Two launches: 2 and 4 processes.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from te_parallel.moe import MoELayer
from tests.distributed.harness import Checks, spawn, worlds

H, FFN, E, TOPK, S, B = 32, 64, 8, 2, 8, 2
SHARED = 32  # the shared expert's ffn size
ROUTING = dict(aux_loss_coeff=0.05, score_function="sigmoid", shared_expert_ffn_hidden_size=SHARED)


def _layer(device, seed, **kw):
    torch.manual_seed(seed)
    return MoELayer(H, FFN, E, TOPK, device=device, **ROUTING, **kw)


def _batch(i, device):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(S, B, H, generator=g).to(device), torch.randn(S, B, H, generator=g).to(device)


def _expert_weights(m):
    """[G, 2F/tp, h] and [G, h, F/tp] stacks of the layer's (local) experts' weights (or their gradients)."""
    fc1, fc2 = m.experts.linear_fc1, m.experts.linear_fc2
    return (torch.stack([getattr(fc1, f"weight{g}") for g in range(m.num_local_experts)]),
            torch.stack([getattr(fc2, f"weight{g}") for g in range(m.num_local_experts)]))


def _expert_grads(m):
    fc1, fc2 = m.experts.linear_fc1, m.experts.linear_fc2
    return (torch.stack([getattr(fc1, f"weight{g}").grad for g in range(m.num_local_experts)]),
            torch.stack([getattr(fc2, f"weight{g}").grad for g in range(m.num_local_experts)]))


def _shard(full1, full2, m, tp_rank, tp):
    """This rank's part of full [E, 2F, h] / [E, h, F] tensors: its experts; fc1 rows [gate_t; up_t], fc2 cols."""
    lo, hi = m.expert_offset, m.expert_offset + m.num_local_experts
    f = FFN // tp
    gate, up = full1[lo:hi, :FFN], full1[lo:hi, FFN:]
    fc1 = torch.cat([gate[:, tp_rank * f:(tp_rank + 1) * f], up[:, tp_rank * f:(tp_rank + 1) * f]], 1)
    return fc1, full2[lo:hi, :, tp_rank * f:(tp_rank + 1) * f]


def _shared(m, grads=False):
    """(fc1 [2S/tp, h], fc2 [h, S/tp]) of the shared expert, or their gradients."""
    w = (m.shared_experts.linear_fc1.weight0, m.shared_experts.linear_fc2.weight0)
    return tuple(p.grad for p in w) if grads else w


def _shared_shard(fc1, fc2, tp_rank, tp):
    f = SHARED // tp
    return (torch.cat([fc1[tp_rank * f:(tp_rank + 1) * f], fc1[SHARED + tp_rank * f:SHARED + (tp_rank + 1) * f]]),
            fc2[:, tp_rank * f:(tp_rank + 1) * f])


def _reference(device, batches):
    """Per batch (y, x.grad, aux, router.grad, experts' grads, shared expert's grads); and the experts'
    gradients summed over the batches (the shared expert, like the router, is whole on every ep rank)."""
    full = _layer(device, seed=11)
    per = []
    for x, g in batches:
        full.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        y = full(x)
        ((y * g).sum() + full.aux_loss).backward()
        per.append((y.detach(), x.grad, full.aux_loss.detach(), full.router.weight.grad.clone(), _expert_grads(full),
                    tuple(g.clone() for g in _shared(full, grads=True))))
    sums = tuple(sum(p[4][i] for p in per) for i in range(2))
    return full, per, sums


def _close(got, want, what, tol=1e-5):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs max {scale:.3g}"


def _case(device, ep_group, tp_group, ep_rank, ep, tp_rank, tp, sp, ep_arg=None):
    batches = [_batch(i, device) for i in range(ep)]
    full, per, sums = _reference(device, batches)
    m = _layer(device, seed=11, ep_group=ep_arg if ep_arg is not None else ep_group, tp_group=tp_group,
               sequence_parallel=sp)
    for got, want, name in zip(_expert_weights(m), _shard(*_expert_weights(full), m, tp_rank, tp), ("fc1", "fc2")):
        assert torch.equal(got, want), f"{name}: this rank's initial weights are not its part of the full ones"
    assert torch.equal(m.router.weight, full.router.weight)
    for got, want in zip(_shared(m), _shared_shard(*_shared(full), tp_rank, tp)):
        assert torch.equal(got, want), "the shared expert's initial weights are not its part of the full ones"
    x_full, g_full = batches[ep_rank]
    rows = slice(tp_rank * S // tp, (tp_rank + 1) * S // tp) if sp else slice(None)
    x = x_full[rows].clone().requires_grad_()
    y = m(x)
    ((y * g_full[rows]).sum() + m.aux_loss).backward()
    y_ref, xg_ref, aux_ref, router_ref, _, shared_ref = per[ep_rank]
    _close(y.detach(), y_ref[rows], "output")
    for got, want, name in zip(_shared(m, grads=True), _shared_shard(*shared_ref, tp_rank, tp), ("fc1", "fc2")):
        _close(got, want, f"shared expert's {name} gradient")
    _close(x.grad, xg_ref[rows], "input gradient")
    _close(m.aux_loss.detach(), aux_ref, "aux loss")
    _close(m.router.weight.grad, router_ref, "router gradient")
    for got, want, name in zip(_expert_grads(m), _shard(*sums, m, tp_rank, tp), ("fc1", "fc2")):
        _close(got, want, f"{name} gradients")


def _fsdp_case(device, world, mesh, ep_mesh=None):
    """fully_shard over the data-parallel ranks: dense parameters over all of them, the experts (EP > 1) over
    the ranks that hold the same experts with the gradient divided by the data-parallel size. The gradients
    are the data-parallel mean of the per-batch ones."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    ep = 1 if ep_mesh is None else ep_mesh["ep"].size()
    batches = [_batch(i, device) for i in range(world)]
    full, per, sums = _reference(device, batches)
    m = _layer(device, seed=11, ep_group=None if ep_mesh is None else ep_mesh)
    if ep_mesh is not None:
        fully_shard(m.experts, mesh=ep_mesh["edp"])
        m.experts.set_gradient_divide_factor(float(world))
        m.experts.set_force_sum_reduction_for_comms(True)  # (a sum, then the division: gloo has no PREMUL_SUM)
    fully_shard(m, mesh=mesh)
    x, g = batches[rank]
    x = x.clone().requires_grad_()
    y = m(x)
    ((y * g).sum() + m.aux_loss).backward()
    y_ref, xg_ref, aux_ref, _, _, _ = per[rank]
    _close(y.detach(), y_ref, "output")
    _close(x.grad, xg_ref, "input gradient")
    router_mean = sum(p[3] for p in per) / world
    _close(m.router.weight.grad.full_tensor(), router_mean, "router gradient (data-parallel mean)")
    fc1, fc2 = m.experts.linear_fc1, m.experts.linear_fc2
    got = (torch.stack([getattr(fc1, f"weight{i}").grad.full_tensor() for i in range(m.num_local_experts)]),
           torch.stack([getattr(fc2, f"weight{i}").grad.full_tensor() for i in range(m.num_local_experts)]))
    want = _shard(sums[0] / world, sums[1] / world, m, 0, 1)
    assert ep == 1 or m.num_local_experts == E // ep
    for a, b, name in zip(got, want, ("fc1", "fc2")):
        _close(a, b, f"{name} gradients (data-parallel mean)")


def _bad_ep(device, group):
    with pytest.raises(ValueError) as info:
        MoELayer(H, FFN, 6 if group.size() == 4 else 5, TOPK, device=device, ep_group=group)
    msg = str(info.value)
    assert "is not divisible by the" in msg and "ranks of ep_group" in msg and "\n" not in msg, msg


def _suite(rank, world, device):
    checks = Checks(rank)
    everyone = dist.new_group(list(range(world)))
    checks.run(f"EP={world}", _case, device, everyone, None, rank, world, 0, 1, False)
    checks.run(f"EP={world}: num_experts not divisible", _bad_ep, device, everyone)
    if world == 2:
        checks.run("TP=2 (experts split, EP=1)", _case, device, None, everyone, 0, 1, rank, 2, False)
        checks.run("TP=2 + SP (EP=1)", _case, device, None, everyone, 0, 1, rank, 2, True)
        dp = init_device_mesh(device.type, (2,), mesh_dim_names=("dp",))
        checks.run("FSDP2 over dp=2 (EP=1)", _fsdp_case, device, world, dp)
    if world == 4:
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("ep", "tp"))
        ep_rank, tp_rank = mesh.get_local_rank("ep"), mesh.get_local_rank("tp")
        for sp in (False, True):
            checks.run(f"EP=2 x TP=2, sp={sp}", _case, device, mesh["ep"].get_group(), mesh["tp"].get_group(),
                       ep_rank, 2, tp_rank, 2, sp, mesh)
        dp = init_device_mesh(device.type, (4,), mesh_dim_names=("dp",))
        ep_mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("edp", "ep"))
        checks.run("FSDP2 over dp=4, EP=2 (experts sharded over edp=2)", _fsdp_case, device, world, dp, ep_mesh)
    checks.raise_if_failed()


@pytest.mark.parametrize("world", worlds(2, 4))
def test_expert_parallel(world):
    spawn(_suite, world)
