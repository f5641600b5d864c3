"""te.GroupedLinear against one fp64 linear layer per expert built from the same weights: the output and every
gradient (input, each expert's weight and bias), in fp32 / bf16 and under each FP8 recipe, where the reference
quantizes as the layer does (tests/module_reference.RefLinear): per-tensor recipes with ONE scale for all the
experts' rows of x and of dy and one per expert for W; block scaling in 1x128 tiles of x and dy (the experts'
rows are whole 128-row tiles) and 128x128 blocks (or 1x128 tiles) of each expert's weight.

Tolerances (relative Frobenius error): fp32 1e-5; bf16 1e-2 (bf16 rounding of the products and outputs); FP8
fp8_gemm_tol on the CPU (1e-5: the same quantized operands, only the fp32 accumulation differs). A reference
with the wrong quantization (one scale per expert's rows) or with two experts swapped misses by far more.
"""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.blockwise import dequantize_blockwise, quantize_blockwise_reference
from te_parallel.ops import grouped_gemm as gg
from te_parallel.ops.cast import quantize_current
from te_parallel.ops.grouped_fp8 import quantize_grouped, quantize_grouped_block
from tests.module_reference import GemmScales, RefLinear
from tests.reference import current_scale_ref, fp8_gemm_tol, rel_err

RECIPES = {
    "delayed-hybrid": R.DelayedScaling(amax_history_len=4),
    "delayed-e4m3": R.DelayedScaling(fp8_format=R.Format.E4M3, margin=1, amax_compute_algo="most_recent"),
    "current-hybrid": R.Float8CurrentScaling(),
    "block": R.Float8BlockScaling(),
    "block-1d-weights": R.Float8BlockScaling(w_block_scaling_dim=1),
    "block-fp32-scales-hybrid": R.Float8BlockScaling(fp8_format=R.Format.HYBRID,
                                                     fp8_quant_fwd_inp=R.QParams(power_2_scale=False),
                                                     fp8_quant_bwd_grad=R.QParams(power_2_scale=False),
                                                     fp8_quant_fwd_weight=R.QParams(power_2_scale=False)),
}
K, N = 160, 144  # in, out: ragged 1x128 tiles along K; N not a multiple of 128 (per-expert block padding)
SPLITS = [5, 0, 1, 26, 12]  # an empty expert and a one-token expert
BLOCK_SPLITS = [128, 0, 256, 128]  # block scaling: whole 128-row tiles per expert


def _block(recipe):
    return recipe is not None and recipe.float8_block_scaling()


def _splits(recipe):
    return BLOCK_SPLITS if _block(recipe) else SPLITS


def _rows_by_expert(counts, cols, device, dtype=torch.float32):
    """Values whose magnitude differs by expert and by row (powers of two): experts' amaxes differ, and a
    row's 1x128 tiles differ from a column's."""
    t = torch.randn(sum(counts), cols, device=device)
    scale = torch.cat([torch.full((c, 1), 2.0 ** (g % 5 - 2)) for g, c in enumerate(counts)]).to(device)
    rows = 2.0 ** torch.randint(-3, 4, (sum(counts), 1), device=device).float()
    return (t * scale * rows).to(dtype)


def _as(m_splits, kind, device):
    return torch.tensor(m_splits, dtype=torch.int64, device=device) if kind == "tensor" else list(m_splits)


def _step(module, x, m_splits, recipe, dy, **fwd):
    x = x.detach().clone().requires_grad_(True)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = module(x, m_splits, **fwd)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return x, out


def _warmup(module, x, m_splits, recipe, dy):
    """A first step (delayed scales from real amaxes), an in-place "optimizer step", grads cleared."""
    if recipe is not None:
        _step(module, x, m_splits, recipe, dy)
        module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(1.01)


def expert_params(m):
    """[(W_g [N, K], b_g [N] or None)] of each expert, as tensors of the module (views for the single layouts)."""
    g, n = m.num_gemms, m.out_features
    ws = [m.weight[i * n:(i + 1) * n] for i in range(g)] if m.single_grouped_weight else \
        [getattr(m, f"weight{i}") for i in range(g)]
    if not m.use_bias:
        return [(w, None) for w in ws]
    bs = [m.bias[i] for i in range(g)] if m.single_grouped_bias else [getattr(m, f"bias{i}") for i in range(g)]
    return list(zip(ws, bs))


