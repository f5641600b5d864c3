"""Layout-independent init: the same seed gives the same full weights at TP = 1, 2 and 4 (and under FSDP2
on a dp × tp mesh), each rank generating only its shard. The TP=1 module is built in each worker's own
process; the TP shards are gathered through their ShardLayouts and compared bit for bit."""
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import te_parallel as te
from te_parallel.parallel.sharding import shard_layouts
from tests.distributed.harness import Checks, spawn, worlds

H, FFN, HEADS, GROUPS = 32, 64, 8, 4
TL = dict(hidden_dropout=0.0, attention_dropout=0.0)
CASES = {
    "Linear column": lambda **k: te.Linear(H, 48, parallel_mode="column", **k),
    "Linear row": lambda **k: te.Linear(48, H, parallel_mode="row", **k),
    "Linear column parameters_split": lambda **k: te.Linear(
        H, 64, parallel_mode="column", parameters_split={"query": 32, "key": 16, "value": 16}, **k),
    "LayerNormLinear column": lambda **k: te.LayerNormLinear(H, 48, parallel_mode="column", **k),
    "LayerNormMLP swiglu": lambda **k: te.LayerNormMLP(H, FFN, activation="swiglu", set_parallel_mode=True, **k),
    "TransformerLayer GQA": lambda **k: te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=GROUPS, activation="swiglu",
                                                            set_parallel_mode=True, **TL, **k),
    "TransformerLayer GQA fused [q|k|v]": lambda **k: te.TransformerLayer(
        H, FFN, HEADS, num_gqa_groups=GROUPS, fuse_qkv_params=True, qkv_weight_interleaved=False,
        set_parallel_mode=True, init_method=te.init.normal_(0.05), **TL, **k),
}


def _full_params(module, group) -> dict:
    """Every parameter of a TP module put together from all ranks' shards through their ShardLayouts."""
    world = dist.get_world_size(group)
    layouts = [None] * world
    dist.all_gather_object(layouts, shard_layouts(module), group=group)
    out = {}
    for name, p in module.named_parameters():
        local = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # an FSDP2 DTensor: its TP shard
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous(), group=group)
        full = torch.full(layouts[0][name].full_shape, float("nan"), dtype=local.dtype, device=local.device)
        for layout, shard in zip((lay[name] for lay in layouts), shards):
            for loc, index in layout.global_slices():
                full[index] = shard if layout.dim is None else shard.narrow(layout.dim, loc.start, loc.stop - loc.start)
        out[name] = full
    return out


def _compare(name, got: dict, want: dict) -> None:
    assert list(got) == list(want), f"{name}: parameter names {list(got)} vs {list(want)}"
    for n, w in want.items():
        assert not got[n].isnan().any(), f"{name}: {n} has elements no rank's layout covers"
        assert torch.equal(got[n], w.detach()), f"{name}: {n} differs from the TP=1 module's (max diff {(got[n] - w).abs().max():.3e})"


class _LargestAllocation(TorchDispatchMode):
    """The largest int64 / fp64 tensor any op makes: the generator's indices, Philox words and fp64 values,
    one per element it generates (the model is fp32, so its own tensors do not count)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.int64, torch.float64):
                self.numel = max(self.numel, t.numel())
        return out


def _outputs(name, module, ref, group, device):
    """(TP output, TP=1 output) of one input: the TP module must compute what the TP=1 one does, so its
    layouts describe the rows and columns its forward really uses (a wrong layout would still gather back
    to the TP=1 weights it generated)."""
    r, tp = dist.get_rank(group), dist.get_world_size(group)
    x = torch.randn(4, 2, 48 if name == "Linear row" else H, generator=torch.Generator().manual_seed(5)).to(device)
    want = ref(x)
    got = module(x.chunk(tp, -1)[r] if name == "Linear row" else x)
    if "column" in name:  # this rank's output columns are the rows of its weights, through their layouts
        layouts, full_at, parts = shard_layouts(module), 0, []
        for n, p in module.named_parameters():
            if n.endswith("weight") and p.dim() == 2:
                parts += [(full_at + index[0].start, full_at + index[0].stop) for _, index in layouts[n].global_slices()]
                full_at += layouts[n].full_shape[0]
        want = torch.cat([want[..., a:b] for a, b in parts], dim=-1)
    return got, want


def _case(name, group, device, meta: bool):
    torch.manual_seed(21)
    ref = CASES[name](device=device)
    want = dict(ref.named_parameters())
    torch.manual_seed(21)
    seen = _LargestAllocation()
    if not meta:
        module = CASES[name](device=device, tp_group=group)
    else:
        with torch.device("meta"):
            module = CASES[name](tp_group=group)
        module.to_empty(device=device)
        with seen:
            module.reset_parameters()
    got = _full_params(module, group)  # every collective first, then the local checks (harness.Checks)
    out, out_ref = _outputs(name, module, ref, group, device)
    _compare(name, got, want)
    assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-6), f"{name}: TP output differs from the TP=1 module's"
    biggest_local = max(p.numel() for p in module.parameters())
    assert not meta or 0 < seen.numel <= biggest_local, (
        f"{name}: reset_parameters generated {seen.numel} elements at once, more than the largest local parameter "
        f"has ({biggest_local})")


def _fsdp_case(rank, world, device):
    """Meta build -> fully_shard over dp -> to_empty -> reset_parameters on a dp × tp mesh: the full weights
    are the TP=1 module's (each rank generates only its FSDP shard of its TP shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tp = 2 if world == 4 else 1
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    name = "TransformerLayer GQA"
    torch.manual_seed(21)
    want = dict(CASES[name](device=device).named_parameters())
    torch.manual_seed(21)
    with torch.device("meta"):
        layer = CASES[name](tp_group=mesh["tp"].get_group() if tp > 1 else None)
    fully_shard(layer, mesh=mesh["dp"])
    layer.to_empty(device=device)
    layer.reset_parameters()
    got = _full_params(layer, mesh["tp"].get_group())
    _compare(f"FSDP2 dp{world // tp} x tp{tp} {name}", got, want)


def _suite(rank, world, device):
    group = dist.new_group(list(range(world)))
    checks = Checks(rank)
    for name in CASES:
        for meta in (False, True):
            checks.run(f"{name} {'meta + reset_parameters' if meta else 'eager'}", _case, name, group, device, meta)
    checks.run("FSDP2 on a dp x tp mesh", _fsdp_case, rank, world, device)
    checks.raise_if_failed()


@pytest.mark.parametrize("world", worlds(2, 4))
def test_init_is_layout_independent(world):
    spawn(_suite, world)
