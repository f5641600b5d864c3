"""Grouped block-scaled FP8 GEMM (te_parallel.ops.grouped_block_gemm) on the CPU: its torch reference against
a plain fp64 per-group product written here independently, its one-line errors, its custom op's fake kernel,
and (where triton is installed) the Triton kernels themselves under Triton's interpreter on tiny shapes.

The operands are built as the MoE layer would: the rows of x (or dy) sorted by expert and cast once in 1x128
tiles (rowwise along K for fprop, columnwise along M for wgrad), each expert's weight in 128x128 blocks or
1x128 tiles, in the layouts of te_parallel.ops.gemm's block_mm operands.
"""
from dataclasses import dataclass
from typing import List

import pytest
import torch

from te_parallel.fp8.blockwise import quantize_blockwise_reference
from te_parallel.ops import fp8_transpose, grouped_cast
from te_parallel.ops import grouped_block_gemm as gbg
from te_parallel.ops.fp8_transpose import transposed_copy
from te_parallel.recipe import fp8_max
from te_parallel.ops.grouped_gemm import GroupSplits, constant_block_scales, fp8_grouped_mm, grouped_mm_reference
from tests.reference import rel_err
from tests import triton_interpreter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass
class Case:
    """The arguments of grouped_block_mm_cuda (and of its reference) for one grouped GEMM."""

    a: torch.Tensor
    sa: torch.Tensor
    b: torch.Tensor
    sb: torch.Tensor
    b_dim: int
    offs: torch.Tensor
    kind: str

    def args(self, out_dtype):
        return (self.a, self.sa, 1, self.b, self.sb, self.b_dim, self.offs, out_dtype, self.kind)


def _values(shape, device, generator):
    """Random values whose rows and columns differ in magnitude (so that the 1x128 scales differ)."""
    x = torch.randn(shape, device=device, generator=generator)
    x = x * torch.exp(torch.randn(shape[0], 1, device=device, generator=generator))
    return x * torch.exp(torch.randn(1, shape[1], device=device, generator=generator))


def make_case(kind: str, sizes: List[int], n: int, k: int, b_dim: int = 2, device="cpu", seed: int = 0,
              fp8_b=E4M3, extra_rows: int = 0) -> Case:
    """Groups of `sizes` rows (sorted by group); kind "m": x [M, k] · W[g] [n, k]ᵀ; kind "k": dy [M, n], x [M, k].
    extra_rows: rows after the last group (kind "m": their output rows must come back zero)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    m = sum(sizes) + extra_rows
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    if kind == "m":
        x = quantize_blockwise_reference(_values((m, k), device, gen), E4M3, 1)
        ws = [quantize_blockwise_reference(_values((n, k), device, gen), fp8_b, b_dim) for _ in sizes]
        if sizes:
            b = torch.stack([w.data for w in ws]).transpose(1, 2)  # [G, k, n], each b[g] column-major
            if b_dim == 2:
                sb = torch.stack([w.scale_inv for w in ws]).transpose(1, 2)  # [G, k/128, n/128]
            else:
                sb = torch.stack([w.scale_inv for w in ws])  # [G, k/128, n]
        else:  # no group at all
            b = torch.empty(0, k, n, dtype=fp8_b, device=device)
            sb = torch.empty(0, -(-k // 128), n if b_dim == 1 else -(-n // 128), device=device)
        return Case(x.data, x.scale_inv.t(), b, sb, b_dim, offs, kind)
    dy = quantize_blockwise_reference(_values((m, n), device, gen), E4M3, 1, rowwise=False, columnwise=True)
    x = quantize_blockwise_reference(_values((m, k), device, gen), fp8_b, 1, rowwise=False, columnwise=True)
    return Case(dy.data_t, dy.scale_inv_t.t(), x.data_t.t(), x.scale_inv_t, 1, offs, kind)


def plain_fp64(case: Case) -> torch.Tensor:
    """Each group's product in fp64, every element times the scale of its own tile (indexed, not expanded)."""
    a, b = case.a.double(), case.b.double()
    ends = case.offs.tolist()
    starts = [0] + ends[:-1]
    if case.kind == "k":
        m = a.shape[1]
        tile = torch.arange(m, device=a.device) // 128
        av = a * case.sa.double()[:, tile]  # sa[n, i // 128]
        bv = b * case.sb.double()[tile, :]  # sb[i // 128, k]
        if not ends:
            return av.new_zeros(0, a.shape[0], b.shape[1])
        return torch.stack([av[:, s:e] @ bv[s:e] for s, e in zip(starts, ends)])
    m, k = a.shape
    kt = torch.arange(k, device=a.device) // 128
    av = a * case.sa.double()[:, kt]
    out = av.new_zeros(m, b.shape[2])
    ncol = torch.arange(b.shape[2], device=a.device)
    ncol = ncol // 128 if case.b_dim == 2 else ncol
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[s:e] = av[s:e] @ (b[g] * case.sb[g].double()[kt][:, ncol])
    return out