def expert_grads(m):
    """[(dW_g, db_g)] as the module's parameters hold them (.grad, or main_grad with fused accumulation)."""
    def grad(p):
        g = getattr(p, "main_grad", None) if m.fuse_wgrad_accumulation else p.grad
        return None if g is None else g.detach().float().cpu()

    g, n = m.num_gemms, m.out_features
    if m.single_grouped_weight:
        dw = grad(m.weight)
        dws = [None if dw is None else dw[i * n:(i + 1) * n] for i in range(g)]
    else:
        dws = [grad(getattr(m, f"weight{i}")) for i in range(g)]
    if not m.use_bias:
        return [(d, None) for d in dws]
    if m.single_grouped_bias:
        db = m.bias.grad.float().cpu()
        return list(zip(dws, db.unbind(0)))
    return list(zip(dws, [getattr(m, f"bias{i}").grad.float().cpu() for i in range(g)]))


def scales_for(m, recipe, x, dy):
    """Each expert's GemmScales: what the layer quantizes with in the step about to run."""
    g = m.num_gemms
    if recipe is None:
        return [None] * g
    fmt = recipe.fp8_format
    if _block(recipe):
        return [GemmScales(fmt, block=recipe)] * g
    if recipe.delayed():
        st = m.fp8_state
        return [GemmScales(fmt, st.fwd_scale[0].clone(), st.fwd_scale[2 * i + 1].clone(), st.bwd_scale[0].clone())
                for i in range(g)]
    # current scaling: one scale from the amax of all the experts' rows of x (of dy); each weight its own
    sx, sdy = current_scale_ref(x.cpu(), fmt.fwd_dtype), current_scale_ref(dy.cpu(), fmt.bwd_dtype)
    return [GemmScales(fmt, sx, None, sdy) for _ in range(g)]


def reference(params, x, dy, counts, scales):
    """fp64 per-expert linear layers: (out, dx, [(dW_g, db_g)]) (zeros for an expert without rows)."""
    xr = x.detach().double().cpu().requires_grad_(True)
    refs = [(w.detach().double().cpu().requires_grad_(True),
             None if b is None else b.detach().double().cpu().requires_grad_(True)) for w, b in params]
    outs, start = [], 0
    for (w, b), c, s in zip(refs, counts, scales):
        if c:
            outs.append(RefLinear.apply(xr[start:start + c], w, b, s))
        start += c
    out = torch.cat(outs)
    out.backward(dy.double().cpu())
    grads = [(torch.zeros_like(w) if w.grad is None else w.grad,
              None if b is None else (torch.zeros_like(b) if b.grad is None else b.grad)) for w, b in refs]
    return out, xr.grad, grads


def assert_matches(m, x, out, ref, tol, grads=None):
    r_out, r_dx, r_grads = ref
    assert rel_err(out.detach().cpu(), r_out) < tol, f"output: {rel_err(out.detach().cpu(), r_out):.2e}"
    assert rel_err(x.grad.cpu(), r_dx) < tol, f"input grad: {rel_err(x.grad.cpu(), r_dx):.2e}"
    for g, ((dw, db), (rw, rb)) in enumerate(zip(expert_grads(m) if grads is None else grads, r_grads)):
        assert dw is not None, f"expert {g}: no weight gradient"
        err = (dw.double() - rw).norm() / rw.norm().clamp_min(1.0) if not rw.any() else rel_err(dw, rw)
        assert err < tol, f"expert {g} weight grad: {float(err):.2e}"
        if rb is not None:
            err = (db.double() - rb).abs().max() if not rb.any() else rel_err(db, rb)
            assert err < tol, f"expert {g} bias grad: {float(err):.2e}"


# --- high precision -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("splits_as", ["list", "tensor"])
@pytest.mark.parametrize("single", [False, True])
def test_high_precision(dtype, tol, bias, splits_as, single, device):
    counts = SPLITS
    m = te.GroupedLinear(len(counts), K, N, bias=bias, params_dtype=dtype, device=device,
                         single_grouped_weight=single, single_grouped_bias=single)
    with torch.no_grad():
        for _, b in expert_params(m):
            if b is not None:
                b.normal_()
    x, dy = _rows_by_expert(counts, K, device, dtype), torch.randn(sum(counts), N, device=device, dtype=dtype)
    xi, out = _step(m, x, _as(counts, splits_as, device), None, dy)
    assert out.dtype == dtype and out.shape == (sum(counts), N)
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, [None] * len(counts)), tol)


