"""Distributed checkpoints (torch.distributed.checkpoint) of TP models, resharded.

One 4-process launch: a dp2×tp2 model (FSDP2 over dp of a 2-D DeviceMesh, TP + SP inside, GQA, a
swiglu LayerNormMLP, FP8 delayed state after a few steps) is saved, then loaded at tp=4, at dp4
(FSDP2 over 4, tp=1), at tp=1 on every rank, and into a DDP dp2×tp2 model (which saves again); and
it resumes exactly at its own layout. Then this process, without torch.distributed, loads both
checkpoints at tp=1. The reference for the weights is assembled from the saved model's shards by
all-gathers and the module types (not from ShardLayout); every load must reproduce it bit for bit,
with the same FP8 state, and the same forward output (exact where no reduction crosses ranks).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.parallel.dcp import GlobalShards, global_chunks, global_shards
from te_parallel.parallel.sharding import ShardLayout
from tests.distributed.harness import Checks, agree, spawn
from tests.reference import fp8_layer_tol, rel_err

HID, FFN, HEADS, GQA, S, B = 64, 128, 8, 4, 8, 2  # FP8 GEMMs: every local size a multiple of 16 up to tp=4
COL_OUT, ROW_OUT = 64, 9  # 9 rows: FSDP2 shards row.weight unevenly (5/4 at dp2, 3/3/3/0 at dp4)
RECIPE = R.DelayedScaling(amax_history_len=4)
STEPS = 2  # steps before the save, and steps after it that the resumed model must repeat
GATED = ("fc1_weight", "fc1_bias")  # [a; b]: a TP shard holds [a_r; b_r]
COLUMN = ("query_weight", "query_bias", "key_weight", "key_bias", "value_weight", "value_bias", "col.weight",
          "col.bias")
ROW = ("proj.weight", "fc2_weight", "row.weight")
TOL = 1e-5  # fp32 forward, row-parallel partial sums added in another order than at tp=1


class Net(nn.Module):
    def __init__(self, group, sp: bool, device) -> None:
        super().__init__()
        kw = dict(hidden_dropout=0.0, attention_dropout=0.0, device=device, num_gqa_groups=GQA, activation="swiglu",
                  tp_group=group, set_parallel_mode=True, sequence_parallel=sp)
        self.layers = nn.ModuleList([te.TransformerLayer(HID, FFN, HEADS, **kw) for _ in range(2)])
        self.col = te.Linear(HID, COL_OUT, parallel_mode="column", sequence_parallel=sp, tp_group=group, device=device)
        self.row = te.Linear(COL_OUT, ROW_OUT, parallel_mode="row", sequence_parallel=sp, tp_group=group, device=device)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.col(x)
        with te.fp8_autocast(enabled=False):  # a head of 9 outputs: too narrow for an FP8 GEMM
            return self.row(x)


class Layout:
    """How a model is spread: its TP group (None: tp=1), whether the sequence is split, its FSDP2 mesh."""

    def __init__(self, tp_group=None, sp=False, dp_mesh=None, ddp_group=None, fp8_group=None) -> None:
        self.tp_group, self.sp, self.dp_mesh, self.ddp_group = tp_group, sp, dp_mesh, ddp_group
        self.fp8_group = fp8_group
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)

    def build(self, seed: int, device):
        torch.manual_seed(seed)
        net = Net(self.tp_group, self.sp, device)
        if self.dp_mesh is not None:
            from torch.distributed.fsdp import fully_shard
            for layer in net.layers:
                fully_shard(layer, mesh=self.dp_mesh)
            fully_shard(net, mesh=self.dp_mesh)
        if self.ddp_group is not None:
            net = nn.parallel.DistributedDataParallel(net, process_group=self.ddp_group)
        return net

    def local_seq(self, x):
        return x.chunk(self.tp, 0)[self.tp_rank] if self.sp else x

    def full_seq(self, y):
        if not self.sp:
            return y
        parts = [torch.empty_like(y) for _ in range(self.tp)]
        dist.all_gather(parts, y.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    def evaluate(self, net, x):
        """(high-precision output, FP8 output) for the full-sequence input x, gathered to the full sequence."""
        with torch.no_grad():
            y_hp = self.full_seq(net(self.local_seq(x)))
            with te.fp8_autocast(fp8_recipe=RECIPE, fp8_group=self.fp8_group):
                y_fp8 = self.full_seq(net(self.local_seq(x)))
        # An FP8 weight cast without grad is kept, keyed by the parameter's version and address; FSDP2
        # re-gathers into the same unsharded storage without changing its version, so the next forward
        # could reuse a weight cast with this pass's scale. The saved and the resumed model both drop it.
        for m in net.modules():
            if hasattr(m, "drop_fp8_weight_cache"):
                m.drop_fp8_weight_cache()
        return y_hp, y_fp8

    def train(self, net, opt, steps, dp_rank: int):
        losses = []
        for step in steps:
            x = torch.randn(S, B, HID, generator=torch.Generator().manual_seed(100 * step + dp_rank))
            with te.fp8_autocast(fp8_recipe=RECIPE, fp8_group=self.fp8_group):
                y = net(self.local_seq(x).to(_device(net)))
            loss = y.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        return torch.stack(losses)


def _device(net):
    p = next(net.parameters())
    return p.to_local().device if isinstance(p, DTensor) else p.device


def _bare(net):
    return net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net


def _kind(name: str) -> str:
    for kind, names in (("gated", GATED), ("column", COLUMN), ("row", ROW)):
        if name.endswith(names):
            return kind
    return "replicated"


def assemble(tensors: dict, layout: Layout) -> dict:
    """{name: TP-local tensor or FSDP2 DTensor} -> the full tensors, by all-gathers over dp (full_tensor)
    and tp, put together by module type (independently of ShardLayout)."""
    out = {}
    for name, t in tensors.items():
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        parts = [t]
        if layout.tp > 1:
            parts = [torch.empty_like(t) for _ in range(layout.tp)]
            dist.all_gather(parts, t.contiguous(), group=layout.tp_group)
        kind = _kind(name)
        if kind == "gated":
            halves = [p.chunk(2, 0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[name] = torch.cat(parts, 1 if kind == "row" else 0) if kind != "replicated" else parts[0]
    return out


def params(net) -> dict:
    return {n: p for n, p in _bare(net).named_parameters()}


def fp8_states(net) -> dict:
    return {k: v.clone() for k, v in _bare(net).state_dict().items() if ".fp8_state." in k}


def exp_avgs(net, opt) -> dict:
    return {n: opt.state[p]["exp_avg"] for n, p in _bare(net).named_parameters()}


def load(net, path, opt=None) -> None:
    sd = te.dcp_state_dict(net, opt)
    dcp.load(sd, checkpoint_id=path)
    te.load_dcp_state_dict(net, sd, opt)


def _equal(what, got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:4]}"
    bad = [k for k in want if not torch.equal(got[k].cpu(), want[k].cpu())]
    assert not bad, f"{what}: {len(bad)} of {len(want)} differ, e.g. {bad[:3]}"


def _close(what, got, want, tol) -> None:
    err = rel_err(got.cpu(), want.cpu())
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def _suite(rank, world, device, path):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device.type, [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    everyone = dist.new_group(list(range(world)))
    tp_group, dp_rank = mesh["tp"].get_group(), rank // 2
    saved = Layout(tp_group, sp=True, dp_mesh=mesh["dp"], fp8_group=everyone)
    net = saved.build(0, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    saved.train(net, opt, range(STEPS), dp_rank)
    dcp.save(te.dcp_state_dict(net, opt), checkpoint_id=os.path.join(path, "dp2xtp2"))
    ref = {"full": assemble(params(net), saved), "fp8": fp8_states(net), "exp_avg": assemble(exp_avgs(net, opt), saved),
           "x": torch.randn(S, B, HID, generator=torch.Generator().manual_seed(7)).to(device)}
    ref["y_hp"], ref["y_fp8"] = saved.evaluate(net, ref["x"])
    if rank == 0:
        torch.save({k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v.cpu())
                    for k, v in ref.items()}, os.path.join(path, "ref.pt"))
    after = {"loss": saved.train(net, opt, range(STEPS, 2 * STEPS), dp_rank), "fp8": fp8_states(net),
             "params": {n: p.to_local().clone() for n, p in params(net).items()}}
    checks = Checks(rank)
    checks.run("resume at dp2xtp2 (FSDP2): bit-equal continuation", _resume, saved, device, path, ref, after, dp_rank,
               everyone)
    tp4 = Layout(everyone, sp=True, fp8_group=everyone)
    checks.run("dp2xtp2 -> tp4 (SP)", _target, tp4, device, path, ref, everyone)
    y_tp1 = {}
    checks.run("dp2xtp2 -> tp1 on every rank", _target, Layout(), device, path, ref, everyone, y_tp1)
    dp4 = Layout(dp_mesh=DeviceMesh(device.type, list(range(world)), mesh_dim_names=("dp",)), fp8_group=everyone)
    checks.run("dp2xtp2 -> dp4 (FSDP2, tp1), with the optimizer", _target, dp4, device, path, ref, everyone, y_tp1,
               True)
    ddp = Layout(tp_group, sp=True, ddp_group=mesh["dp"].get_group(), fp8_group=everyone)
    checks.run("dp2xtp2 -> DDP dp2xtp2, saved again", _target, ddp, device, path, ref, everyone, None, False, "ddp")
    checks.run("buffers are stored from the first rank", _buffers_from_first_rank, rank, device, everyone)
    checks.raise_if_failed()


def _resume(layout, device, path, ref, after, dp_rank, everyone):
    """A fresh model and optimizer at the saved layout, loaded in place, repeat the saved model's steps bit for bit."""
    net = layout.build(1, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ptrs = [p.to_local().data_ptr() for p in net.parameters()]
    load(net, os.path.join(path, "dp2xtp2"), opt)
    moved = [n for (n, p), ptr in zip(params(net).items(), ptrs) if p.to_local().data_ptr() != ptr]
    full, fp8 = assemble(params(net), layout), fp8_states(net)
    y_hp, y_fp8 = layout.evaluate(net, ref["x"])
    loss = layout.train(net, opt, range(STEPS, 2 * STEPS), dp_rank)

    def local():
        assert not moved, f"load replaced parameters instead of writing into them: {moved[:3]}"
        _equal("parameters at the save", full, ref["full"])
        _equal("FP8 state at the save", fp8, ref["fp8"])
        assert torch.equal(y_hp, ref["y_hp"]) and torch.equal(y_fp8, ref["y_fp8"]), "forward output differs"
        assert torch.equal(loss, after["loss"]), f"losses {loss.tolist()} vs {after['loss'].tolist()}"
        _equal("parameters after the steps", {n: p.to_local() for n, p in params(net).items()}, after["params"])
        _equal("FP8 state after the steps", fp8_states(net), after["fp8"])

    agree(everyone, device, local)


def _target(layout, device, path, ref, everyone, y_tp1=None, with_optimizer=False, save_as=None):
    """Load the dp2xtp2 checkpoint at another layout: the same full weights and FP8 state, bit for bit, and
    the same forward output: bit-equal at the saved TP layout, equal to tp1's where neither layout reduces
    across ranks, else close. save_as: save it again, as loaded."""
    net = layout.build(7, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2) if with_optimizer else None
    load(net, os.path.join(path, "dp2xtp2"), opt)
    if save_as is not None:
        dcp.save(te.dcp_state_dict(net), checkpoint_id=os.path.join(path, save_as))
    full, fp8 = assemble(params(net), layout), fp8_states(net)
    avg = assemble(exp_avgs(net, opt), layout) if with_optimizer else None
    y_hp, y_fp8 = layout.evaluate(net, ref["x"])

    def local():
        _equal("parameters", full, ref["full"])
        _equal("FP8 state", fp8, ref["fp8"])
        if avg is not None:
            _equal("optimizer exp_avg", avg, ref["exp_avg"])
        if layout.tp == 2:
            assert torch.equal(y_hp, ref["y_hp"]) and torch.equal(y_fp8, ref["y_fp8"]), "forward output differs"
        _close("forward output", y_hp, ref["y_hp"], TOL)
        _close("FP8 forward output", y_fp8, ref["y_fp8"], fp8_layer_tol(device))
        if y_tp1 is not None and layout.tp == 1:
            if "hp" in y_tp1:
                assert torch.equal(y_hp, y_tp1["hp"]) and torch.equal(y_fp8, y_tp1["fp8"]), "output differs from tp1's"
            y_tp1.update(hp=y_hp, fp8=y_fp8)

    agree(everyone, device, local)


def _buffers_from_first_rank(rank, device, everyone):
    """Replicas whose FP8 states differ (fp8_group narrower than the data-parallel world) save rank 0's."""
    torch.manual_seed(0)
    lin = te.Linear(HID, 16, device=device)
    with te.fp8_autocast(fp8_recipe=RECIPE):
        lin(torch.full((16, HID), float(rank + 1), device=device))
    sd = te.dcp_state_dict(lin, process_group=everyone)["model"]
    first = lin.fp8_state.fwd_amax_history.clone()
    dist.broadcast(first, src=0, group=everyone)

    def local():
        assert torch.equal(sd["fp8_state.fwd_amax_history"].tensor, first), "saved amax history is not rank 0's"
        assert rank == 0 or not torch.equal(lin.fp8_state.fwd_amax_history, first), "replicas should differ here"

    agree(everyone, device, local)


def _single_process_load(ckpt: str, ref: dict) -> None:
    net = Layout().build(7, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is ... uninitialized, assuming ... single process"
        load(net, ckpt)
    _equal("parameters", dict(params(net)), ref["full"])
    _equal("FP8 state", fp8_states(net), ref["fp8"])
    y_hp, _ = Layout().evaluate(net, ref["x"])
    _close("forward output", y_hp, ref["y_hp"], TOL)


def _check_metadata(ckpt: str, ref: dict) -> None:
    """Sharded entries have their full shapes; the FP8 state is written once (as bytes: loaded whole by every rank)."""
    md = dcp.FileSystemReader(ckpt).read_metadata()
    entries = md.state_dict_metadata
    for name, full in ref["full"].items():
        assert entries[f"model.{name}"].size == full.shape, f"{name}: saved as {entries[f'model.{name}'].size}"
        assert entries[f"optim.state.{name}.exp_avg"].size == full.shape, f"{name}'s exp_avg"
    writes = {}
    for index in md.storage_data:
        writes[index.fqn] = writes.get(index.fqn, 0) + 1
    for name in ref["fp8"]:
        assert isinstance(entries[f"model.{name}"], BytesStorageMetadata), f"{name}: {entries[f'model.{name}']}"
        assert writes[f"model.{name}"] == 1, f"{name} written {writes[f'model.{name}']} times"
    assert len(entries["model.layers.0.layernorm_mlp.fc1_weight"].chunks) == 4  # [a_r; b_r] on 2 TP ranks


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_dcp_reshard(tmp_path):
    spawn(_suite, 4, str(tmp_path))
    ref = torch.load(tmp_path / "ref.pt")
    _check_metadata(str(tmp_path / "dp2xtp2"), ref)
    for ckpt in ("dp2xtp2", "ddp"):
        _single_process_load(str(tmp_path / ckpt), ref)


def test_global_chunks_cut_a_data_parallel_shard_at_the_pieces():
    """A gated fc1 shard [a_r; b_r] (rank 1 of 2, ffn 4: full rows 2-3 and 6-7) whose FSDP2 shard (local
    rows 1-2) straddles the two pieces; a row-parallel weight's dim-0 shard; an empty shard."""
    gated = ShardLayout((8, 3), 0, ((0, 2, 2), (2, 6, 2)))
    assert global_chunks(gated, (1, 0), (2, 3)) == [((3, 0), (1, 3), 0), ((6, 0), (1, 3), 1)]
    row = ShardLayout((5, 8), 1, ((0, 4, 4),))
    assert global_chunks(row, (2, 0), (3, 4)) == [((2, 4), (3, 4), 0)]
    assert global_chunks(row, (5, 0), (0, 4)) == []


def test_global_shards_are_views_and_checkpoint_only():
    local = torch.arange(12.0).reshape(4, 3)
    t = global_shards("w", local, ShardLayout((8, 3), 0, ((0, 2, 2), (2, 6, 2))))
    assert isinstance(t, GlobalShards) and t.shape == (8, 3)
    assert [c.offsets for c in t.__create_chunk_list__()] == [torch.Size([2, 0]), torch.Size([6, 0])]
    for off, _, view in t.chunks:
        assert view.data_ptr() == local[0 if off[0] == 2 else 2].data_ptr()  # views of the parameter, no copies
    with pytest.raises(TypeError, match="checkpoint entry of a TP-sharded parameter") as e:
        t.sum()
    assert "\n" not in str(e.value)


def test_bad_input():
    net = te.Linear(16, 16, device="cpu")
    with pytest.raises(TypeError, match="model must be an nn.Module, got dict"):
        te.dcp_state_dict({})
    with pytest.raises(ValueError, match=r"state_dict must be what dcp_state_dict returned .* got \['weight'\]"):
        te.load_dcp_state_dict(net, {"weight": net.weight})
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError, match="an optimizer was given but state_dict has no 'optim' entry"):
        te.load_dcp_state_dict(net, te.dcp_state_dict(net), opt)
    with pytest.raises(ValueError, match=r"w has shape \(4, 3\) but its ShardLayout describes a local shape \(2, 3\)"):
        global_shards("w", torch.zeros(4, 3), ShardLayout((4, 3), 0, ((0, 0, 2),)))


class _HalfRows(nn.Module):
    """A parameter that says it is rank 1's half of a [4, 3] tensor (no process group needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))

    def tp_shard_layouts(self):
        return {"w": ShardLayout((4, 3), 0, ((0, 2, 2),))}


def test_shared_parameter_is_sharded_under_every_name():
    net = nn.Module()
    net.a = _HalfRows()
    net.b = net.a  # tied: the state dict holds the parameter under both names
    net.buf = nn.Module()
    net.buf.register_buffer("count", torch.ones(2))
    sd = te.dcp_state_dict(net)["model"]
    assert sorted(sd) == ["a.w", "b.w", "buf.count"]
    for name in ("a.w", "b.w"):
        assert isinstance(sd[name], GlobalShards) and sd[name].__create_chunk_list__()[0].offsets == (2, 0), name
    assert torch.equal(sd["buf.count"].tensor, torch.ones(2))  # a buffer: StoredOnce


def test_fp8_weights_are_saved_as_their_values(tmp_path):
    """A model with FP8 weights (quantized_model_init) saves their values: a high-precision model loads them
    exactly, and an FP8-weight model gets the same bytes back."""
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=RECIPE):
        saved = te.Linear(32, 32, device="cpu")
    with te.fp8_autocast(fp8_recipe=RECIPE):
        saved(torch.randn(16, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process
        dcp.save(te.dcp_state_dict(saved), checkpoint_id=str(tmp_path))
        plain = te.Linear(32, 32, device="cpu")
        load(plain, str(tmp_path))
        with te.quantized_model_init(enabled=True, recipe=RECIPE):
            fp8 = te.Linear(32, 32, device="cpu")
        load(fp8, str(tmp_path))
    assert torch.equal(plain.weight, saved.weight.dequantize())
    assert torch.equal(fp8.weight.dequantize(), saved.weight.dequantize())
