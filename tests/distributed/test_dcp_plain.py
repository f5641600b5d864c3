"""PyTorch's own checkpoint API on TP models, with no te_parallel call: `dcp.save({"model":
model.state_dict()})`, `dcp.load` + `load_state_dict`, and get_model_state_dict / set_model_state_dict.

One 4-process launch (gloo on CPU, NCCL on GPUs). TP=2 models, without and with sequence parallelism,
and a FSDP2(dp2)×TP2 model are trained for a few FP8 steps and saved through `model.state_dict()`; each
checkpoint is loaded at tp=1 on every rank, at tp=4 and at FSDP2(dp2)×TP2. Every load must give the
saved model's full weights (assembled by all-gathers and the module types, not from ShardLayout) and its
FP8 state, bit for bit. Then the ways a tool could act on one shard must fail loudly instead: torch.save
of a TP state dict, tensor operations on its entries, and load_state_dict of another TP layout's shards.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import te_parallel as te
from te_parallel.parallel.dcp import GlobalShards
from tests.distributed.harness import Checks, agree, spawn
from tests.distributed.test_dcp import HID, RECIPE, STEPS, Layout, _equal, assemble, fp8_states, params

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def _plain_load(net, path) -> None:
    """The documented DCP round trip: load into the model's own state dict, then hand it back."""
    sd = net.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)
    net.load_state_dict(sd)


def _torch_api_load(net, path) -> None:
    sd = get_model_state_dict(net)
    dcp.load({"model": sd}, checkpoint_id=path)
    set_model_state_dict(net, sd)


