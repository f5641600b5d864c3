"""Checkpoints between NVIDIA's Transformer Engine and te_parallel, both ways, with the FP8 state kept
(te.from_te_state_dict / te.to_te_state_dict; strict loads). Runs where the real TE is installed beside
te_parallel on a GPU (benchmarks/: ../shared/tools/te_for_device.sh), and skips elsewhere."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
try:
    import transformer_engine
    import transformer_engine.pytorch as te_peer
    from transformer_engine.common import recipe as te_recipe
except Exception as err:  # not installed, or without its torch extension
    pytest.skip(f"needs NVIDIA Transformer Engine ({type(err).__name__}: {err})", allow_module_level=True)
if getattr(transformer_engine, "IS_TE_PARALLEL_COMPAT", False):
    pytest.skip("transformer_engine is te_parallel's compat package, not NVIDIA's TE", allow_module_level=True)

STEPS = 3
KINDS = {  # module, constructor args (TE's names in both libraries)
    "Linear": (64, 48),
    "LayerNormLinear": (64, 48),
    "LayerNormMLP": (64, 128),
}


def _train(module, lib, rec, x):
    """FP8 steps on 10·x, then x, x: the amax history's maximum (and so the scale) comes from the first
    step, not the last, so a reader that drops the history computes a different scale from x alone."""
    for xi in [x * 10] + [x] * (STEPS - 1):
        with lib.fp8_autocast(enabled=True, fp8_recipe=rec):
            out = module(xi)
        out.float().square().mean().backward()
    return module


def _peer_scales(module) -> torch.Tensor:
    return module.fp8_meta["scaling_fwd"].scale.float().cpu()


def _assert_scales_carried(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Every forward scale te_parallel holds is one of TE's (TE has a third, unused slot per GEMM), and
    they were calibrated by the FP8 steps (not the initial 1)."""
    assert ours.numel() > 0
    assert (ours != 1).all(), ours
    for s in ours.tolist():
        assert torch.isclose(theirs, torch.tensor(s), rtol=1e-6).any(), (s, theirs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_te_checkpoint_loads_into_te_parallel_with_fp8_state(kind):
    torch.manual_seed(0)
    x = torch.randn(32, 64, device="cuda") * 3
    peer = _train(getattr(te_peer, kind)(*KINDS[kind], device="cuda"), te_peer,
                  te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16), x)
    ours = getattr(te, kind)(*KINDS[kind], device="cuda")
    ours.load_state_dict(te.from_te_state_dict(peer.state_dict(), ours), strict=True)
    for name, p in peer.named_parameters():
        assert torch.equal(dict(ours.named_parameters())[name], p), name
    _assert_scales_carried(ours.fp8_state.fwd_scale.float().cpu(), _peer_scales(peer))
    rec = R.DelayedScaling(fp8_format=R.Format.HYBRID, amax_history_len=16)
    with te.fp8_autocast(fp8_recipe=rec):
        got = ours(x)
    with te_peer.fp8_autocast(enabled=True, fp8_recipe=te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID,
                                                                               amax_history_len=16)):
        want = peer(x)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2


@pytest.mark.parametrize("kind", list(KINDS))
def test_te_parallel_checkpoint_loads_into_te_with_fp8_state(kind, monkeypatch):
    """TE (2.20) still writes its delayed-scaling extra state as a pickle but reads one, its own included,
    only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1: te_parallel writes the same layout, so a TE user
    loads it as they load TE's own checkpoints."""
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    torch.manual_seed(0)
    x = torch.randn(32, 64, device="cuda") * 3
    rec = R.DelayedScaling(fp8_format=R.Format.HYBRID, amax_history_len=16)
    ours = _train(getattr(te, kind)(*KINDS[kind], device="cuda"), te, rec, x)
    peer = getattr(te_peer, kind)(*KINDS[kind], device="cuda")
    peer.load_state_dict(te.to_te_state_dict(ours.state_dict(), ours, recipe=rec), strict=True)
    # one FP8 forward of x: with the loaded history its scale update still sees 10·x's amax; without it,
    # only x's (the scales would then differ from ours)
    with te_peer.fp8_autocast(enabled=True, fp8_recipe=te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID,
                                                                               amax_history_len=16)):
        peer(x)
    _assert_scales_carried(ours.fp8_state.fwd_scale.float().cpu(), _peer_scales(peer))
