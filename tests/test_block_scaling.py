"""Float8BlockScaling: the block-scaled GEMM's accuracy, the recipe's and the region's one-line refusals,
recompute, checkpoints (te_parallel's format and TE's `_extra_state`), and a Llama-style layer that trains.
The modules' outputs and gradients against the fp64 block-quantized reference are in test_modules.py, TP/SP
in tests/distributed/test_block_tp.py, the kernels in tests/gpu/test_block_cast_cuda.py."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import autocast as autocast_mod
from te_parallel.fp8 import te_extra_state as tex
from te_parallel.fp8.blockwise import quantize_blockwise
from te_parallel.ops import gemm
from tests.reference import block_qdq, rel_err

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("m, k, n", [(256, 512, 384), (200, 300, 136), (64, 1024, 128)])
@pytest.mark.parametrize("w_dim", [2, 1])
def test_gemm_within_twice_the_error_of_the_same_quantization_in_fp64(m, k, n, w_dim, device):
    """‖block GEMM − x·Wᵀ‖ ≤ 2 × ‖fp64 product of the same quantized operands − x·Wᵀ‖ (x: 1x128 tiles;
    W: 128x128 blocks or 1x128 tiles), with rows and columns of very different magnitudes."""
    g = torch.Generator().manual_seed(m + k + n + w_dim)
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-10, 10, (m, 1), generator=g)
    w = torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-4, 4, (1, k), generator=g)
    exact = x.double() @ w.double().t()
    qx = quantize_blockwise(x.to(device), FP8, 1)
    qw = quantize_blockwise(w.to(device), FP8, w_dim, columnwise=w_dim == 1)
    y = gemm.fprop(qx, qw, torch.float32).cpu()
    same_in_fp64 = block_qdq(x, FP8, (1, 128)) @ block_qdq(w, FP8, (1, 128) if w_dim == 1 else (128, 128)).t()
    err, err64 = rel_err(y, exact), rel_err(same_in_fp64, exact)
    assert err <= 2 * err64, f"block GEMM error {err:.3e} > 2 x {err64:.3e} (the fp64 product of its operands)"
    assert rel_err(y, same_in_fp64) < (5e-4 if device == "cuda" else 1e-5)


def test_recipe_refuses_in_one_line():
    cases = [
        (dict(x_block_scaling_dim=3), "x_block_scaling_dim must be 1 (1x128 tiles) or 2 (128x128 blocks), got 3"),
        (dict(x_block_scaling_dim=2), "x_block_scaling_dim=2 and w_block_scaling_dim=2"),
        (dict(w_block_scaling_dim=1, grad_block_scaling_dim=2, x_block_scaling_dim=1), None),
        (dict(fp8_gemm_fprop=R.MMParams(use_split_accumulator=False)), "needs split accumulation: fp8_gemm_fprop"),
        (dict(fp8_format=R.Format.E5M2), "all-E5M2"),
        (dict(fp8_dpa=True), "fp8_dpa / fp8_mha"),
    ]
    for kwargs, message in cases:
        if message is None:
            R.Float8BlockScaling(**kwargs)
            continue
        with pytest.raises((ValueError, TypeError)) as info:
            R.Float8BlockScaling(**kwargs)
        assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number >= 0, got -1.0"):
        R.QParams(amax_epsilon=-1.0)


def test_region_refusals():
    lin = te.Linear(128, 128, device="cpu")
    with pytest.raises(NotImplementedError, match="MXFP8BlockScaling .* not implemented in te_parallel"):
        with te.fp8_autocast(fp8_recipe=R.MXFP8BlockScaling()):
            lin(torch.randn(16, 128))
    with pytest.raises(NotImplementedError, match="NVFP4BlockScaling"):
        with te.fp8_autocast(fp8_recipe=R.NVFP4BlockScaling()):
            pass
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        with pytest.raises(ValueError, match="a Float8BlockScaling region inside a DelayedScaling region"):
            with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
                pass
        with te.fp8_autocast(enabled=False, fp8_recipe=R.Float8BlockScaling()):  # a disabled region is fine
            pass
    with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
        with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling(fp8_format=R.Format.HYBRID)):  # same kind: fine
            lin(torch.randn(16, 128))


def test_gpu_without_hopper_or_cuda_12_9_is_named(monkeypatch):
    """The message names the GPU's capability, the CUDA version, and both requirements."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(autocast_mod, "_FP8_CAPABLE", {})
    ok, reason = autocast_mod.is_fp8_block_scaling_available(return_reason=True)
    assert not ok
    assert reason == ("Float8BlockScaling needs a Hopper GPU (compute capability 9.x) and CUDA >= 12.9; NVIDIA L40S "
                      "has 8.9 and torch was built with CUDA 12.4")
    with pytest.raises(RuntimeError, match="needs a Hopper GPU"):
        autocast_mod.check_recipe_runs(R.Float8BlockScaling())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(autocast_mod, "_FP8_CAPABLE", {})
    assert autocast_mod.is_fp8_block_scaling_available()