def per_tensor_case(kind: str, sizes: List[int], n: int, k: int, fp8_a=E5M2, fp8_b=E4M3, seed: int = 0,
                    device="cpu"):
    """The operands of ops.grouped_gemm.fp8_grouped_mm (one scale_inv per operand, per expert for W) on `device`
    and the fp64 product of their dequantized values (on the CPU). kind "m": a = dy [M, n] (HYBRID's E5M2
    gradient), b [G, n, k] each column-major (W[g] from Wᵀ's bytes), as dgrad; kind "k": a = dyᵀ [n, M]
    row-major, b = x [M, k] column-major, as wgrad."""
    gen = torch.Generator().manual_seed(seed)
    m, g = sum(sizes), len(sizes)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    sa = torch.tensor(2.0 ** -3 * 1.375)
    if kind == "m":
        a = (torch.randn(m, n, generator=gen) * 8).to(fp8_a)
        b = (torch.randn(g, k, n, generator=gen) * 64).to(fp8_b).transpose(1, 2)  # [G, n, k], b[g] column-major
        sb = torch.rand(g, generator=gen) + 0.01
        want = grouped_mm_reference(a.double() * sa.double(), b.double() * sb.double()[:, None, None], sizes,
                                    "dgrad")
        b_dev = b.transpose(1, 2).to(device).transpose(1, 2)
    else:
        a = (torch.randn(m, n, generator=gen) * 8).to(fp8_a).t().contiguous()  # dyᵀ [n, M]
        b = (torch.randn(k, m, generator=gen) * 64).to(fp8_b).t()  # x [M, k] column-major (xᵀ's bytes)
        sb = torch.tensor(0.0371)
        want = grouped_mm_reference(a.t().double() * sa.double(), b.double() * sb.double(), sizes, "wgrad")
        b_dev = b.t().to(device).t()
    return a.to(device), sa.to(device), b_dev, sb.to(device), offs.to(device), want


PER_TENSOR = [("m", [0, 5, 37, 0, 150, 1], 272, 48), ("k", [100, 1, 27, 0, 256, 126], 32, 48),
              ("k", [0, 0], 32, 48)]


