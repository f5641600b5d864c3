"""The forward's delayed-scaling updates travel with the autocast frame: a forward registers its state with
the frame it runs under, a nested region hands its registrations to the region around it, and the
outermost exit updates every registered state once (one amax all-reduce per group, one fused update per
recipe), each thread with its own regions."""
import threading

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import autocast as ac
from te_parallel.fp8.state import FP8ScalingState


def _lin(device):
    return te.Linear(32, 16, device=device)


def _states(frame):
    return [id(s) for s in frame.pending_forward()]


def test_each_thread_keeps_its_regions_pending_updates(device):
    """Two threads inside their own regions at the same time: each frame holds its own module's state only,
    and each exit updates its own states once."""
    mods = {"a": _lin(device), "b": _lin(device)}
    x = torch.randn(16, 32, device=device)
    barrier = threading.Barrier(2, timeout=60)
    seen, errors = {}, []

    def worker(name):
        try:
            with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
                mods[name](x)
                barrier.wait()  # both forwards have registered before either looks or exits
                seen[name] = _states(ac.current_frame())
                barrier.wait()
            seen[name + " after"] = mods[name].fp8_state.updates()
        except BaseException as e:  # (reported by the main thread)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(n,)) for n in mods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen["a"] == [id(mods["a"].fp8_state)] and seen["b"] == [id(mods["b"].fp8_state)]
    assert seen["a after"] == [1, 0] and seen["b after"] == [1, 0]
    assert ac.current_frame() is None


def test_nested_regions_keep_theirs_until_the_outermost_exit(device):
    """Each region holds what ran in it; an inner exit hands its states to the region around it (no update
    yet); the outermost exit updates each state once, by the recipe of its first registration."""
    m1, m2, m3 = _lin(device), _lin(device), _lin(device)
    x = torch.randn(16, 32, device=device) * 4
    outer_recipe, inner_recipe = R.DelayedScaling(), R.DelayedScaling(margin=2)
    with te.fp8_autocast(fp8_recipe=outer_recipe):
        outer = ac.current_frame()
        m1(x)
        with te.fp8_autocast(fp8_recipe=inner_recipe):
            inner = ac.current_frame()
            m2(x)
            m1(x)  # registered in the outer region first: keeps the outer recipe
            assert _states(inner) == [id(m2.fp8_state), id(m1.fp8_state)]
            assert _states(outer) == [id(m1.fp8_state)]
        assert not inner.pending_forward()
        assert _states(outer) == [id(m1.fp8_state), id(m2.fp8_state)]
        with te.fp8_autocast(fp8_recipe=inner_recipe):  # a sibling region: its own, empty
            assert not ac.current_frame().pending_forward()
            m3(x)
        assert _states(outer) == [id(m1.fp8_state), id(m2.fp8_state), id(m3.fp8_state)]
        for m in (m1, m2, m3):
            assert torch.all(m.fp8_state.fwd_scale == 1) and m.fp8_state.updates() == [0, 0]
    assert not outer.pending_forward()
    amax = x.abs().max().double()
    for m, margin in ((m1, 0), (m2, 2), (m3, 2)):
        assert m.fp8_state.updates() == [1, 0]
        want = (448.0 / amax / 2**margin).float()
        assert m.fp8_state.fwd_scale[0] == want, (m, margin)