def test_misaligned_features_bf16(device):
    """Features that are not 16 bytes (bf16: 8 elements) are padded for torch._grouped_mm and cut back."""
    counts = [3, 4, 0, 9]
    m = te.GroupedLinear(4, 20, 12, params_dtype=torch.bfloat16, device=device)
    x, dy = torch.randn(16, 20, device=device, dtype=torch.bfloat16), torch.randn(16, 12, device=device,
                                                                                  dtype=torch.bfloat16)
    xi, out = _step(m, x, counts, None, dy)
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, [None] * 4), 1e-2)


def test_input_shapes_and_no_rows(device):
    """A 3-D input keeps its leading dims; an input without rows gives an empty output and zero gradients."""
    m = te.GroupedLinear(3, 32, 16, device=device)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    assert m(x, [4, 6, 0]).shape == (2, 5, 16)
    for recipe in (None, RECIPES["current-hybrid"], RECIPES["block"]):
        m.zero_grad(set_to_none=True)
        x0 = torch.randn(0, 32, device=device, requires_grad=True)
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = m(x0, torch.zeros(3, dtype=torch.int64, device=device))
        y.sum().backward()
        assert y.shape == (0, 16) and x0.grad.shape == (0, 32)
        assert not m.weight0.grad.any() and not m.bias2.grad.any()


# --- FP8 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("splits_as, single", [("list", False), ("tensor", True)])
def test_fp8(recipe_name, splits_as, single, device):
    recipe = RECIPES[recipe_name]
    counts = _splits(recipe)
    m = te.GroupedLinear(len(counts), K, N, device=device, single_grouped_weight=single, single_grouped_bias=single)
    with torch.no_grad():  # experts of different magnitudes: their weight scales differ
        for g, (w, b) in enumerate(expert_params(m)):
            w.mul_(2.0 ** (g - 1))
            b.normal_()
    x = _rows_by_expert(counts, K, device)
    dy = _rows_by_expert(counts, N, device)
    splits = _as(counts, splits_as, device)
    _warmup(m, x, splits, recipe, dy)
    scales = scales_for(m, recipe, x, dy)
    xi, out = _step(m, x, splits, recipe, dy)
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, scales), fp8_gemm_tol(device))


@pytest.mark.parametrize("recipe_name", ["current-hybrid", "delayed-hybrid", "block"])
def test_fp8_wrong_reference_fails(recipe_name, device):
    """The comparison sees the quantization: one scale per expert's rows of x and dy (what TE does) instead of one
    for the grouped operand, or two experts' weights swapped, miss the tolerance by orders of magnitude."""
    recipe = RECIPES[recipe_name]
    counts = _splits(recipe)
    m = te.GroupedLinear(len(counts), K, N, device=device)
    x, dy = _rows_by_expert(counts, K, device), _rows_by_expert(counts, N, device)
    _warmup(m, x, counts, recipe, dy)
    scales = scales_for(m, recipe, x, dy)
    xi, out = _step(m, x, counts, recipe, dy)
    tol = fp8_gemm_tol(device)
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, scales), tol)
    params = expert_params(m)
    swapped = [params[2], params[1], params[0], *params[3:]]
    with pytest.raises(AssertionError):
        assert_matches(m, xi, out, reference(swapped, x, dy, counts, scales), tol)
    if recipe.float8_per_tensor_scaling():
        fmt, starts = recipe.fp8_format, [sum(counts[:g]) for g in range(len(counts))]
        per_expert = [GemmScales(fmt, current_scale_ref(x[s:s + c].cpu(), fmt.fwd_dtype), sc.w,
                                 current_scale_ref(dy[s:s + c].cpu(), fmt.bwd_dtype)) if c else sc
                      for s, c, sc in zip(starts, counts, scales)]
        with pytest.raises(AssertionError):
            assert_matches(m, xi, out, reference(params, x, dy, counts, per_expert), tol)


