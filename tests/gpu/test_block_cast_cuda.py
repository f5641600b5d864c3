"""Triton block-scaled FP8 quantization (te_parallel.ops.block_cast) against quantize_blockwise_reference on
the CPU, bit for bit: FP8 bytes and fp32 scale_inv of every direction, in the reference's layouts.

Inputs hold positive NaNs only: GPU arithmetic returns a canonical (positive) NaN where the CPU keeps the
sign of a negative one, so the FP8 byte of a -NaN differs between the two devices (both are NaN).
"""
import pytest
import torch

from te_parallel.fp8.blockwise import BlockwiseTensor, quantize_blockwise, quantize_blockwise_reference
from te_parallel.ops import block_cast

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if block_cast.triton is None:
    pytest.skip("needs triton (import triton failed)", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip(f"needs compute capability >= 8.9 for FP8, this GPU has {torch.cuda.get_device_capability()}",
                allow_module_level=True)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 128), (128, 128), (256, 384), (200, 300), (1000, 4096), (4096, 1000), (0, 256), (256, 0), (1, 1),
          (129, 1), (3, 4104)]
DIRECTIONS = [(True, False), (False, True), (True, True)]
FIELDS = ("data", "scale_inv", "data_t", "scale_inv_t")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same(got: BlockwiseTensor, want: BlockwiseTensor, rowwise: bool = True, columnwise: bool = True) -> None:
    """got's directions (those asked for; the others None) equal want's bit for bit, contiguous, same shapes."""
    assert got.block_dim == want.block_dim and got.fp8_dtype == want.fp8_dtype and got.shape == want.shape
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if not (rowwise if name in ("data", "scale_inv") else columnwise):
            assert g is None, name
            continue
        assert g.is_cuda and g.is_contiguous(), name
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        diff = (bits(g).cpu() != bits(w)).nonzero()
        assert diff.numel() == 0, (f"{name}: {len(diff)} of {g.numel()} differ, first at {diff[:4].tolist()}: "
                                   f"got {[g[tuple(i)].item() for i in diff[:4]]}, "
                                   f"want {[w[tuple(i)].item() for i in diff[:4]]}")


def poison_allocator() -> None:
    """Leave the caching allocator's free blocks full of 0x7B bytes, so that a byte the kernel does not write
    shows up as a difference."""
    torch.cuda.empty_cache()
    junk = torch.full((64 << 20,), 0x7B, dtype=torch.uint8, device="cuda")
    del junk


def wide_range(shape, dtype, seed: int) -> torch.Tensor:
    """Random values whose rows and columns differ in magnitude by up to about e**8."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, device="cuda", generator=g)
    x = x * torch.exp(2 * torch.randn(m, 1, device="cuda", generator=g))
    x = x * torch.exp(2 * torch.randn(1, k, device="cuda", generator=g))
    return x.clamp(-6e4, 6e4).to(dtype)


def check(x: torch.Tensor, fp8, block_dim: int, pow2: bool, eps: float = 0.0) -> None:
    """Every direction set of block_cast.quantize(x) against the CPU reference of both directions."""
    want = quantize_blockwise_reference(x.cpu(), fp8, block_dim, rowwise=True, columnwise=True, pow2=pow2, eps=eps)
    for rowwise, columnwise in DIRECTIONS:
        poison_allocator()
        got = block_cast.quantize(x, fp8, block_dim, rowwise=rowwise, columnwise=columnwise, pow2=pow2, eps=eps)
        assert_same(got, want, rowwise, columnwise)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}" for m, k in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_matches_reference(shape, dtype, fp8, block_dim):
    x = wide_range(shape, dtype, seed=sum(shape))
    for pow2 in (True, False):
        check(x, fp8, block_dim, pow2)


def special_matrix(dtype: torch.dtype) -> torch.Tensor:
    """[300, 520]: zeros, +inf, NaN, -inf, tiny values (fp32 / bf16 subnormals: fp8_max / amax is +inf in
    fp32), values near the dtype's largest, a lone subnormal in an ordinary tile; ragged at both edges."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(300, 520, device="cuda", generator=g)
    x[0:128, 0:128] = 0.0
    x[3, 130] = float("inf")
    x[9, 300] = float("nan")
    x[140, 200] = float("-inf")
    x[131, 131] = float("nan")
    tiny = 1e-40 if dtype != torch.float16 else 1e-7
    x[128:256, 0:128] = torch.randn(128, 128, device="cuda", generator=g) * tiny
    x[256:300, 0:128] *= 3e38 if dtype != torch.float16 else 6e4
    x[260, 515] = tiny
    x[299, 519] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_special_values(dtype, fp8, block_dim, pow2, eps):
    check(special_matrix(dtype), fp8, block_dim, pow2, eps)


