"""The RNG state tracker: reproducible forked streams that leave the caller's RNG exactly as it was.

Every test takes the `device` fixture ("cpu" here); tests/gpu/test_rng_tracker_cuda.py runs them on CUDA.
"""
import pytest
import torch
import torch.nn.functional as F

from te_parallel.parallel.random import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    model_parallel_seed,
)


def _draw(device, n=64):
    return torch.rand(n, device=device)


def _rng_state(device):
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_fork_is_reproducible_and_continues_the_stream(device):
    a, b = RNGStatesTracker(device), RNGStatesTracker(device)
    a.add("tp", 7)
    b.add("tp", 7)
    with a.fork("tp"):
        a1, a2 = _draw(device), _draw(device)
    with b.fork("tp"):
        b1 = _draw(device)
    with b.fork("tp"):  # the advanced state was saved back: the second fork continues the stream
        b2 = _draw(device)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert not torch.equal(a1, a2)
    expected = torch.Generator(device=device).manual_seed(7)
    assert torch.equal(a1, torch.rand(64, device=device, generator=expected))


def test_fork_restores_the_outer_state_exactly(device):
    tracker = CudaRNGStatesTracker(device)
    tracker.add("model-parallel-rng", 11)
    before = _rng_state(device).clone()
    with tracker.fork():
        _draw(device)
    assert torch.equal(_rng_state(device), before)
    outer_next = _draw(device)
    _set(device, before)
    assert torch.equal(_draw(device), outer_next)


def test_fork_restores_the_outer_state_after_an_exception(device):
    tracker = CudaRNGStatesTracker(device)
    tracker.add("x", 3)
    before = _rng_state(device).clone()
    with pytest.raises(ZeroDivisionError):
        with tracker.fork("x"):
            _draw(device)
            _ = 1 / 0
    assert torch.equal(_rng_state(device), before)


def test_add_does_not_disturb_the_callers_state(device):
    before = _rng_state(device).clone()
    tracker = CudaRNGStatesTracker(device)
    tracker.add("a", 1)
    tracker.add("b", 2)
    assert torch.equal(_rng_state(device), before)


def test_different_names_give_different_streams(device):
    tracker = CudaRNGStatesTracker(device)
    tracker.add("a", 100)
    tracker.add("b", 101)
    with tracker.fork("a"):
        from_a = _draw(device)
    with tracker.fork("b"):
        from_b = _draw(device)
    outer = _draw(device)
    assert not torch.equal(from_a, from_b)
    assert not torch.equal(from_a, outer) and not torch.equal(from_b, outer)


def test_duplicate_name_and_seed_are_one_line_errors(device):
    tracker = CudaRNGStatesTracker(device)
    tracker.add("model-parallel-rng", 5)
    with pytest.raises(ValueError) as e:
        tracker.add("model-parallel-rng", 6)
    assert "'model-parallel-rng' is already tracked" in _one_line(e)
    with pytest.raises(ValueError) as e:
        tracker.add("other", 5)
    msg = _one_line(e)
    assert "seed 5" in msg and "'other'" in msg and "'model-parallel-rng'" in msg
    with pytest.raises(KeyError) as e:
        with tracker.fork("missing"):
            pass
    assert "'missing'" in _one_line(e)
    tracker.reset()
    tracker.add("model-parallel-rng", 5)  # reset forgets names and seeds


def test_get_set_states_round_trip_replays_the_same_draws(device):
    tracker = CudaRNGStatesTracker(device)
    tracker.add("a", 21)
    tracker.add("b", 22)
    with tracker.fork("a"):
        _draw(device)  # advance one stream so the snapshot is not just the seeds
    saved = tracker.get_states()
    with tracker.fork("a"):
        first_a = _draw(device)
    with tracker.fork("b"):
        first_b = _draw(device)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(_draw(device), first_a)
    with tracker.fork("b"):
        assert torch.equal(_draw(device), first_b)
    assert set(saved) == {"a", "b"}
    with pytest.raises(TypeError) as e:
        tracker.set_states({"a": 3})
    assert "'a'" in _one_line(e)


def test_dropout_in_fork_is_reproducible_and_differs_across_tp_ranks(device):
    x = torch.ones(32, 128, device=device)

    def masks(tp_rank):
        torch.manual_seed(1234)  # the script seeds the default RNG with the same seed on every rank
        tracker = CudaRNGStatesTracker(device)
        tp_seed = model_parallel_seed(tracker, 1234, tp_rank)
        assert tp_seed == 1234 + 2718 + tp_rank
        with tracker.fork():
            sharded = F.dropout(x, p=0.5)
        replicated = F.dropout(x, p=0.5)  # default RNG: the same on every TP rank
        return sharded, replicated

    s0, r0 = masks(0)
    s0_again, r0_again = masks(0)
    s1, r1 = masks(1)
    assert torch.equal(s0, s0_again) and torch.equal(r0, r0_again)
    assert not torch.equal(s0, s1)
    assert torch.equal(r0, r1)


def test_model_parallel_seed_checks_tp_rank(device):
    with pytest.raises(ValueError) as e:
        model_parallel_seed(CudaRNGStatesTracker(device), 1, tp_rank=-1)
    assert "got -1" in _one_line(e)


def _set(device, state):
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)
