"""fp8_autocast semantics: nesting, calibration, when scales update, the weight cache."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import autocast as ac
from te_parallel.ops import cast as cast_mod
from tests.reference import rel_err


def _lin(device, **kw):
    return te.Linear(32, 16, device=device, **kw)


def test_nesting_innermost_decides(device):
    m = _lin(device)
    x = torch.randn(16, 32, device=device)
    plain = m(x)
    outer, inner = R.DelayedScaling(), R.Float8CurrentScaling()
    with te.fp8_autocast(enabled=True, fp8_recipe=outer):
        assert ac.current_frame().recipe is outer
        with te.fp8_autocast(enabled=False):
            assert torch.equal(m(x), plain)  # FP8 off inside
        with te.fp8_autocast(enabled=True, fp8_recipe=inner):
            assert ac.current_frame().recipe is inner
            y = m(x)
        assert ac.current_frame().recipe is outer
    assert ac.current_frame() is None
    assert not torch.equal(y, plain)


def test_forward_scales_update_only_at_outermost_exit(device):
    m = _lin(device)
    x = torch.randn(16, 32, device=device) * 10
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
            m(x)
        assert torch.all(m.fp8_state.fwd_scale == 1)  # inner exit: no update yet
        assert m.fp8_state.fwd_amax_history[0, 0].item() == x.abs().max().item()
        m(x * 2)  # a second call in the same region accumulates the max
    assert m.fp8_state.fwd_scale[0].item() == pytest.approx(448.0 / (x.abs().max().item() * 2))
    assert m.fp8_state.fwd_amax_history[0].abs().sum() == 0  # rolled
    assert m.fp8_state.updates() == [1, 0]


def test_backward_scales_update_when_backward_ends(device):
    a, b = _lin(device), te.Linear(16, 16, device=device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        y = b(a(x))
    dy = torch.randn_like(y) * 1000
    y.backward(dy)
    assert a.fp8_state.updates() == [1, 1] and b.fp8_state.updates() == [1, 1]
    assert b.fp8_state.bwd_scale.item() == pytest.approx(57344.0 / dy.abs().max().item(), rel=1e-6)
    assert b.fp8_state.bwd_amax_history[0].item() == 0 and b.fp8_state.bwd_amax_history[1].item() == dy.abs().max().item()


def test_backward_updates_continue_after_a_backward_that_raised(device):
    """A backward pass that raises never runs its end-of-pass callback; the passes after it must still
    update their backward scales (the queued-update marker is per pass, not a flag left set)."""
    bad = _lin(device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        y = bad(x)
    with torch.no_grad():
        bad.weight.mul_(2.0)  # backward's FP8 weight check raises after the gradient cast recorded its amax
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        y.sum().backward()
    good = _lin(device)
    for step in (1, 2):
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
            y = good(x)
        y.sum().backward()
        assert good.fp8_state.updates() == [step, step]


def test_calibrating_records_amax_without_fp8(device):
    m = _lin(device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    plain = m(x)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=R.DelayedScaling()):
        y = m(x)
    assert torch.equal(y, plain)  # high precision
    assert m.fp8_state.fwd_scale[0].item() == pytest.approx(448.0 / x.abs().max().item())
    assert m.fp8_state.fwd_scale[1].item() == pytest.approx(448.0 / m.weight.abs().max().item())
    y.sum().backward()
    assert m.fp8_state.updates() == [1, 1]


def test_weight_cache_policy(device, monkeypatch):
    """The FP8 weight is kept for a later forward only where one can use it (explicit micro-batches,
    inference); a plain training step casts it in forward, frees it, and re-encodes Wᵀ in backward."""
    m = te.LayerNormMLP(32, 64, device=device)
    calls = []
    real = cast_mod.quantize

    def counting(x, *a, **k):
        calls.append((tuple(x.shape), k.get("rowwise", True)))
        return real(x, *a, **k)

    monkeypatch.setattr(cast_mod, "quantize", counting)
    x = torch.randn(16, 32, device=device)
    rec = R.DelayedScaling()
    weight_shapes = {tuple(m.fc1_weight.shape), tuple(m.fc2_weight.shape)}

    def weight_casts():
        fwd = sum(shape in weight_shapes and rowwise for shape, rowwise in calls)
        bwd = sum(shape in weight_shapes and not rowwise for shape, rowwise in calls)
        calls.clear()
        return fwd, bwd

    def optimizer_step():
        with torch.no_grad():
            for p in m.parameters():
                p.sub_(1e-3 * p.grad)
        m.zero_grad()

    # TE's default (is_first_microbatch=None): every forward casts, backward re-encodes Wᵀ, nothing is kept
    for step in range(2):
        for micro in range(3):
            with te.fp8_autocast(fp8_recipe=rec):
                m(x).sum().backward()
            assert not m._weight_cache
        optimizer_step()
    assert weight_casts() == (2 * 6, 2 * 6)
    # explicit micro-batches: cast once per step, kept, and backward transposes the kept bytes
    for step in range(2):
        for micro in range(3):
            with te.fp8_autocast(fp8_recipe=rec):
                m(x, is_first_microbatch=micro == 0).sum().backward()
        optimizer_step()
    assert weight_casts() == (2 * 2, 0)
    # inference: kept while the parameters are unchanged (their version counters)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=rec):
        m(x)
        m(x)
        m.fc1_weight.add_(1e-3)
        m(x)
    assert weight_casts() == (2 + 1, 0)


def test_weight_changed_before_backward_raises(device):
    m = te.Linear(32, 16, device=device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    with te.fp8_autocast():
        y = m(x)
    with torch.no_grad():
        m.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"shape \(16, 32\) was modified in place between forward and backward"):
        y.sum().backward()


def test_is_fp8_available():
    ok, reason = te.is_fp8_available(return_reason=True)
    assert isinstance(ok, bool) and isinstance(reason, str)
    if not torch.cuda.is_available():
        assert ok and reason == ""


def test_old_gpu_raises(monkeypatch):
    from te_parallel.fp8 import autocast

    monkeypatch.setattr(autocast, "_FP8_CAPABLE", {})  # the answer is kept per device: ask again
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    assert te.is_fp8_available(return_reason=True) == (False, "FP8 needs compute capability >= 8.9 (Ada/Hopper); NVIDIA A100 has 8.0")
    with pytest.raises(RuntimeError, match="A100 has 8.0"):
        with te.fp8_autocast(enabled=True):
            pass
    with te.fp8_autocast(enabled=False):  # disabled FP8 is fine on any GPU
        pass


def test_region_ends_when_its_body_raises_and_works_as_a_decorator(device):
    m = _lin(device)
    x = torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="boom"):
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling(min_fp8_gemm=0)):  # (FP8 even at this size on a GPU)
            m(x)
            raise ValueError("boom")
    assert ac.current_frame() is None
    assert m.fp8_state.fwd_amax_history.abs().max() > 0  # the forward that ran was still recorded ...
    assert m.fp8_state.updates() == [1, 0]  # ... and its update ran at the exit

    @te.fp8_autocast(fp8_recipe=R.Float8CurrentScaling())
    def forward(inp):
        assert isinstance(ac.current_frame().recipe, R.Float8CurrentScaling)
        return m(inp)

    forward(x)
    forward(x)  # (the same object enters again)
    assert ac.current_frame() is None
    with te.fp8_autocast():
        assert ac.current_frame().recipe == R.DelayedScaling()  # no recipe given: the default


def test_bad_recipe_type():
    with pytest.raises(TypeError, match="fp8_recipe"):
        with te.fp8_autocast(fp8_recipe="hybrid"):
            pass


def test_e5m2_forward_is_rejected(device):
    m = _lin(device)
    with pytest.raises(ValueError, match="two E5M2"):
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling(fp8_format=R.Format.E5M2)):
            m(torch.randn(16, 32, device=device))


@pytest.mark.parametrize("tokens", [8, 24, 5])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_any_token_count_runs_in_fp8(kind, tokens, device):
    """TE runs FP8 on any multiple of 8 tokens (Lightning and accelerate send 8); te_parallel on any count.
    Per-tensor scales make a token's FP8 forward independent of the others, so the rows equal the same
    rows run inside a 32-token batch (current scaling: the batch's amax is set by a shared outlier row; the
    MLP's hidden amax is not, so its rows are compared with the high-precision forward)."""
    torch.manual_seed(0)
    m = getattr(te, kind)(64, 128, device=device) if kind == "LayerNormMLP" else getattr(te, kind)(64, 48, device=device)
    big = torch.randn(32, 64, device=device)
    big[-1, 0] = 40.0  # the amax of every batch below
    x = torch.cat([big[: tokens - 1], big[-1:]]).requires_grad_()
    rec = R.Float8CurrentScaling()
    with te.fp8_autocast(fp8_recipe=rec):
        y = m(x)
        y_big = m(big)
    if kind == "LayerNormMLP":
        assert rel_err(y.detach(), m(x).detach()) < 0.1
    else:
        assert torch.equal(y[:-1], y_big[: tokens - 1]) and torch.equal(y[-1], y_big[-1])
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert ac.current_frame() is None