def test_tiny_values_take_the_largest_finite_scale():
    """1e-40 (fp32 subnormal): fp8_max / amax is +inf in fp32, so the scale is fp32's largest finite value and
    scale_inv = 1 / scale is subnormal; the kernel must keep subnormals (no flush to zero) in both."""
    x = torch.full((4, 128), 1e-40, device="cuda")
    for pow2 in (True, False):
        got = block_cast.quantize(x, E4M3, 1, pow2=pow2)
        want = quantize_blockwise_reference(x.cpu(), E4M3, 1, pow2=pow2)
        assert 0 < want.scale_inv[0, 0].item() < 1.2e-38 and (want.data.float() != 0).all()
        assert_same(got, want, True, False)


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("layout", ["transposed", "column_step", "odd_offset", "broadcast"])
def test_non_contiguous_input(block_dim, layout):
    base = wide_range((520, 700), torch.bfloat16, seed=1)
    x = {"transposed": base.t()[:, :300],  # [700, 300], stride (1, 700)
         "column_step": base[:, ::2],  # stride (700, 2)
         "odd_offset": base[1:, 3:],  # a data pointer 6 bytes past the allocation's alignment
         "broadcast": base[7:8].expand(300, 700)}[layout]  # stride (0, 1)
    assert not x.is_contiguous()
    for pow2 in (True, False):
        check(x, E4M3, block_dim, pow2)


def test_door_usable_and_fresh_outputs():
    x = wide_range((256, 384), torch.bfloat16, seed=2)
    assert block_cast.usable(x) and block_cast.usable(x.float()) and block_cast.usable(x.half())
    assert not block_cast.usable(x.cpu()) and not block_cast.usable(x.to(E4M3)) and not block_cast.usable(x.int())
    for block_dim in (1, 2):
        got = quantize_blockwise(x, E4M3, block_dim, rowwise=True, columnwise=True)
        assert_same(got, quantize_blockwise_reference(x.cpu(), E4M3, block_dim, rowwise=True, columnwise=True))
        ptrs = [getattr(got, n).data_ptr() for n in FIELDS] + [x.data_ptr()]
        assert len(set(ptrs)) == len(ptrs)  # four fresh tensors, none a view of another or of x


def test_custom_op_opcheck():
    x = wide_range((200, 300), torch.bfloat16, seed=3)
    for block_dim in (1, 2):
        for rowwise, columnwise in DIRECTIONS:
            torch.library.opcheck(torch.ops.te_parallel.block_quantize.default,
                                  (x, E4M3, block_dim, rowwise, columnwise, True, 0.0))


def test_torch_compile_fullgraph():
    def quantize_both(x):
        q = quantize_blockwise(x, E4M3, 1, rowwise=True, columnwise=True)
        w = quantize_blockwise(x * 2, E5M2, 2, rowwise=False, columnwise=True, pow2=False)
        return q.data, q.scale_inv, q.data_t, q.scale_inv_t, w.data_t, w.scale_inv_t

    compiled = torch.compile(quantize_both, fullgraph=True)
    for shape in ((256, 384), (200, 300)):
        x = wide_range(shape, torch.bfloat16, seed=4)
        got = compiled(x)
        q = quantize_blockwise_reference(x.cpu(), E4M3, 1, rowwise=True, columnwise=True)
        w = quantize_blockwise_reference((x * 2).cpu(), E5M2, 2, rowwise=False, columnwise=True, pow2=False)
        want = (q.data, q.scale_inv, q.data_t, q.scale_inv_t, w.data_t, w.scale_inv_t)
        for g, v in zip(got, want):
            assert g.shape == v.shape and torch.equal(bits(g).cpu(), bits(v))


@pytest.mark.parametrize("block_dim", [1, 2])
def test_cuda_graph_capture(block_dim):
    """Captured once, replayed on new values of the same input buffer: the outputs follow the input."""
    x = wide_range((300, 520), torch.bfloat16, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        block_cast.quantize(x, E4M3, block_dim, rowwise=True, columnwise=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = block_cast.quantize(x, E4M3, block_dim, rowwise=True, columnwise=True)
    for seed in (6, 7):
        x.copy_(wide_range(x.shape, x.dtype, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert_same(got, quantize_blockwise_reference(x.cpu(), E4M3, block_dim, rowwise=True, columnwise=True))


def test_bad_arguments():
    x = torch.randn(4, 4, device="cuda")
    with pytest.raises(ValueError, match="need a 2-D x"):
        block_cast.quantize(x, torch.float16, 1)
    with pytest.raises(ValueError, match="at least one direction"):
        block_cast.quantize(x, E4M3, 1, rowwise=False)
