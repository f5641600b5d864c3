"""Triton grouped block-scaled FP8 GEMM (te_parallel.ops.grouped_block_gemm) on an sm_90 GPU against its torch
reference (fp32), against the fp64 product of the dequantized operands, and against cuBLASLt's block-scaled
GEMM (block_mm) run group by group; plus torch.compile and CUDA-graph capture.

Tolerances, as relative errors ||got - want|| / ||want||:

* against the fp32 reference (the exact FP8 x scale products summed in fp32, TF32 off): the kernel sums each
  128-wide K chunk inside the FP8 tensor cores, which keep fewer mantissa bits than fp32 (DeepSeek-V3
  measured ~14 on Hopper) before the promotion into fp32, and then adds the chunks in another order. The
  house's bound for one block-scaled FP8 GEMM on CUDA is tests.reference.fp8_gemm_tol (5e-4; cuBLASLt
  measured 9e-5). A bf16 output adds one rounding: at most 2^-8 relative per element (8 significant
  bits), so 2^-8 + 5e-4 for bf16.
* against fp64: at most twice the error of cuBLASLt's block-scaled GEMM (the same tensor cores with the same
  promotion every 128) on the same operands and output dtype, plus 1e-6.
"""
import pytest
import torch

import te_parallel as te
from te_parallel.ops import grouped_block_gemm as gbg
from te_parallel.ops.gemm import block_mm
from tests.reference import fp8_gemm_tol, rel_err
from te_parallel.ops.fp8_transpose import transposed_copy
from te_parallel.ops.grouped_gemm import GroupSplits, constant_block_scales, fp8_grouped_mm
from tests.test_grouped_block_gemm import E4M3, E5M2, make_case, per_tensor_case

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if gbg.triton is None:
    pytest.skip("needs triton (import triton failed)", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip(f"needs a GPU of compute capability 9.0 or newer (Hopper) for the kernel's FP8 wgmma, this one has "
                f"{torch.cuda.get_device_capability()}", allow_module_level=True)

TOL = {torch.float32: fp8_gemm_tol("cuda"), torch.bfloat16: 2**-8 + fp8_gemm_tol("cuda")}


@pytest.fixture(autouse=True, scope="module")
def _one_tile_per_kind():
    """One autotuning candidate per kernel kind (each variant compiles once, no timing runs): the every-config
    tests below run each candidate themselves."""
    with gbg.autotune_candidates(gbg._CONFIGS[:1], gbg._K_CONFIGS[:1]):
        yield


@pytest.fixture(autouse=True)
def _fp32_references():
    """The references multiply in true fp32 (and fp64): TF32 off while a test runs."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def random_sizes(groups: int, rows: int, seed: int, multiple: int = 1, empty: int = 2, ones: int = 2):
    """`groups` sizes (multiples of `multiple`): `empty` empty groups, `ones` groups of one multiple, and the
    others sharing about `rows` rows unevenly (as routing does: a few experts take many rows)."""
    gen = torch.Generator().manual_seed(seed)
    rest = groups - empty - ones
    weights = torch.rand(rest, generator=gen) ** 2 + 0.05
    shares = (weights / weights.sum() * rows / multiple).floor().long().clamp_min(1) * multiple
    sizes = torch.cat([torch.zeros(empty, dtype=torch.long), torch.full((ones,), multiple), shares])
    return sizes[torch.randperm(groups, generator=gen)].tolist()


def cublas_per_group(case, out_dtype):
    """Each group through block_mm (cuBLASLt's block-scaled FP8 GEMM), or None where a group edge is not on a
    128-row tile of a kind "k" case (block_mm takes whole tiles only)."""
    ends = case.offs.tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    if case.kind == "m":
        out = torch.zeros(case.a.shape[0], case.b.shape[2], dtype=out_dtype, device="cuda")
        for g, (r0, r1) in enumerate(bounds):
            if r1 > r0:
                out[r0:r1] = block_mm(case.a[r0:r1], case.sa[r0:r1], 1, case.b[g], case.sb[g], case.b_dim, out_dtype)
        return out
    m = case.a.shape[1]
    if any(r % 128 and r != m for r in ends):
        return None
    outs = []
    for r0, r1 in bounds:
        if r1 == r0:
            outs.append(torch.zeros(case.a.shape[0], case.b.shape[1], dtype=out_dtype, device="cuda"))
            continue
        c0, c1 = r0 // 128, -(-r1 // 128)
        b = case.b[r0:r1].t().contiguous().t()  # [rows, K] column-major
        outs.append(block_mm(case.a[:, r0:r1].contiguous(), case.sa[:, c0:c1], 1, b, case.sb[c0:c1], 1, out_dtype))
    return torch.stack(outs)


def check(case, out_dtype, tile=None):
    args = case.args(out_dtype)
    got = gbg.grouped_block_mm_cuda(*args) if tile is None else gbg._launch(
        case.a, case.sa, case.b, case.sb, case.b_dim, case.offs, out_dtype, case.kind, tile)
    want = gbg.grouped_block_mm_reference(*case.args(torch.float32))
    assert got.shape == want.shape and got.dtype == out_dtype and got.is_contiguous()
    assert torch.isfinite(got).all()
    err = rel_err(got, want)
    assert err < TOL[out_dtype], f"{err:.2e} against the fp32 reference"
    exact = gbg.grouped_block_mm_reference(*case.args(torch.float64), compute_dtype=torch.float64)
    err64 = rel_err(got, exact)
    if block_scaling_ok():
        other = cublas_per_group(case, out_dtype)
        if other is not None:
            err_cublas = rel_err(other, exact)
            assert err64 <= 2 * err_cublas + 1e-6, f"kernel {err64:.2e}, cuBLASLt {err_cublas:.2e} against fp64"
    assert err64 < TOL[out_dtype], f"{err64:.2e} against fp64"
    return got


def block_scaling_ok() -> bool:
    return bool(te.is_fp8_block_scaling_available())


# ragged N and K (multiples of 16, not of 128), random uneven groups with empty and one-row groups
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b_dim", [1, 2])
@pytest.mark.parametrize("n,k", [(528, 656), (256, 1024), (80, 144)])
def test_kind_m_matches_references(n, k, b_dim, out_dtype):
    sizes = random_sizes(12, 3000, seed=n + k)
    check(make_case("m", sizes, n, k, b_dim=b_dim, device="cuda", seed=1, extra_rows=7), out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(528, 656), (256, 1024), (80, 144)])
@pytest.mark.parametrize("aligned", [True, False], ids=["groups_of_128", "edges_inside_tiles"])
def test_kind_k_matches_references(n, k, aligned, out_dtype):
    sizes = random_sizes(10, 3000, seed=n * k, multiple=128 if aligned else 1)
    got = check(make_case("k", sizes, n, k, device="cuda", seed=2), out_dtype)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(got[g]) == 0


@pytest.mark.parametrize("kind, tile", [("m", t) for t in gbg._CONFIGS] + [("k", t) for t in gbg._K_CONFIGS],
                         ids=str)
def test_every_autotuning_config(kind, tile):
    """Every candidate config computes the product (autotuning keeps whichever is fastest)."""
    sizes = random_sizes(9, 1500, seed=3, multiple=1 if kind == "m" else 128)
    check(make_case(kind, sizes, 400, 528, b_dim=2, device="cuda", seed=3, extra_rows=5 if kind == "m" else 0),
          torch.bfloat16, tile)


@pytest.mark.parametrize("kind", ["m", "k"])
def test_autotuning_over_every_config(kind):
    """The autotuned launch over the full candidate lists (timing runs, a choice per key) computes the product;
    the case of test_every_autotuning_config, so the kernels it compiled are reused."""
    sizes = random_sizes(9, 1500, seed=3, multiple=1 if kind == "m" else 128)
    case = make_case(kind, sizes, 400, 528, b_dim=2, device="cuda", seed=3, extra_rows=5 if kind == "m" else 0)
    with gbg.autotune_candidates(gbg._CONFIGS, gbg._K_CONFIGS):
        tuner = gbg._grouped_m_tuned if kind == "m" else gbg._grouped_k_tuned
        assert len(tuner.configs) == len(gbg._CONFIGS if kind == "m" else gbg._K_CONFIGS) > 1
        check(case, torch.bfloat16)
        assert len(tuner.cache) == 1  # (timed, and chosen once for this key)


@pytest.mark.parametrize("kind", ["m", "k"])
def test_expert_shapes(kind):
    """A Qwen3-MoE-like fc1 slice (K 2048, N 1536) over 16 experts; kind "m" with an E4M3 x E5M2 pair."""
    sizes = random_sizes(16, 8192, seed=4, multiple=1 if kind == "m" else 128)
    check(make_case(kind, sizes, 1536, 2048, b_dim=2, device="cuda", seed=4, fp8_b=E5M2 if kind == "m" else E4M3),
          torch.bfloat16)


def test_edge_groups():
    """All rows in one group; all groups empty (rows past offs[-1] are zeros); no group at all."""
    for sizes in ([700], [0, 0, 0], []):
        case = make_case("m", sizes, 144, 256, device="cuda", extra_rows=33)
        got = check(case, torch.float32)
        assert torch.count_nonzero(got[sum(sizes):]) == 0
    for sizes in ([640], [0, 0]):
        check(make_case("k", sizes, 144, 256, device="cuda"), torch.float32)


def test_poisoned_outputs_are_overwritten():
    """Every output element is written (empty groups, the tail rows): nothing is left of the allocator's bytes."""
    torch.cuda.empty_cache()
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk
    case = make_case("m", [0, 5, 0, 300], 144, 256, device="cuda", extra_rows=40)
    assert torch.isfinite(gbg.grouped_block_mm_cuda(*case.args(torch.float32))).all()
    case = make_case("k", [0, 256, 0], 144, 256, device="cuda")
    assert torch.isfinite(gbg.grouped_block_mm_cuda(*case.args(torch.float32))).all()


def test_host_offsets_are_checked_and_copied():
    case = make_case("m", [3, 0, 130], 64, 128, device="cuda")
    want = gbg.grouped_block_mm_cuda(*case.args(torch.float32))
    got = gbg.grouped_block_mm_cuda(case.a, case.sa, 1, case.b, case.sb, 2, [3, 3, 133], torch.float32, "m")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="non-decreasing"):
        gbg.grouped_block_mm_cuda(case.a, case.sa, 1, case.b, case.sb, 2, [3, 2, 133], torch.float32, "m")


@pytest.mark.parametrize("kind", ["m", "k"])
def test_compiled_and_graphed_calls_match_eager(kind):
    """torch.compile traces the custom op (one graph, eager's bits); a CUDA graph replays the same launch."""
    case = make_case(kind, [128, 0, 384, 256], 256, 384, device="cuda", seed=5)
    eager = gbg.grouped_block_mm_cuda(*case.args(torch.bfloat16))  # (also autotunes before the capture below)
    compiled = torch.compile(gbg.grouped_block_mm_cuda, fullgraph=True)
    assert torch.equal(compiled(*case.args(torch.bfloat16)), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gbg.grouped_block_mm_cuda(*case.args(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_usable():
    assert gbg.usable(torch.zeros(4, 4, device="cuda").to(E4M3))
    assert not gbg.usable(torch.zeros(4, 4, device="cuda"))


# per-tensor FP8 through the kernel (grouped_gemm's TRITON route): E5M2 x E4M3 (HYBRID's dgrad and wgrad), one
# scale per operand (per expert for W) as stride-0 block scales; kind "k" with group edges inside 128-row tiles
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind, n, k, multiple", [("m", 528, 656, 1), ("k", 528, 656, 1), ("k", 1536, 2048, 128)])
def test_per_tensor_scales(kind, n, k, multiple, out_dtype):
    sizes = random_sizes(12, 3000, seed=n + k, multiple=multiple)
    a, sa, b, sb, offs, want = per_tensor_case(kind, sizes, n, k, seed=6, device="cuda")
    got = gbg.grouped_block_mm_cuda(*constant_block_scales(a, sa, b, sb, kind), offs, out_dtype, kind)
    assert got.dtype == out_dtype and got.shape == want.shape and torch.isfinite(got).all()
    err = rel_err(got.cpu(), want)
    assert err < TOL[out_dtype], f"{err:.2e} against fp64"
    splits = GroupSplits(torch.tensor(sizes, device="cuda"), offs, sum(sizes))  # device-only sizes
    routed = fp8_grouped_mm(a, sa, b, sb, splits, out_dtype, kind)  # E5M2: the TRITON route, the same launch
    assert torch.equal(routed, got)


@pytest.mark.parametrize("shape, view", [((16, 1536, 2048), None), ((3, 150, 70), (slice(None), slice(5, None),
                                                                                  slice(3, 67))), ((77, 200), None)])
def test_transposed_copy(shape, view):
    """The Triton transposed copy gives torch's bytes (ragged tiles, a strided source, 2-D and 3-D)."""
    t = (torch.randn(shape, device="cuda") * 16).to(E4M3)
    t = t if view is None else t[view]
    got = transposed_copy(t)
    want = t.transpose(-2, -1).contiguous()
    assert got.is_contiguous() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("scale_stride", [1, 2])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_experts_weight_cast(dtype, src_dtype, scale_stride):
    """The per-expert weight cast kernel (ops.grouped_cast) gives the torch form's bytes: a strided source, scales
    that push values past fp8_max, infinities (clamped), ragged tiles; the scales contiguous or every other entry
    of a vector (delayed scaling's weight slots 2g+1 of the module's state)."""
    from te_parallel.ops import grouped_cast
    from te_parallel.ops.grouped_fp8 import quantize_grouped, quantize_grouped_reference

    spread = torch.logspace(-3, 3, 8, device="cuda", dtype=torch.float64)[:, None, None]
    w = torch.randn(8, 203, 400, device="cuda", dtype=torch.float64) * spread
    w[1, 3, 7], w[5, 0, 0] = float("inf"), -float("inf")
    w = w.to(src_dtype)[:, 2:, 7:390]
    slots = torch.full((8 * scale_stride,), 1e4, device="cuda")  # (a wrong slot's scale would saturate)
    slots[scale_stride - 1::scale_stride] = torch.logspace(2, -2, 8, device="cuda") * 3.7
    scale = slots[scale_stride - 1::scale_stride]
    assert grouped_cast.usable(w) and scale.stride() == (scale_stride,)
    want = quantize_grouped_reference(w, scale, dtype)
    got = quantize_grouped(w, scale, dtype).data
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