def test_fp8_weight_scales_per_expert(device):
    """Per-tensor recipes give each expert's weight its own scale: delayed scaling records each expert's amax in
    its own weight slot, current scaling takes it from each expert's weight."""
    m = te.GroupedLinear(3, 32, 16, bias=False, device=device)
    with torch.no_grad():
        for g in range(3):
            getattr(m, f"weight{g}").mul_(10.0 ** g)
    x = torch.randn(12, 32, device=device)
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling(amax_history_len=2)):
        m(x, [4, 4, 4])
    hist = m.fp8_state.fwd_amax_history
    for g in range(3):
        assert hist[1, 2 * g + 1] == getattr(m, f"weight{g}").abs().max(), f"expert {g}'s weight amax"
    assert hist[1, 0] == x.abs().max() and not hist[1, 2:][::2].any()  # one slot for the grouped input
    assert torch.equal(m.fp8_state.fwd_scale[1::2], 448.0 / hist[1, 1::2])


def test_grouped_weight_cast_in_chunks(device, monkeypatch):
    """The per-expert weight cast bounds its fp32 temporary by casting row chunks: the same bytes."""
    from te_parallel.ops import grouped_fp8

    w, scale = torch.randn(3, 40, 32, device=device), torch.tensor([1.0, 30.0, 0.5], device=device)
    whole = quantize_grouped(w, scale, torch.float8_e4m3fn)
    monkeypatch.setattr(grouped_fp8, "_CAST_CHUNK", 7 * 32)
    chunked = quantize_grouped(w, scale, torch.float8_e4m3fn)
    assert torch.equal(whole.data.view(torch.uint8), chunked.data.view(torch.uint8))
    ref = torch.stack([(w[g].double() * scale[g].double()).float().clamp(-448, 448).to(torch.float8_e4m3fn).view(
        torch.uint8) for g in range(3)])
    assert torch.equal(whole.data.view(torch.uint8), ref)


def test_calibration_records_without_fp8(device):
    m = te.GroupedLinear(2, 32, 16, device=device)
    x = torch.randn(6, 32, device=device, requires_grad=True)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=R.DelayedScaling()):
        y = m(x, [2, 4])
    y.sum().backward()
    assert rel_err(y.detach(), torch.cat([x[:2] @ m.weight0.t() + m.bias0, x[2:] @ m.weight1.t() + m.bias1])) < 1e-6
    hist = m.fp8_state.fwd_amax_history
    assert hist[1, 0] == x.abs().max() and hist[1, 3] == m.weight1.abs().max()


@pytest.mark.parametrize("recipe_name", ["current-hybrid", "block"])
def test_save_original_input(recipe_name, device):
    """x kept in high precision and cast again for wgrad: the same gradients as the cast kept from forward."""
    recipe = RECIPES[recipe_name]
    counts = _splits(recipe)
    x, dy = _rows_by_expert(counts, K, device), _rows_by_expert(counts, N, device)
    mods = [te.GroupedLinear(len(counts), K, N, device=device, save_original_input=s) for s in (False, True)]
    mods[1].load_state_dict(mods[0].state_dict())
    runs = [_step(m, x, counts, recipe, dy) for m in mods]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][0].grad, runs[1][0].grad)
    for (a, _), (b, _) in zip(expert_grads(mods[0]), expert_grads(mods[1])):
        assert torch.equal(a, b)


def test_weight_cache_is_first_microbatch(device):
    """is_first_microbatch=False reuses the FP8 weights cast by the first micro-batch (TE's contract)."""
    m = te.GroupedLinear(2, 32, 16, device=device)
    x, recipe = torch.randn(8, 32, device=device), R.Float8CurrentScaling()
    with te.fp8_autocast(fp8_recipe=recipe):
        first = m(x, [3, 5], is_first_microbatch=True)
        m.weight1.data.mul_(3.0)  # (a write the cache does not see)
        reused = m(x, [3, 5], is_first_microbatch=False)
        recast = m(x, [3, 5], is_first_microbatch=True)
    assert torch.equal(first, reused) and not torch.equal(first[3:], recast[3:])


# --- the GEMMs: one grouped call per pass -----------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", [None, "current-hybrid"])
def test_one_grouped_gemm_per_pass(recipe_name, device, monkeypatch):
    """fprop, dgrad and wgrad are one torch._grouped_mm call each whatever the number of experts."""
    if device != "cpu":
        pytest.skip("counts the CPU's torch._grouped_mm calls")
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = te.GroupedLinear(8, 32, 16, device=device)
    x = torch.randn(40, 32, device=device, requires_grad=True)
    recipe = RECIPES.get(recipe_name)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = m(x, torch.tensor([5] * 8))
    y.sum().backward()
    assert len(calls) == 3