@pytest.mark.parametrize("kind, sizes, n, k", PER_TENSOR, ids=str)
def test_per_tensor_scales_as_constant_blocks(kind, sizes, n, k):
    """A per-tensor scale is a block scale that is the same in every tile: the block kernel's operands made by
    constant_block_scales (stride-0 views, no copy) give the per-tensor product exactly (fp64), and the CPU route
    of fp8_grouped_mm agrees in fp32."""
    a, sa, b, sb, offs, want = per_tensor_case(kind, sizes, n, k)
    ops = constant_block_scales(a, sa, b, sb, kind)
    for view, scale in ((ops[1], sa), (ops[4], sb)):  # views of the scales, no copy
        assert view.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
    got = gbg.grouped_block_mm_reference(*ops, offs, torch.float64, kind, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    splits = GroupSplits(torch.tensor(sizes), offs, sum(sizes), tuple(sizes))
    cpu = fp8_grouped_mm(a, sa, b, sb, splits, torch.float32, kind)
    assert rel_err(cpu, want) < 1e-6


def test_transposed_copy_reference_and_errors():
    t = (torch.randn(3, 70, 130) * 16).to(E4M3)
    out = transposed_copy(t[:, 3:, 1:129])  # a strided view
    assert out.is_contiguous() and torch.equal(out.view(torch.uint8), t[:, 3:, 1:129].transpose(1, 2).view(torch.uint8))
    for bad in (torch.zeros(5, dtype=E4M3), torch.zeros(4, 4)):
        with pytest.raises(ValueError, match="1-byte dtype") as err:
            transposed_copy(bad)
        assert "\n" not in str(err.value)


# kind "m": empty groups, one-row groups, groups that are not multiples of 128; kind "k": multiples of 128,
# and groups whose edges fall inside a 128-row tile (the kernel masks those chunks)
M_SIZES = [[0, 1, 37, 0, 200, 129, 64], [300], [1, 1, 1], [0, 0]]
K_SIZES = [[128, 0, 256, 128], [0, 384], [100, 1, 27, 300, 0, 200]]


@pytest.mark.parametrize("sizes", M_SIZES, ids=str)
@pytest.mark.parametrize("b_dim", [1, 2])
def test_reference_kind_m_matches_plain_fp64(sizes, b_dim):
    case = make_case("m", sizes, n=144, k=400, b_dim=b_dim, extra_rows=5)
    want = plain_fp64(case)
    got = gbg.grouped_block_mm_reference(*case.args(torch.float64), compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)  # exact fp8 x scale values, fp64 sums
    got32 = gbg.grouped_block_mm_reference(*case.args(torch.float32))
    assert rel_err(got32, want) < 1e-6  # fp32 sums of the exact fp8 x scale products
    assert torch.count_nonzero(got32[sum(sizes):]) == 0  # rows past offs[-1]


@pytest.mark.parametrize("sizes", K_SIZES, ids=str)
def test_reference_kind_k_matches_plain_fp64(sizes):
    case = make_case("k", sizes, n=176, k=208)
    want = plain_fp64(case)
    got = gbg.grouped_block_mm_reference(*case.args(torch.float64), compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert got.shape == (len(sizes), 176, 208)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(got[g]) == 0


def test_reference_out_dtype_and_offsets_as_a_list():
    case = make_case("m", [3, 0, 130], n=32, k=256, b_dim=1)
    bf16 = gbg.grouped_block_mm_reference(*case.args(torch.bfloat16))
    listed = gbg.grouped_block_mm_reference(case.a, case.sa, 1, case.b, case.sb, 1, [3, 3, 133], torch.bfloat16, "m")
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, listed)


@pytest.mark.parametrize("kind", ["m", "k"])
def test_fake_kernel_shapes(kind):
    """te_parallel::grouped_block_mm's fake kernel (what torch.compile traces with), on meta tensors."""
    case = make_case(kind, [128, 0, 256], n=48, k=160)
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in case.args(torch.bfloat16)]
    out = torch.ops.te_parallel.grouped_block_mm(*meta)
    want = gbg.grouped_block_mm_reference(*case.args(torch.bfloat16))
    assert out.shape == want.shape and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_not_usable_on_cpu():
    assert not gbg.usable(torch.zeros(4, 4).to(E4M3))
    assert not gbg.usable(torch.zeros(4, 4, device="meta", dtype=E4M3))


def test_errors_are_one_line():
    case = make_case("m", [3, 5], n=32, k=128)
    bad = [
        (dict(kind="n"), "kind must be 'm'"),
        (dict(out_dtype=torch.int32), "out_dtype must be"),
        (dict(a=case.a.float()), "must be FP8"),
        (dict(sa=case.sa[:, :0]), "sa is (8, 0), need (8, 1)"),
        (dict(b_dim=3), "b_dim is 3, need 1 or 2"),
        (dict(offs=case.offs.float()), "offs must be a 1-D int32"),
        (dict(offs=[5, 3]), "must be non-decreasing"),
        (dict(offs=[3, 9]), "at most the 8 rows"),
        ({}, "needs CUDA operands on an sm_90+ GPU"),
    ]
    names = ["a", "sa", "a_dim", "b", "sb", "b_dim", "offs", "out_dtype", "kind"]
    for change, message in bad:
        args = dict(zip(names, case.args(torch.float32)))
        args.update(change)
        with pytest.raises(ValueError, match=None) as err:
            gbg.grouped_block_mm_cuda(**args)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# --- the Triton kernels under Triton's interpreter (numpy on the CPU: fp8 products exact, fp32 sums) ---------
