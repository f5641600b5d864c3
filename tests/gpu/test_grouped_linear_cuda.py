"""GroupedLinear's CUDA routes against the fp64 per-expert reference of tests/test_grouped_linear.py, and that
m_splits on the device costs no host synchronisation.

Routes: bf16 through torch._grouped_mm; per-tensor FP8 through torch._scaled_grouped_mm (E4M3 operands; wgrad
where every expert's rows are a multiple of 16 known on the host), with HYBRID's E5M2 gradients and wgrad over
device-side m_splits through the Triton grouped kernel with constant scales; block scaling through the Triton
grouped kernel (te_parallel.ops.grouped_block_gemm). Tolerance: torch's grouped kernels write bf16 (they take no
fp32 output), so a GEMM's result may carry a bf16 rounding (2^-9 relative) besides the FP8 accumulation: 4e-3
on FP8 paths, 1e-2 on bf16 ones (bf16 inputs and products).
"""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from tests.test_grouped_linear import (_as, _rows_by_expert, _step, _warmup, assert_matches, expert_params, reference,
                                       scales_for)

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

CAP = torch.cuda.get_device_capability()
K, N = 256, 384
COUNTS = [64, 0, 16, 208, 32]  # every expert a multiple of 16 rows (E4M3 wgrad on torch._scaled_grouped_mm)
ODD_COUNTS = [5, 0, 1, 26, 12]  # an empty and a one-token expert
BLOCK_COUNTS = [128, 0, 256, 128]
FP8_TOL, BF16_TOL = 4e-3, 1e-2


@pytest.fixture(autouse=True, scope="module")
def _one_tile_per_kind():
    """The Triton grouped kernel with one autotuning candidate per kind (each variant compiles once, no timing
    runs; tests/gpu/test_grouped_block_gemm_cuda.py runs every candidate)."""
    from te_parallel.ops import grouped_block_gemm as gbg

    with gbg.autotune_candidates(gbg._CONFIGS[:1], gbg._K_CONFIGS[:1]):
        yield


def _needs_scaled_grouped_mm():
    if CAP not in ((9, 0), (10, 0)) or not hasattr(torch, "_scaled_grouped_mm"):
        pytest.skip(f"torch._scaled_grouped_mm runs on compute capability 9.0 / 10.0; this GPU has {CAP}")


def _needs_block_kernel():
    from te_parallel.ops import grouped_block_gemm

    if not grouped_block_gemm.usable(torch.empty(1, dtype=torch.float8_e4m3fn, device="cuda")):
        pytest.skip(f"the Triton grouped block kernel needs triton and compute capability >= 9.0 (this GPU: {CAP})")


def _count(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _check(recipe, counts, splits_as, tol, dtype=torch.float32, bias=True):
    m = te.GroupedLinear(len(counts), K, N, bias=bias, params_dtype=dtype, device="cuda")
    with torch.no_grad():
        for g, (w, b) in enumerate(expert_params(m)):
            w.mul_(2.0 ** (g - 1))
            if b is not None:
                b.normal_()
    x, dy = _rows_by_expert(counts, K, "cuda", dtype), _rows_by_expert(counts, N, "cuda", dtype)
    splits = _as(counts, splits_as, "cuda")
    _warmup(m, x, splits, recipe, dy)
    scales = scales_for(m, recipe, x, dy)
    xi, out = _step(m, x, splits, recipe, dy)
    torch.cuda.synchronize()
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, scales), tol)


@pytest.mark.parametrize("counts", [COUNTS, ODD_COUNTS])
@pytest.mark.parametrize("splits_as", ["list", "tensor"])
def test_bf16_grouped_mm(counts, splits_as, monkeypatch):
    calls = _count(monkeypatch, torch, "_grouped_mm")
    _check(None, counts, splits_as, BF16_TOL, dtype=torch.bfloat16)
    assert len(calls) == 3, f"{len(calls)} torch._grouped_mm calls for one forward and backward"