def test_grouped_gemm_functions(device):
    """The functional layer against its fp64 reference: each role, high precision and per-tensor FP8."""
    counts = [7, 0, 1, 24]
    g, m_, n, k = len(counts), sum(counts), 48, 32
    splits = gg.make_splits(counts, g, m_, torch.device(device))
    x, dy, w = torch.randn(m_, k, device=device), torch.randn(m_, n, device=device), torch.randn(g, n, k, device=device)
    tests = {"fprop": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}
    for role, (a, b) in tests.items():
        got = gg.grouped_mm(a, b, splits, role)
        assert rel_err(got.cpu(), gg.grouped_mm_reference(a.cpu(), b.cpu(), counts, role)) < 1e-6, role
    xq, dyq = quantize_current(x, torch.float8_e4m3fn, transpose=True), quantize_current(dy, torch.float8_e5m2,
                                                                                         transpose=True)
    wq = quantize_grouped(w, torch.rand(g, device=device) * 10 + 1, torch.float8_e4m3fn)
    xd, dyd, wd = xq.dequantize(), dyq.dequantize(), wq.dequantize()
    results = {"fprop": (gg.grouped_fprop(xq, wq, splits, torch.float32), (xd, wd)),
               "dgrad": (gg.grouped_dgrad(dyq, wq, splits, torch.float32), (dyd, wd)),
               "wgrad": (gg.grouped_wgrad(dyq, xq, splits, torch.float32), (dyd, xd))}
    for role, (got, (a, b)) in results.items():
        want = gg.grouped_mm_reference(a.cpu(), b.cpu(), counts, role)
        assert rel_err(got.cpu(), want.cpu()) < 1e-6, role


def test_fp8_routes(monkeypatch):
    """Which per-tensor FP8 GEMM goes where on CUDA (the GPU's answers stubbed): torch._scaled_grouped_mm for E4M3
    pairs (wgrad: groups of 16-row multiples known on the host); the Triton grouped kernel for E5M2 operands and
    device-sized wgrad groups; an error naming both where neither runs. Nothing is widened to bf16."""
    from te_parallel.ops import grouped_block_gemm

    cuda, e4, e5 = torch.device("cuda", 0), torch.float8_e4m3fn, torch.float8_e5m2
    host16 = gg.GroupSplits(torch.zeros(2), torch.zeros(2), 48, (16, 32))
    host_odd = gg.GroupSplits(torch.zeros(2), torch.zeros(2), 48, (15, 33))
    device_only = gg.GroupSplits(torch.zeros(2), torch.zeros(2), 48)
    monkeypatch.setattr(gg, "scaled_grouped_mm_available", lambda dev: (True, ""))
    monkeypatch.setattr(grouped_block_gemm, "usable_on", lambda dev: True)
    S, T = gg.FP8Route.SCALED, gg.FP8Route.TRITON
    want = [((e4, e4, host16, "m"), S), ((e4, e4, device_only, "m"), S), ((e4, e4, host16, "k"), S),
            ((e4, e4, host_odd, "k"), T), ((e4, e4, device_only, "k"), T), ((e5, e4, host16, "m"), T),
            ((e5, e4, host16, "k"), T), ((e4, e5, device_only, "m"), T)]
    for (a, b, splits, kind), route in want:
        assert gg.fp8_route(a, b, cuda, splits, kind) is route, (a, b, splits.counts, kind)
    assert gg.fp8_route(e5, e4, torch.device("cpu"), host16, "m") is gg.FP8Route.DEQUANTIZED
    assert not hasattr(gg.FP8Route, "WIDENED")
    monkeypatch.setattr(gg, "scaled_grouped_mm_available", lambda dev: (False, "this GPU has 8.9"))
    monkeypatch.setattr(grouped_block_gemm, "usable_on", lambda dev: False)
    with pytest.raises(RuntimeError, match="this GPU has 8.9.*Triton grouped kernel") as err:
        gg.fp8_route(e4, e4, cuda, host16, "m")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(grouped_block_gemm, "usable_on", lambda dev: True)
    assert gg.fp8_route(e4, e4, cuda, host16, "m") is T  # (a GPU torch's kernel does not run on)