def _llama(device):
    return te.TransformerLayer(128, 256, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu",
                               bias=False, hidden_dropout=0.0, attention_dropout=0.0, device=device)


def test_recompute_replays_bit_for_bit(device):
    torch.manual_seed(0)
    layer = _llama(device)
    x = torch.randn(64, 2, 128, device=device)
    outs = []
    for use_ckpt in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
            y = te.checkpoint(layer, xi) if use_ckpt else layer(xi)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xi.grad, [p.grad.clone() for p in layer.parameters()]))
    (y, dx, grads), (y2, dx2, grads2) = outs
    assert torch.equal(y, y2) and torch.equal(dx, dx2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_checkpoints_round_trip_and_say_their_recipe(tmp_path, device):
    """te_parallel's format: a module trained under block scaling saves and loads its values (block scaling keeps
    no per-module scaling state, so the checkpoint loads under any recipe). TE's `_extra_state` names the recipe
    and its block arguments."""
    torch.manual_seed(0)
    layer = _llama(device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.randn(64, 2, 128, device=device)
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
            layer(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save(layer.state_dict(), tmp_path / "ckpt.pt")
    fresh = _llama(device)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
        assert torch.equal(fresh(x), layer(x))
    recipe = R.Float8BlockScaling(w_block_scaling_dim=1, fp8_quant_fwd_weight=R.QParams(power_2_scale=False))
    state = layer.self_attention.layernorm_qkv.fp8_state
    blob = tex.encode(tex.state_tensors(state), state.num_gemms, recipe)
    read = tex.decode(blob, state.num_gemms)
    assert read.recipe.te_name == "Float8BlockScaling"
    assert read.recipe.fields["w_block_scaling_dim"] == 1 and read.recipe.fields["x_block_scaling_dim"] == 1
    assert read.recipe.fields["fp8_quant_fwd_weight"].fields == {"power_2_scale": False, "amax_epsilon": 0.0}
    assert read.fwd_scale is None  # no per-tensor scales in a block-scaled state


def test_llama_layer_trains(device):
    """A Llama-style layer (RMSNorm, SwiGLU, GQA) under block scaling: the loss falls as in bf16-free fp32, and the
    first step's gradients are within FP8's error of fp32's."""
    torch.manual_seed(0)
    layers = [_llama(device), _llama(device)]
    layers[1].load_state_dict(layers[0].state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 2, 128, generator=g).to(device)
    target = torch.randn(128, 2, 128, generator=g).to(device)
    losses, first = {0: [], 1: []}, {}
    opts = [torch.optim.Adam(m.parameters(), lr=5e-3) for m in layers]
    for step in range(10):
        for i, (m, opt) in enumerate(zip(layers, opts)):
            with te.fp8_autocast(enabled=i == 0, fp8_recipe=R.Float8BlockScaling()):
                loss = (m(x) - target).float().pow(2).mean()
            loss.backward()
            if step == 0:
                first[i] = {n: p.grad.clone() for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
    for name, want in first[1].items():
        assert rel_err(first[0][name], want) < 0.1, (name, rel_err(first[0][name], want))
    assert losses[0][-1] < 0.95 * losses[0][0]
    assert abs(losses[0][-1] - losses[1][-1]) < 0.02 * losses[1][-1], (losses[0][-1], losses[1][-1])
