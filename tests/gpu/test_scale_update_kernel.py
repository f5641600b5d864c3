"""Native fused delayed-scaling update vs the torch reference, bit for bit (needs CUDA and _C).

Bit-exact is the contract (no cross-rank reduction here), so results are compared as
int32 bit patterns: torch.equal on floats would call NaN != NaN and +0 == -0.
"""
import itertools

import pytest
import torch

from te_parallel import native
from te_parallel.native import scaling as native_scaling

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

from te_parallel.fp8.scaling import update_delayed_scaling_torch  # noqa: E402

HISTORY_LENS = (1, 3, 1024, 2049)
NUM_TENSORS = (1, 2, 3, 7)
DENORMAL = 1e-40  # below float32's smallest normal (1.18e-38)
# Specials written into one column each; "near_overflow" makes fp8_max / amax land close to
# float32's max, so the isfinite(new) check decides (finite for E4M3's 448, inf for E5M2's 57344).
SPECIALS = ("nan", "inf", "zero", "denormal", "negative", "near_overflow", "neg_zero")


def _random_history(L: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Positive amaxes over 8 decades, with special columns; fresh random values each call."""
    exponents = torch.randint(-4, 4, (L, n), generator=gen).float()
    hist = torch.rand(L, n, generator=gen) * 10.0 ** exponents  # [L, n]
    for j in range(n):
        pick = int(torch.randint(0, len(SPECIALS) + 2, (1,), generator=gen))
        if pick >= len(SPECIALS):
            continue  # an ordinary column
        kind = SPECIALS[pick]
        # In row 0 half the time, so that algo "most_recent" sees the special too.
        row = 0 if torch.rand(1, generator=gen).item() < 0.5 else int(torch.randint(0, L, (1,), generator=gen))
        if kind == "nan":
            hist[row, j] = float("nan")
        elif kind == "inf":
            hist[row, j] = float("inf")
        elif kind == "zero":
            hist[:, j] = 0.0
        elif kind == "denormal":
            hist[:, j] = torch.rand(L, generator=gen) * DENORMAL
        elif kind == "negative":
            hist[:, j] = -hist[:, j] - 1.0
        elif kind == "near_overflow":
            hist[:, j] = 1.4e-36 * torch.rand(L, generator=gen)
            hist[row, j] = 1.4e-36
        elif kind == "neg_zero":
            hist[:, j] = -0.0
    return hist


def _make_states(shapes, seed: int, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    states = []
    for L, n in shapes:
        hist = _random_history(L, n, gen)
        scale = torch.rand(n, generator=gen) * 4 + 0.25
        scale_inv = torch.rand(n, generator=gen) + 7.0  # not 1/scale: must stay put without update
        states.append(tuple(t.to(device) for t in (hist, scale, scale_inv)))
    return states


def _clone(states):
    return [tuple(t.clone() for t in s) for s in states]


def _assert_bit_equal(native, ref, what: str):
    for i, (got_state, ref_state) in enumerate(zip(native, ref)):
        for name, got, want in zip(("amax_history", "scale", "scale_inv"), got_state, ref_state):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
                f"{what}: states[{i}].{name} {tuple(got.shape)} differs from the torch reference")


def _run_both(states, **kwargs):
    ref = _clone(states)
    for hist, scale, scale_inv in ref:
        update_delayed_scaling_torch(hist, scale, scale_inv, **kwargs)
    native_scaling.fused_delayed_scaling_update(states, **kwargs)
    torch.cuda.synchronize()
    return states, ref


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("update_scale", [True, False])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])  # E4M3, E5M2
def test_matches_torch_reference_bit_exactly(algo, update_scale, margin, fp8_max):
    shapes = list(itertools.product(HISTORY_LENS, NUM_TENSORS))  # 16 states in one launch
    kwargs = dict(fp8_max=fp8_max, scale_divisor=float(2.0**margin), algo=algo,
                  update_scale=update_scale)
    for seed in range(3):
        native, ref = _run_both(_make_states(shapes, seed=1000 * margin + seed), **kwargs)
        _assert_bit_equal(native, ref, f"{kwargs} seed {seed}")


def test_repeated_steps_keep_matching():
    """Several passes: record a new amax into row 0, update; history and scales stay identical."""
    shapes = [(1024, 3), (5, 2), (1, 1)]
    native = _make_states(shapes, seed=7)
    ref = _clone(native)
    kwargs = dict(fp8_max=448.0, scale_divisor=1.0, algo="max", update_scale=True)
    for step in range(5):
        for (h_native, _, _), (h_ref, _, _) in zip(native, ref):
            row0 = torch.rand(h_native.shape[1], device="cuda") * 10.0 ** (step - 2)
            h_native[0].copy_(row0)
            h_ref[0].copy_(row0)
        for hist, scale, scale_inv in ref:
            update_delayed_scaling_torch(hist, scale, scale_inv, **kwargs)
        native_scaling.fused_delayed_scaling_update(native, **kwargs)
        torch.cuda.synchronize()
        _assert_bit_equal(native, ref, f"step {step}")


def test_many_states_split_into_several_launches():
    """More states than one launch's parameter space holds (96): every one must still be updated."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen)))
              for _ in range(250)]
    for algo in ("max", "most_recent"):
        native, ref = _run_both(_make_states(shapes, seed=11), fp8_max=448.0, scale_divisor=4.0,
                                algo=algo, update_scale=True)
        _assert_bit_equal(native, ref, f"250 states, {algo}")


def test_runs_on_the_current_stream():
    states = _make_states([(16, 3)], seed=5)
    ref = _clone(states)
    update_delayed_scaling_torch(*ref[0], fp8_max=448.0, scale_divisor=1.0, algo="max", update_scale=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        native_scaling.fused_delayed_scaling_update(states, fp8_max=448.0, scale_divisor=1.0, algo="max",
                                                    update_scale=True)
    side.synchronize()
    _assert_bit_equal(states, ref, "side stream")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: (s[0].cpu(), s[1], s[2]), "amax_history is .* on cpu"),
        (lambda s: (s[0].double(), s[1], s[2]), "amax_history is .*float64"),
        (lambda s: (s[0].t(), s[1], s[2]), "non-contiguous"),
        (lambda s: (s[0], s[1][:1], s[2]), r"need \(3,\)"),
        (lambda s: (s[0][0], s[1], s[2]), r"amax_history has shape \(3,\)"),
        (lambda s: (s[0], s[1]), "has 2 items"),
    ],
)
def test_invalid_states_raise_value_error(mutate, match):
    states = [mutate(_make_states([(4, 3)], seed=1)[0])]
    with pytest.raises(ValueError, match=match):
        native_scaling.fused_delayed_scaling_update(states, fp8_max=448.0, scale_divisor=1.0, algo="max",
                                                    update_scale=True)
