"""Recipe.min_fp8_gemm: with a positive size, GEMMs below it run in bf16 on CUDA, bit for bit the bf16 module;
the default (0) runs every GEMM in FP8."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)


@pytest.mark.parametrize("rec_cls", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
def test_small_gemm_runs_in_bf16_large_in_fp8(rec_cls):
    lin = te.Linear(256, 128, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    ref_out = lin(x)
    ref_out.backward(dy)
    ref = (ref_out.detach(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    size = 64 * 256 * 128
    for threshold, fp8 in ((size + 1, False), (size, True), (0, True)):
        x.grad = lin.weight.grad = lin.bias.grad = None
        with te.fp8_autocast(fp8_recipe=rec_cls(min_fp8_gemm=threshold)):
            out = lin(x)
        out.backward(dy)
        got = (out.detach(), x.grad, lin.weight.grad, lin.bias.grad)
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        assert same != fp8, f"threshold {threshold}: expected {'FP8' if fp8 else 'bf16'}"
    if rec_cls is recipe.DelayedScaling:
        assert lin.fp8_state.fwd_amax_history[1].max() > 0  # the FP8 passes recorded amaxes


def test_default_recipe_runs_every_gemm_in_fp8():
    """fp8_autocast with the default recipe never runs a GEMM in high precision, however small (as TE)."""
    lin = te.Linear(256, 128, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with te.fp8_autocast():
        out = lin(x)
    assert not torch.equal(out, lin(x))
    assert lin.fp8_state.fwd_amax_history.abs().max() > 0


def test_bad_threshold():
    with pytest.raises(ValueError, match="min_fp8_gemm must be an int >= 0"):
        recipe.DelayedScaling(min_fp8_gemm=-1)


def test_auto_uses_the_measured_break_even_and_reports_it(caplog, monkeypatch):
    """min_fp8_gemm="auto": bf16 below this architecture's measured break-even intensity
    (te_parallel.fp8.gemm_size.BREAK_EVEN), FP8 where none was measured; the choice and each GEMM sent to
    bf16 are logged."""
    import logging

    from te_parallel.fp8 import gemm_size

    cap = torch.cuda.get_device_capability()
    lin = te.Linear(256, 128, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    plain = lin(x)  # outside fp8_autocast
    level = gemm_size.intensity(64, 256, 128)  # 36.6 multiply-adds per element cast
    monkeypatch.setattr(gemm_size, "_RESOLVED", {})
    monkeypatch.setattr(gemm_size, "_REPORTED", set())  # (an earlier test may have logged this shape)
    monkeypatch.setitem(gemm_size.BREAK_EVEN, cap, {"DelayedScalingQuantizer": level + 0.5, "CurrentScalingQuantizer": level - 0.5})
    with caplog.at_level(logging.INFO, logger="te_parallel"):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(min_fp8_gemm="auto")):
            below = lin(x)
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling(min_fp8_gemm="auto")):
            at = lin(x)
    assert torch.equal(below, plain)  # below the break-even: the bf16 module, bit for bit
    assert not torch.equal(at, plain)  # at it: FP8
    assert "min_fp8_gemm='auto'" in caplog.text and "64x256x128" in caplog.text and "runs in bf16" in caplog.text
    monkeypatch.setattr(gemm_size, "_RESOLVED", {})
    monkeypatch.setitem(gemm_size.BREAK_EVEN, cap, {})  # an architecture nobody measured: every GEMM in FP8
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(min_fp8_gemm="auto")):
        assert not torch.equal(lin(x), plain)