@pytest.mark.parametrize("recipe_name, splits_as, scaled", [
    ("e4m3", "list", 3),     # fprop, dgrad, wgrad: E4M3, groups of 16-row multiples known on the host
    ("e4m3", "tensor", 2),   # wgrad on the Triton kernel: the group sizes are on the device only
    ("hybrid", "list", 1),   # dgrad and wgrad on the Triton kernel: E5M2 gradients
])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_per_tensor(recipe_name, splits_as, scaled, scaling, monkeypatch):
    _needs_scaled_grouped_mm()
    _needs_block_kernel()
    from te_parallel.ops import grouped_block_gemm

    fmt = R.Format.E4M3 if recipe_name == "e4m3" else R.Format.HYBRID
    recipe = R.DelayedScaling(fp8_format=fmt, amax_history_len=4) if scaling == "delayed" else \
        R.Float8CurrentScaling(fp8_format=fmt)
    calls = _count(monkeypatch, torch, "_scaled_grouped_mm")
    kernel = _count(monkeypatch, grouped_block_gemm, "grouped_block_mm_cuda")
    widened = _count(monkeypatch, torch, "_grouped_mm")
    _check(recipe, COUNTS, splits_as, FP8_TOL)
    assert len(calls) == 2 * scaled, f"{len(calls)} torch._scaled_grouped_mm calls in two steps, want {2 * scaled}"
    assert len(kernel) == 2 * (3 - scaled), f"{len(kernel)} Triton grouped calls in two steps, want {2 * (3 - scaled)}"
    assert not widened, "a per-tensor FP8 GEMM ran through torch._grouped_mm (FP8 widened to bf16)"


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_per_tensor_odd_splits(fmt):
    """Groups that are not multiples of 16 rows: wgrad on the Triton kernel (edges inside its 128-row chunks)."""
    _needs_scaled_grouped_mm()
    _needs_block_kernel()
    _check(R.Float8CurrentScaling(fp8_format=R.Format.E4M3 if fmt == "e4m3" else R.Format.HYBRID), ODD_COUNTS,
           "list", FP8_TOL)


def test_fp8_per_tensor_fused_wgrad_accumulation():
    """fuse_wgrad_accumulation under HYBRID current scaling: wgrad (E5M2 dy) on the Triton kernel, which writes dW in
    fp32 for main_grad's accumulation; every gradient against the fp64 reference of the same quantization."""
    _needs_block_kernel()
    counts = ODD_COUNTS
    m = te.GroupedLinear(len(counts), K, N, device="cuda", fuse_wgrad_accumulation=True)
    weights = [getattr(m, f"weight{g}") for g in range(len(counts))]
    start = [torch.rand_like(w, dtype=torch.float32) for w in weights]
    for w, s0 in zip(weights, start):
        w.main_grad = s0.clone()
    recipe = R.Float8CurrentScaling()
    x, dy = _rows_by_expert(counts, K, "cuda"), _rows_by_expert(counts, N, "cuda")
    scales = scales_for(m, recipe, x, dy)
    xi, out = _step(m, x, counts, recipe, dy)
    torch.cuda.synchronize()
    assert all(w.grad is None for w in weights)
    for w, s0 in zip(weights, start):
        w.main_grad -= s0
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, scales), FP8_TOL)


@pytest.mark.parametrize("w_dim", [2, 1])
@pytest.mark.parametrize("splits_as", ["list", "tensor"])
def test_block_scaling_triton(w_dim, splits_as, monkeypatch):
    _needs_block_kernel()
    from te_parallel.ops import grouped_block_gemm

    calls = _count(monkeypatch, grouped_block_gemm, "grouped_block_mm_cuda")
    _check(R.Float8BlockScaling(w_block_scaling_dim=w_dim), BLOCK_COUNTS, splits_as, FP8_TOL)
    assert len(calls) == 6, f"{len(calls)} grouped_block_mm_cuda calls in two steps"


RECIPES = {"bf16": None, "delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(),
           "block": R.Float8BlockScaling()}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_device_m_splits_do_not_synchronize(recipe_name):
    """With m_splits on the device, a forward and backward (after a first one: autotuning, first-call checks) make
    no host synchronisation (torch.cuda.set_sync_debug_mode("error") raises on one)."""
    recipe = RECIPES[recipe_name]
    if recipe_name == "bf16" and CAP < (9, 0):
        pytest.skip(f"torch._grouped_mm's grouped kernel runs on compute capability >= 9.0; this GPU has {CAP}")
    if recipe_name in ("delayed", "current"):
        _needs_scaled_grouped_mm()
    if recipe_name == "block":
        _needs_block_kernel()
    counts = BLOCK_COUNTS
    m = te.GroupedLinear(len(counts), K, N, params_dtype=torch.bfloat16, device="cuda")
    splits = torch.tensor(counts, device="cuda")
    x = torch.randn(sum(counts), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(counts), N, device="cuda", dtype=torch.bfloat16)

    def step():
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = m(x, splits)
        y.backward(dy)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(m.weight0.grad).all() and not m.weight1.grad.any()


def test_misaligned_input_pointer():
    """An input whose data does not start on 16 bytes (a view at an odd offset) is copied for the grouped GEMM."""
    if CAP < (9, 0):
        pytest.skip(f"torch._grouped_mm's grouped kernel runs on compute capability >= 9.0; this GPU has {CAP}")
    m = te.GroupedLinear(2, 64, 32, params_dtype=torch.bfloat16, device="cuda")
    base = torch.randn(10 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(10, 64)
    y = m(x, [4, 6])
    want = torch.cat([x[:4] @ m.weight0.t() + m.bias0, x[4:] @ m.weight1.t() + m.bias1])
    assert (y.float() - want.float()).norm() / want.float().norm() < BF16_TOL
