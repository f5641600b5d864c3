"""Recipes and the delayed-scaling update rules, on hand-built amax sequences."""
import math

import pytest
import torch

from te_parallel import recipe as R
from te_parallel.common import recipe as R_alias
from te_parallel.fp8.scaling import current_scale, update_delayed_scaling, update_delayed_scaling_torch
from te_parallel.fp8.state import FP8ScalingState

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def test_alias_and_defaults():
    assert R_alias.DelayedScaling is R.DelayedScaling and R_alias.Format is R.Format
    d = R.DelayedScaling()
    assert (d.margin, d.interval, d.fp8_format, d.amax_history_len, d.amax_compute_algo, d.reduce_amax) == (
        0, 1, R.Format.HYBRID, 1024, "max", True)
    assert R.Format.HYBRID.fwd_dtype == torch.float8_e4m3fn and R.Format.HYBRID.bwd_dtype == torch.float8_e5m2
    assert R.Format.E4M3.bwd_dtype == torch.float8_e4m3fn and R.Format.E5M2.fwd_dtype == torch.float8_e5m2
    assert R.Float8CurrentScaling().fp8_format == R.Format.HYBRID
    assert d.min_fp8_gemm == 0 and R.Float8CurrentScaling().min_fp8_gemm == 0  # every GEMM in FP8, as TE
    for r in (d, R.Float8CurrentScaling()):  # TE's accumulation: fast in fprop, exact in dgrad / wgrad; native call
        assert r.fp8_gemm_fprop == R.MMParams(use_split_accumulator=False) and r.fp8_gemm_fprop.fast_accum
        assert r.fp8_gemm_dgrad == r.fp8_gemm_wgrad == R.MMParams()
    assert R.MMParams().use_split_accumulator and R.MMParams().backend == "native"
    assert R.MMParams(use_split_accumulator=False).fast_accum
    with pytest.raises(Exception):
        d.margin = 1  # frozen


@pytest.mark.parametrize("kwargs, match", [
    (dict(margin=-1), "margin"), (dict(interval=0), "interval"), (dict(amax_history_len=0), "amax_history_len"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"), (dict(fp8_format="E4M3"), "fp8_format"),
    (dict(scaling_factor_compute_algo=3), "scaling_factor_compute_algo"),
    (dict(min_fp8_gemm=-1), "min_fp8_gemm"), (dict(min_fp8_gemm=1.5), "min_fp8_gemm"),
    (dict(min_fp8_gemm=None), "min_fp8_gemm"), (dict(fp8_gemm_fprop=True), "fp8_gemm_fprop"),
])
def test_bad_recipe_args(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        R.DelayedScaling(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="cublas"), "backend must be one of"), (dict(use_split_accumulator=1), "use_split_accumulator"),
])
def test_bad_mm_params(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        R.MMParams(**kwargs)


def _state(hist_rows, scale=1.0):
    hist = torch.tensor(hist_rows, dtype=torch.float32)
    n = hist.shape[1]
    return hist, torch.full((n,), scale), torch.full((n,), 1.0 / scale)


def _update(states, **kw):
    rec = R.DelayedScaling(**kw)
    update_delayed_scaling(states, rec, E4M3_MAX, update_scale=True)


def test_max_over_history_and_roll():
    hist, s, si = _state([[2.0, 8.0], [4.0, 1.0], [1.0, 1.0]])
    _update([(hist, s, si)], amax_history_len=3)
    assert s.tolist() == [E4M3_MAX / 4.0, E4M3_MAX / 8.0]
    assert torch.equal(si, 1.0 / s)
    # rolled: row 0 zeroed for the next pass, row i = the pass i steps ago
    assert hist.tolist() == [[0.0, 0.0], [2.0, 8.0], [4.0, 1.0]]


def test_most_recent_and_margin():
    hist, s, si = _state([[2.0, 16.0], [64.0, 64.0]])
    _update([(hist, s, si)], amax_compute_algo="most_recent", margin=2)
    assert s.tolist() == [E4M3_MAX / 2.0 / 4.0, E4M3_MAX / 16.0 / 4.0]


def test_callable_algos():
    hist, s, si = _state([[2.0, 4.0], [6.0, 8.0]])
    _update([(hist, s, si)], amax_compute_algo=lambda h: h.mean(0),
            scaling_factor_compute_algo=lambda amax, scale, fmax, rec: fmax / amax / 2)
    assert s.tolist() == pytest.approx([E4M3_MAX / 4.0 / 2, E4M3_MAX / 6.0 / 2], rel=1e-6)


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), 1e-45])
def test_bad_amax_never_changes_scale(bad):
    # 1e-45 is a denormal: fp8_max / amax overflows to inf, which must not become a scale either.
    hist, s, si = _state([[bad, 2.0]], scale=3.0)
    _update([(hist, s, si)], amax_history_len=1)
    assert s[0].item() == 3.0 and s[1].item() == E4M3_MAX / 2.0
    assert si[0].item() == pytest.approx(1 / 3.0)