def _saved(layout, device, path, name, rank):
    """Train, save through state_dict(), and return the reference (full weights, FP8 state)."""
    net = layout.build(0, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    layout.train(net, opt, range(STEPS), 0)  # the same data on every replica: replicas stay equal
    sd = net.state_dict()
    sharded = [k for k, v in sd.items() if isinstance(v, GlobalShards)]
    dcp.save({"model": sd}, checkpoint_id=os.path.join(path, name))
    ref = {"full": assemble(params(net), layout), "fp8": fp8_states(net), "sharded": sharded}
    return net, ref


def _check_target(layout, device, path, name, ref, everyone, loader) -> None:
    net = layout.build(7, device)
    loader(net, os.path.join(path, name))
    full, fp8 = assemble(params(net), layout), fp8_states(net)

    def local():
        _equal("parameters", full, ref["full"])
        _equal("FP8 state", fp8, ref["fp8"])

    agree(everyone, device, local)


def _in_place_without_load_state_dict(layout, device, path, name, ref, everyone) -> None:
    """dcp.load alone writes the TP shards into the parameters (the entries are views of them)."""
    net = layout.build(7, device)
    dcp.load({"model": net.state_dict()}, checkpoint_id=os.path.join(path, name))
    full = assemble(params(net), layout)
    agree(everyone, device, lambda: _equal("parameters", full, ref["full"]))


def _whole_tensor_views(layout, device, net, ref, everyone) -> None:
    """state_dict() entries of TP shards have the full shape; full_tensor() assembles them; to_local() is
    the parameter; the replicated ones stay plain tensors."""
    sd = net.state_dict()
    got = {k: sd[k].full_tensor() for k in ref["sharded"]}
    local_is_param = all(sd[k].to_local().data_ptr() == dict(params(net))[k].data_ptr() for k in ref["sharded"])

    def local():
        assert ref["sharded"], "no TP-sharded entry in the state dict"
        for k in ref["sharded"]:
            assert tuple(sd[k].shape) == tuple(ref["full"][k].shape), (k, tuple(sd[k].shape))
        _equal("full_tensor()", got, {k: ref["full"][k] for k in ref["sharded"]})
        assert local_is_param, "to_local() is not the parameter's storage"
        assert not any(isinstance(v, GlobalShards) for k, v in sd.items() if k not in ref["sharded"])

    agree(everyone, device, local)


def _refusals(device, net, tp4_layout, everyone) -> None:
    """Each way a PyTorch tool could silently take one rank's shard raises one line instead."""
    sd = net.state_dict()
    key = next(k for k, v in sd.items() if isinstance(v, GlobalShards))
    other = tp4_layout.build(7, device)
    errors = {}
    for what, fn in (("torch.save", lambda: torch.save(sd, os.devnull)),
                     ("clone", lambda: sd[key].clone()),
                     ("load of another layout", lambda: other.load_state_dict(sd))):
        try:
            fn()
            errors[what] = None
        except (TypeError, ValueError) as e:
            errors[what] = str(e)

    def local():
        for what, msg in errors.items():
            assert msg is not None, f"{what} of a TP state dict did not raise"
            assert "\n" not in msg, f"{what}: not one line: {msg}"
        assert "torch.distributed.checkpoint" in errors["torch.save"], errors["torch.save"]
        assert ".full_tensor()" in errors["clone"], errors["clone"]
        assert "another layout" in errors["load of another layout"], errors["load of another layout"]

    agree(everyone, device, local)


def _suite(rank, world, device, path):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device.type, [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    everyone = dist.new_group(list(range(world)))
    tp_group = mesh["tp"].get_group()
    checks = Checks(rank)
    saved_layouts = {"tp2": Layout(tp_group, sp=False, fp8_group=tp_group),
                     "tp2sp": Layout(tp_group, sp=True, fp8_group=tp_group),
                     "fsdp2xtp2": Layout(tp_group, sp=True, dp_mesh=mesh["dp"], fp8_group=everyone)}
    for name, saved in saved_layouts.items():
        net, ref = _saved(saved, device, path, name, rank)
        if name == "tp2sp":
            checks.run(f"{name}: whole-tensor entries", _whole_tensor_views, saved, device, net, ref, everyone)
            checks.run(f"{name}: refusals", _refusals, device, net, Layout(everyone, sp=True), everyone)
        targets = {"tp1 on every rank": Layout(),
                   "tp4": Layout(everyone, sp=saved.sp, fp8_group=everyone),
                   "fsdp2(dp2)xtp2": Layout(tp_group, sp=True, dp_mesh=mesh["dp"], fp8_group=everyone)}
        for target, layout in targets.items():
            checks.run(f"{name} -> {target} (dcp.load + load_state_dict)", _check_target, layout, device, path, name,
                       ref, everyone, _plain_load)
        checks.run(f"{name} -> tp4 (get/set_model_state_dict)", _check_target, targets["tp4"], device, path, name,
                   ref, everyone, _torch_api_load)
        checks.run(f"{name} -> {name} (dcp.load alone, in place)", _in_place_without_load_state_dict, saved, device,
                   path, name, ref, everyone)
        if rank == 0:
            torch.save({k: v.cpu() for k, v in {**ref["full"], **ref["fp8"]}.items()},
                       os.path.join(path, f"{name}.ref.pt"))
    checks.raise_if_failed()


def test_plain_dcp_reshards(tmp_path):
    spawn(_suite, 4, str(tmp_path))
    for name in ("tp2", "tp2sp", "fsdp2xtp2"):  # and one process, without torch.distributed
        ref = torch.load(tmp_path / f"{name}.ref.pt")
        net = Layout().build(7, "cpu")
        with pytest.warns(UserWarning):  # DCP: no process group, "assuming the intent is to load in a single process"
            _plain_load(net, str(tmp_path / name))
        _equal("parameters", dict(params(net)), {k: v for k, v in ref.items() if ".fp8_state." not in k})
        _equal("FP8 state", fp8_states(net), {k: v for k, v in ref.items() if ".fp8_state." in k})


def test_fp8_weights_through_plain_state_dict(tmp_path):
    """quantized_model_init: state_dict() holds an FP8 weight's value in high precision, so a plain model loads
    it exactly, and an FP8-weight model whose weights were last written under the saved FP8 state (as
    MasterWeights writes them after each step) gets the same bytes back."""
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=RECIPE):
        saved = te.Linear(HID, HID, device="cpu")
    with te.fp8_autocast(fp8_recipe=RECIPE):
        saved(torch.randn(16, HID))  # moves the weight's scale away from the one its bytes were written with
    with torch.no_grad():
        saved.weight.copy_(saved.weight.dequantize())  # written again under the current scale
    assert type(saved.state_dict()["weight"]) is torch.Tensor
    with pytest.warns(UserWarning):
        dcp.save({"model": saved.state_dict()}, checkpoint_id=str(tmp_path))
    plain = te.Linear(HID, HID, device="cpu")
    with te.quantized_model_init(enabled=True, recipe=RECIPE):
        fp8 = te.Linear(HID, HID, device="cpu")
    for net in (plain, fp8):
        with pytest.warns(UserWarning):
            _plain_load(net, str(tmp_path))
    assert torch.equal(plain.weight, saved.weight.dequantize())
    assert torch.equal(fp8.weight.dequantize(), saved.weight.dequantize())
    assert torch.equal(fp8.fp8_state.fwd_scale, saved.fp8_state.fwd_scale)