def test_grouped_block_mm_cpu(device):
    """grouped_block_mm's CPU route (fp32 dequantized product) against per-group fp64 products."""
    if device != "cpu":
        pytest.skip("the CPU route")
    counts = [128, 0, 256]
    g, m_, n, k = 3, 384, 144, 160
    splits = gg.make_splits(counts, g, m_, torch.device("cpu"))
    x, dy = _rows_by_expert(counts, k, "cpu"), _rows_by_expert(counts, n, "cpu")
    e4m3 = torch.float8_e4m3fn
    xq = quantize_blockwise_reference(x, e4m3, 1, columnwise=True)
    dyq = quantize_blockwise_reference(dy, e4m3, 1, columnwise=True)
    w = torch.randn(g, n, k)
    for dim in (1, 2):
        wq = quantize_grouped_block(w, e4m3, dim)
        wd = wq.dequantize().double()
        xd = dequantize_blockwise(xq.data, xq.rowwise_scales(), 1).double()
        got = gg.grouped_fprop(xq, wq, splits, torch.float32)
        assert rel_err(got, gg.grouped_mm_reference(xd, wd, counts, "fprop")) < 1e-6
        dyd = dequantize_blockwise(dyq.data, dyq.rowwise_scales(), 1).double()
        got = gg.grouped_dgrad(dyq, wq, splits, torch.float32)
        wcols = wd if dim == 2 else torch.stack([dequantize_blockwise(wq.data_t[i], wq.scale_inv_t[i].t(), 1).t()
                                                 for i in range(g)]).double()
        assert rel_err(got, gg.grouped_mm_reference(dyd, wcols, counts, "dgrad")) < 1e-6
    x_cols = dequantize_blockwise(xq.data_t, xq.scale_inv_t.t(), 1).t().double()
    dy_cols = dequantize_blockwise(dyq.data_t, dyq.scale_inv_t.t(), 1).t().double()
    got = gg.grouped_wgrad(dyq, xq, splits, torch.float32)
    assert rel_err(got, gg.grouped_mm_reference(dy_cols, x_cols, counts, "wgrad")) < 1e-6


# --- parameters, gradients, checkpoints --------------------------------------------------------------------
@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("recipe_name", [None, "current-hybrid"])
def test_fuse_wgrad_accumulation(single, recipe_name, device):
    recipe = RECIPES.get(recipe_name)
    counts = SPLITS
    m = te.GroupedLinear(len(counts), K, N, device=device, fuse_wgrad_accumulation=True, single_grouped_weight=single)
    weights = [m.weight] if single else [getattr(m, f"weight{g}") for g in range(len(counts))]
    start = [torch.rand_like(w, dtype=torch.float32) for w in weights]
    for w, s in zip(weights, start):
        w.main_grad = s.clone()
    x, dy = _rows_by_expert(counts, K, device), _rows_by_expert(counts, N, device)
    scales = scales_for(m, recipe, x, dy)
    xi, out = _step(m, x, counts, recipe, dy)
    assert all(w.grad is None for w in weights)
    for w, s in zip(weights, start):
        w.main_grad -= s
    assert_matches(m, xi, out, reference(expert_params(m), x, dy, counts, scales),
                   1e-5 if recipe is None else fp8_gemm_tol(device))


def test_fuse_wgrad_needs_main_grad(device):
    m = te.GroupedLinear(2, 32, 16, device=device, fuse_wgrad_accumulation=True)
    y = m(torch.randn(4, 32, device=device, requires_grad=True), [1, 3])
    with pytest.raises(RuntimeError, match="main_grad") as e:
        y.sum().backward()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("recipe_name", [None, "block"])