def test_nan_in_history_blocks_max_until_it_rolls_out():
    hist, s, si = _state([[float("nan")], [0.0]], scale=5.0)
    _update([(hist, s, si)])
    assert s.item() == 5.0
    hist[0, 0] = 1.0
    _update([(hist, s, si)])
    assert s.item() == 5.0  # NaN sits in row 1
    hist[0, 0] = 2.0
    _update([(hist, s, si)])
    assert s.item() == E4M3_MAX / 2.0  # rolled out of a 2-row history


def test_torch_reference_matches_dispatcher_on_many_states():
    torch.manual_seed(0)
    states = [(torch.rand(5, n) * 10, torch.rand(n) + 0.5, torch.zeros(n)) for n in (1, 3, 4)]
    copies = [tuple(t.clone() for t in st) for st in states]
    update_delayed_scaling(states, R.DelayedScaling(margin=1), E5M2_MAX, update_scale=True)
    for h, s, si in copies:
        update_delayed_scaling_torch(h, s, si, fp8_max=E5M2_MAX, scale_divisor=2.0, algo="max", update_scale=True)
    for a, b in zip(states, copies):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_interval_skips_scale_but_records_history():
    state = FP8ScalingState(num_gemms=1)
    rec = R.DelayedScaling(interval=3, amax_history_len=4)
    state.ensure_history_len(4)
    from te_parallel.fp8.autocast import _update_members
    scales = []
    for step, amax in enumerate([1.0, 2.0, 4.0, 8.0]):
        state.fwd_amax_history[0].fill_(amax)
        _update_members([(state, rec, None)], backward=False)
        scales.append(state.fwd_scale[0].item())
    # updates 0 and 3 recompute the scale (max over the kept history), 1 and 2 keep it
    assert scales == [E4M3_MAX / 1.0, E4M3_MAX / 1.0, E4M3_MAX / 1.0, E4M3_MAX / 8.0]
    assert state.updates() == [4, 0]


def test_update_count_round_trips_through_state_dict():
    """The update counts (kept on the host) are what the state dict saves and what a load restores,
    so `interval` continues where the checkpoint left it."""
    from te_parallel.fp8.autocast import _update_members

    rec = R.DelayedScaling(interval=3)
    state = FP8ScalingState(num_gemms=1)
    for _ in range(5):
        _update_members([(state, rec, None)], backward=False)
    _update_members([(state, rec, None)], backward=True)
    saved = state.state_dict()
    assert saved["update_count"].tolist() == [5, 1]
    fresh = FP8ScalingState(num_gemms=1)
    fresh.load_state_dict(saved)
    assert fresh.updates() == [5, 1]


def test_history_resize_keeps_recent_rows():
    state = FP8ScalingState(num_gemms=1)
    state.fwd_amax_history[:3] = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    state.ensure_history_len(2)
    assert state.fwd_amax_history.tolist() == [[1.0, 1.0], [2.0, 2.0]]
    state.ensure_history_len(4)
    assert state.fwd_amax_history.shape == (4, 2) and state.fwd_amax_history[2:].abs().sum() == 0


def test_current_scale():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan")])
    assert current_scale(amax, E4M3_MAX).tolist()[:3] == [224.0, 1.0, 1.0]
    assert current_scale(amax, E4M3_MAX)[3].item() == 1.0
    assert math.isfinite(current_scale(torch.tensor([1e-45]), E4M3_MAX).item())


def test_small_gemm_switch_never_applies_on_the_cpu():
    """FP8 on the CPU is emulation for development and tests: a huge min_fp8_gemm still quantizes."""
    import te_parallel as te

    torch.manual_seed(0)
    lin = te.Linear(64, 32)
    x = torch.randn(16, 64)
    with torch.no_grad():
        hp = lin(x)
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling(min_fp8_gemm=2**60)):
            q = lin(x)
    assert not torch.equal(q, hp)  # quantized: the FP8 path ran
    assert lin.fp8_state.fwd_amax_history[1].max() > 0  # and recorded its amaxes


def test_min_fp8_gemm_auto_is_accepted_and_intensity_is_work_per_cast_element():
    from te_parallel.fp8 import gemm_size

    assert R.DelayedScaling(min_fp8_gemm="auto").min_fp8_gemm == "auto"
    assert gemm_size.intensity(2048, 2048, 2048) == pytest.approx(2048 / 3)
    # a GEMM with more work but a thin side casts more per unit of work
    assert gemm_size.intensity(512, 8192, 8192) < gemm_size.intensity(2048, 2048, 2048)
    assert all(v > 0 for table in gemm_size.BREAK_EVEN.values() for v in table.values())