INTERPRETED = [  # (kind, group sizes, N, K, b_dim, B's FP8 dtype)
    ("m", [0, 1, 37, 0, 70, 19], 48, 272, 2, E4M3), ("m", [5, 0, 33], 80, 128, 1, E5M2),
    ("m", [0, 0], 32, 160, 2, E4M3), ("k", [128, 0, 256], 48, 80, 1, E4M3),
    ("k", [100, 1, 27, 130, 0, 126], 32, 48, 1, E5M2),
]


def run_interpreted() -> None:
    """Every INTERPRETED case through the kernels with small tiles; raises on a mismatch. Run with
    TRITON_INTERPRET=1 set before triton is imported (the test below starts a fresh interpreter for it)."""
    _index_scalars_of_any_rank()
    tiles = [gbg.Tile(16, 32, group_m=2, num_warps=4), gbg.Tile(32, 16, group_m=1, num_warps=4)]
    for kind, sizes, n, k, b_dim, fp8_b in INTERPRETED:
        case = make_case(kind, sizes, n, k, b_dim=b_dim, fp8_b=fp8_b, extra_rows=3 if kind == "m" else 0)
        want = gbg.grouped_block_mm_reference(*case.args(torch.float32))
        # both tiles in fp32; the first also with a bf16 output
        for tile, out_dtype in [(tiles[0], torch.float32), (tiles[0], torch.bfloat16), (tiles[1], torch.float32)]:
            got = gbg._launch(case.a, case.sa, case.b, case.sb, b_dim, case.offs, out_dtype, kind, tile)
            assert got.shape == want.shape and got.dtype == out_dtype
            if out_dtype == torch.float32:  # the same exact products, fp32 sums in another order
                assert rel_err(got, want) < 1e-6, (kind, sizes, tile)
            else:  # one rounding to bf16, which the interpreter truncates: within one ulp, 2^-7 relative
                bound = want.abs() * 2**-7 + 1e-6 * want.abs().max()
                assert bool(((got.float() - want).abs() <= bound).all()), (kind, sizes, tile)
    for kind, sizes, n, k in PER_TENSOR:  # per-tensor scales as stride-0 block scales (HYBRID: E5M2 x E4M3)
        a, sa, b, sb, offs, want = per_tensor_case(kind, sizes, n, k)
        a, sa_c, _, b, sb_c, b_dim = constant_block_scales(a, sa, b, sb, kind)
        for tile in tiles:
            got = gbg._launch(a, sa_c, b, sb_c, b_dim, offs, torch.float32, kind, tile)
            assert got.shape == want.shape and rel_err(got, want) < 1e-6, (kind, sizes, tile)
    # the transposed copy of FP8 bytes: ragged tiles, a strided source, a batch of 3
    src = (torch.randn(3, 150, 70) * 16).to(E5M2)
    for t in (src, src[:, 5:, 3:67], src[0]):
        out = torch.empty(*t.shape[:-2], t.shape[-1], t.shape[-2], dtype=t.dtype)
        fp8_transpose._launch(t.reshape(-1, *t.shape[-2:]), out.view(-1, t.shape[-1], t.shape[-2]))
        assert torch.equal(out.view(torch.uint8), t.transpose(-2, -1).contiguous().view(torch.uint8))
    # the experts' per-expert weight cast: a strided bf16 source, ragged tiles, values past fp8_max, inf
    w = torch.randn(3, 40, 300, dtype=torch.float64) * torch.tensor([1.0, 300.0, 1e-3]).view(3, 1, 1)
    w[1, 3, 7], w[2, 0, 0] = float("inf"), -float("inf")
    w = w.to(torch.bfloat16)[:, 1:, 5:290]
    scale = torch.tensor([1.5, 2.0 ** 7, 3e3])
    prescaled = w.float() * scale.view(3, 1, 1)  # (the interpreter's fp32 -> fp8 conversion is not the GPU's
    for dtype in (E4M3, E5M2):                    # nearest-even one: the GPU test compares bytes with torch's)
        out, want = torch.empty(w.shape, dtype=dtype), torch.empty(w.shape, dtype=dtype)
        grouped_cast._launch(w, scale, out)
        grouped_cast._launch(prescaled, torch.ones(3), want)  # x 1.0 is exact: the same conversion of the products
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        assert torch.isfinite(out.float()).all() and out.float().abs().max() == fp8_max(dtype)  # inf clamped
    _interpreted_expert_scales()
    print("interpreted cases passed")