def test_a_region_that_raises_leaves_nothing_for_the_next(device):
    """The exit of a region whose body raised still updates what ran in it, and the next region updates
    only what runs in it."""
    m, n = _lin(device), _lin(device)
    x = torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="boom"):
        with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
            frame = ac.current_frame()
            m(x)
            raise ValueError("boom")
    assert ac.current_frame() is None and not frame.pending_forward()
    assert m.fp8_state.updates() == [1, 0]
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        n(x)
        assert _states(ac.current_frame()) == [id(n.fp8_state)]
    assert m.fp8_state.updates() == [1, 0] and n.fp8_state.updates() == [1, 0]
    # an inner region that raises inside an outer one that goes on: its states are the outer region's
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        outer = ac.current_frame()
        with pytest.raises(ValueError, match="inner"):
            with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
                m(x)
                raise ValueError("inner")
        assert ac.current_frame() is outer and _states(outer) == [id(m.fp8_state)]
        assert m.fp8_state.updates() == [1, 0]
    assert m.fp8_state.updates() == [2, 0] and n.fp8_state.updates() == [1, 0]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_scale_after_each_region_is_delayed_scalings_update(algo, device):
    """fwd_scale after each outermost exit = fp8_max / amax / 2**margin in fp64 (amax over the last
    amax_history_len passes, or the latest), for the input and the weight; scale_inv = 1 / scale."""
    recipe = R.DelayedScaling(margin=1, amax_history_len=4, amax_compute_algo=algo, fp8_format=R.Format.HYBRID)
    m = _lin(device)
    w_amax = m.weight.detach().abs().max().double()
    history = []  # fp64 amaxes of the input, one per pass
    for gain in (8.0, 1.0, 0.5, 2.0, 1.0, 0.25, 0.25):
        x = torch.randn(16, 32, device=device) * gain
        history.append(x.abs().max().double())
        with te.fp8_autocast(fp8_recipe=recipe):
            with te.fp8_autocast(fp8_recipe=recipe):  # (nesting changes nothing)
                m(x)
        x_amax = max(history[-4:]) if algo == "max" else history[-1]
        want = torch.stack([448.0 / x_amax / 2, 448.0 / w_amax / 2]).float()  # (fp64 rounded once to fp32)
        assert torch.equal(m.fp8_state.fwd_scale[:2].cpu(), want.cpu()), (gain, m.fp8_state.fwd_scale, want)
        assert torch.equal(m.fp8_state.fwd_scale_inv[:2], 1.0 / m.fp8_state.fwd_scale[:2])
    assert m.fp8_state.updates() == [7, 0]


def test_outermost_exit_batches_the_updates(monkeypatch):
    """All the states registered in nested regions: one amax all-reduce per group at the outermost exit (the
    rows in order of first registration), one fused update per recipe, nothing at an inner exit."""
    reduces, updates = [], []
    g1, g2 = object(), object()
    monkeypatch.setattr(ac.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ac.dist, "all_reduce", lambda t, op=None, group=None: reduces.append((group, t.clone())))
    real_update = ac.update_delayed_scaling
    monkeypatch.setattr(ac, "update_delayed_scaling",
                        lambda tensors, *a: (updates.append(len(tensors)), real_update(tensors, *a)))
    recipe, other = R.DelayedScaling(), R.DelayedScaling(margin=1)
    states = [FP8ScalingState(1) for _ in range(4)]
    for i, s in enumerate(states):
        s.ensure_history_len(recipe.amax_history_len)
        s.fwd_amax_history[0].fill_(i + 1.0)
    with te.fp8_autocast(fp8_recipe=recipe):
        ac.current_frame().register_forward(states[0], recipe, g1)
        with te.fp8_autocast(fp8_recipe=recipe):
            ac.current_frame().register_forward(states[1], recipe, g2)
            ac.record_forward(states[2], recipe, g1)  # (the innermost frame's, for code without its frame)
            ac.current_frame().register_forward(states[0], recipe, g1)  # a second call: one update
        assert not reduces and not updates
        ac.current_frame().register_forward(states[3], other, g1)
    assert [g for g, _ in reduces] == [g1, g2]
    assert torch.equal(reduces[0][1], torch.tensor([1.0, 1, 3, 3, 4, 4]))  # states 0, 2, 3: two slots each
    assert torch.equal(reduces[1][1], torch.tensor([2.0, 2]))
    assert sorted(updates) == [1, 1, 2]  # g1: recipe (states 0, 2) and other (3); g2: recipe (1)
    assert [s.updates() for s in states] == [[1, 0]] * 4


def test_registering_outside_a_region_is_an_error():
    with pytest.raises(RuntimeError, match="outside fp8_autocast"):
        ac.record_forward(FP8ScalingState(1), R.DelayedScaling(), None)