def test_delay_wgrad_compute(fuse, recipe_name, device):
    """backward runs dgrad (and the bias gradients); backward_dw() runs wgrad, once per held backward."""
    recipe = RECIPES.get(recipe_name)
    counts = _splits(recipe)
    m = te.GroupedLinear(len(counts), K, N, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
    assert m.need_backward_dw()
    weights = [getattr(m, f"weight{g}") for g in range(len(counts))]
    if fuse:
        for w in weights:
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x, dy = _rows_by_expert(counts, K, device), _rows_by_expert(counts, N, device)
    scales = scales_for(m, recipe, x, dy)
    xi, out = _step(m, x, counts, recipe, dy)
    assert all(w.grad is None for w in weights)
    assert not fuse or not any(w.main_grad.any() for w in weights)
    assert m.bias0.grad is not None
    ref = reference(expert_params(m), x, dy, counts, scales)
    m.backward_dw()
    tol = 1e-5 if recipe is None else fp8_gemm_tol(device)
    assert_matches(m, xi, out, ref, tol)
    m.backward_dw()  # nothing held: no change
    assert_matches(m, xi, out, ref, tol)


def test_state_dict_names_and_layouts(device):
    """TE's names (weight0.., bias0..; weight [G·out, in] and bias [G, out] in the single layouts), and a
    checkpoint of either layout (TE's stacked [G, out, in] too) loads into either."""
    per = te.GroupedLinear(3, 32, 16, device=device)
    single = te.GroupedLinear(3, 32, 16, device=device, single_grouped_weight=True, single_grouped_bias=True)
    params = lambda m: [n for n, _ in m.named_parameters()]  # noqa: E731
    assert params(per) == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert params(single) == ["weight", "bias"] and single.weight.shape == (48, 32) and single.bias.shape == (3, 16)
    assert [k for k in per.state_dict() if not k.startswith("fp8_state")] == params(per)
    torch.manual_seed(5)
    a = te.GroupedLinear(3, 32, 16, device=device)
    torch.manual_seed(5)
    b = te.GroupedLinear(3, 32, 16, device=device, single_grouped_weight=True, single_grouped_bias=True)
    assert torch.equal(torch.cat([a.weight0, a.weight1, a.weight2]), b.weight)  # the same init in either layout
    with torch.no_grad():
        for p in per.parameters():
            p.normal_()
    single.load_state_dict(per.state_dict())
    assert torch.equal(single.weight[16:32], per.weight1) and torch.equal(single.bias[2], per.bias2)
    back = te.GroupedLinear(3, 32, 16, device=device)
    back.load_state_dict(single.state_dict())
    assert torch.equal(back.weight2, per.weight2) and torch.equal(back.bias1, per.bias1)
    te_stacked = {k: v for k, v in single.state_dict().items()}
    te_stacked["weight"] = te_stacked["weight"].view(3, 16, 32)
    single2 = te.GroupedLinear(3, 32, 16, device=device, single_grouped_weight=True, single_grouped_bias=True)
    single2.load_state_dict(te_stacked)
    assert torch.equal(single2.weight, single.weight)
    x = torch.randn(9, 32, device=device)
    assert torch.equal(per(x, [2, 3, 4]), single(x, [2, 3, 4]))


def test_return_bias(device):
    m = te.GroupedLinear(2, 32, 16, device=device, return_bias=True)
    with torch.no_grad():
        m.bias1.normal_()
    x = torch.randn(5, 32, device=device)
    out, biases = m(x, [2, 3])
    assert isinstance(biases, list) and torch.equal(biases[1], m.bias1)
    assert rel_err(out, torch.cat([x[:2] @ m.weight0.t(), x[2:] @ m.weight1.t()])) < 1e-6
    s = te.GroupedLinear(2, 32, 16, device=device, return_bias=True, single_grouped_weight=True,
                         single_grouped_bias=True)
    assert s(x, [2, 3])[1] is s.bias


def test_tensor_parallel_shapes(device):
    """Column mode splits out_features, row mode in_features, each expert alike (the TP math: tests/distributed)."""
    col = te.GroupedLinear(2, 64, 32, parallel_mode="column", tp_size=2, device=device)
    row = te.GroupedLinear(2, 64, 32, parallel_mode="row", tp_size=2, device=device)
    assert col.weight1.shape == (16, 64) and col.bias1.shape == (16,)
    assert row.weight1.shape == (32, 32) and row.bias1.shape == (32,)
    assert te.GroupedLinear(2, 64, 32, tp_size=2, sequence_parallel=True, device=device).sequence_parallel


# --- errors -----------------------------------------------------------------------------------------------------
def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("m_splits, words", [
    ([3, 3], ("m_splits", "2 entries", "num_gemms=3")),
    ([3, 3, 3], ("adds up to 9", "8 rows")),
    ([3, -1, 6], ("negative",)),
    ("tensor-length", ("shape (2,)", "[3]")),
    ("tensor-float", ("integers", "float32")),
    ("tensor-sum", ("adds up to 9", "8 rows")),
    ([2.0, 3, 3], ("list of ints",)),
])
def test_bad_m_splits(m_splits, words, device):
    m = te.GroupedLinear(3, 32, 16, device=device)
    if m_splits == "tensor-length":
        m_splits = torch.tensor([4, 4])
    elif m_splits == "tensor-float":
        m_splits = torch.tensor([2.0, 3.0, 3.0])
    elif m_splits == "tensor-sum":
        m_splits = torch.tensor([3, 3, 3])
    with pytest.raises((ValueError, TypeError)) as e:
        m(torch.randn(8, 32, device=device), m_splits)
    _one_line(e, *words)


def test_block_scaling_needs_whole_tiles_per_expert(device):
    m = te.GroupedLinear(2, 128, 128, device=device)
    x = torch.randn(200, 128, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
        with pytest.raises(ValueError) as e:
            m(x, [72, 128])
        _one_line(e, "multiple of 128", "[72, 128]")
        with torch.no_grad():  # the forward alone needs no alignment (1x128 tiles along K are per row)
            y = m(x, [72, 128])
    want = torch.cat([x[:72] @ m.weight0.t(), x[72:] @ m.weight1.t()]) + torch.cat(
        [m.bias0.expand(72, -1), m.bias1.expand(128, -1)])
    assert rel_err(y, want) < 0.1


@pytest.mark.parametrize("make, words", [
    (lambda d: te.GroupedLinear(2, 32, 16, ub_overlap_ag=True, device=d), ("ub_overlap_ag=True",)),
    (lambda d: te.GroupedLinear(2, 32, 16, params_dtype=torch.float64, device=d), ("float64",)),
    (lambda d: te.GroupedLinear(2, 32, 16, tp_size=2, tp_collectives=False, device=d), ("bias=True", "tp_size=2")),
    (lambda d: te.GroupedLinear(0, 32, 16, device=d), ("num_gemms",)),
    (lambda d: te.GroupedLinear(2, 32, 16, parallel_mode="rows", device=d), ("parallel_mode",)),
])
def test_constructor_errors(make, words, device):
    with pytest.raises((ValueError, TypeError)) as e:
        make(device)
    _one_line(e, *words)


@pytest.mark.parametrize("kw, recipe, words", [
    (dict(in_features=40), R.Float8CurrentScaling(), ("multiples of 16", "40")),
    (dict(save_original_input=True), R.DelayedScaling(), ("save_original_input", "DelayedScaling")),
    (dict(), R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1), ("1x128", "x_block_scaling_dim=2")),
])
def test_fp8_errors(kw, recipe, words, device):
    args = dict(num_gemms=2, in_features=32, out_features=16, device=device)
    args.update(kw)
    m = te.GroupedLinear(**args)
    with te.fp8_autocast(fp8_recipe=recipe):
        with pytest.raises((ValueError, TypeError)) as e:
            m(torch.randn(4, args["in_features"], device=device), [1, 3])
    _one_line(e, *words)


# --- TE's stand-in (compat) ---------------------------------------------------------------------------------
def test_compat_grouped_linear(device):
    """transformer_engine.pytorch.GroupedLinear: TE's contract (no TP collectives, weight{i} tensor-parallel
    attributes), backward_dw, and is_module_grouped_tensor_path_supported."""
    tep = pytest.importorskip("transformer_engine.pytorch")
    if "teparallel" not in getattr(pytest.importorskip("transformer_engine"), "__version__", ""):
        pytest.skip("transformer_engine is NVIDIA's TE, not te_parallel's stand-in")
    from transformer_engine.common import recipe as te_recipe
    from transformer_engine.pytorch.module import is_module_grouped_tensor_path_supported

    m = tep.GroupedLinear(2, 32, 16, bias=False, parallel_mode="row", device=device, delay_wgrad_compute=True)
    assert not m.tp_collectives and m.weight1.partition_dim == 1 and m.delay_wgrad_compute
    x = torch.randn(4, 32, device=device, requires_grad=True)
    with tep.fp8_autocast(fp8_recipe=te_recipe.Float8CurrentScaling()):
        y = m(x, [1, 3])
    y.sum().backward()
    assert m.weight0.grad is None
    m.backward_dw()
    assert m.weight0.grad is not None and "_extra_state" in m.state_dict()
    assert is_module_grouped_tensor_path_supported(None, torch.bfloat16)
    assert is_module_grouped_tensor_path_supported(te_recipe.Float8BlockScaling(), torch.bfloat16)
    assert not is_module_grouped_tensor_path_supported(te_recipe.MXFP8BlockScaling(), torch.bfloat16)