def _interpreted_expert_scales() -> None:
    """The weight cast reads each expert's own scale, for every expert, where the scales are a strided view: delayed
    scaling's weight slots 2g+1 of the module's state, through GroupedFP8.quantize_weight as GroupedLinear calls it
    (grouped_cast.usable admits the CPU tensors here). The want: the same kernel on the values multiplied by each
    expert's scale beforehand, with unit scales (exact: the same conversion of the same products)."""
    from te_parallel import recipe as R
    from te_parallel.fp8.state import FP8ScalingState
    from te_parallel.ops import grouped_fp8

    g, n, k = 5, 24, 40
    w = torch.randn(g, n, k) * 0.1
    slots = torch.tensor([3.0, 1.5, 7.0, 40.0, 0.5, 300.0, 11.0, 2.0 ** -3, 13.0, 900.0])  # x, w0, x, w1, ...
    per_expert = slots[1::2].clone()  # the weights' scales: every expert's differs from its neighbours' slots
    prescaled = w * per_expert.view(g, 1, 1)
    want = torch.empty(g, n, k, dtype=E4M3)
    grouped_cast._launch(prescaled, torch.ones(g), want)
    got = torch.empty(g, n, k, dtype=E4M3)
    grouped_cast._launch(w, slots[1::2], got)  # stride 2
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "strided scales"
    state = FP8ScalingState(g)
    state.fwd_scale.copy_(slots)
    grouped_cast.usable = lambda w3: w3.dim() == 3  # (this process only: the kernel runs on the CPU's tensors)
    fp8 = grouped_fp8.GroupedFP8(R.DelayedScaling(fp8_format=R.Format.E4M3), state, g, None, True, None)
    q = fp8.quantize_weight(w.reshape(g * n, k))
    for e in range(g):
        assert torch.equal(q.data[e].view(torch.uint8), want[e].view(torch.uint8)), f"expert {e}'s bytes"
    torch.testing.assert_close(q.scale_inv, 1.0 / per_expert, rtol=0, atol=0)


def _index_scalars_of_any_rank() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int() of its 1-element array, which numpy
    >= 2.3 refuses (a `range` over a runtime bound fails); Triton 3.7 squeezes it first. Do the same here."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


@pytest.mark.skipif(gbg.triton is None, reason="needs triton (import triton failed); CI installs none")
def test_autotune_candidates_narrow_and_restore():
    """autotune_candidates: the tuners' candidates inside the block (choices made afresh), the earlier ones and their
    choices after it (also when the block raises); a one-line error for an empty or non-Tile list."""
    tuners = (gbg._grouped_m_tuned, gbg._grouped_k_tuned)
    before = [(t.configs, t.cache) for t in tuners]
    one, two = gbg._CONFIGS[2], [gbg._K_CONFIGS[-1], gbg._CONFIGS[0]]
    with pytest.raises(KeyError):
        with gbg.autotune_candidates([one], two):
            m_cfg, k_cfg = (t.configs for t in tuners)
            assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in m_cfg] == \
                [(one.block_m, one.block_n, one.num_warps, one.num_stages)]
            assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in k_cfg] == \
                [(t.block_m, t.block_n, t.num_stages) for t in two]
            assert all(t.cache == {} and t.cache is not b[1] for t, b in zip(tuners, before))
            raise KeyError("leaves the block")
    assert all(t.configs is b[0] and t.cache is b[1] for t, b in zip(tuners, before))
    assert len(gbg._grouped_k_tuned.configs) == len(gbg._K_CONFIGS)
    for bad in ([], [(64, 128)]):
        with pytest.raises(ValueError, match="m_tiles must be a non-empty sequence of Tile") as err:
            with gbg.autotune_candidates(bad, two):
                pass
        assert "\n" not in str(err.value)


@pytest.mark.skipif(gbg.triton is None, reason="needs triton (import triton failed); CI installs none")
def test_kernels_under_the_triton_interpreter():
    triton_interpreter.run_interpreted("tests.test_grouped_block_gemm", "run_interpreted")
