"""Native current scaling (amax -> scale, csrc/kernels/current_scale.cu) vs the torch reference, bit for bit.

Bits are compared as int32 patterns: torch.equal on floats calls NaN != NaN and +0 == -0."""
import pytest
import torch

from te_parallel import native
from te_parallel.native import scaling as native_scaling

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

from te_parallel.fp8.scaling import current_scale, current_scale_torch  # noqa: E402
from te_parallel.ops.cast import amax_of, amax_torch, quantize_current  # noqa: E402
from te_parallel.recipe import fp8_max  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# sizes: one element, a ragged tail after the 16-byte vectors, one block's share, many blocks (capped grid)
SIZES = (1, 7, 1000, 16384, 16385, 3 * 2**20 + 5, 2**25 + 3)
SPECIALS = (None, "nan", "inf", "zeros", "denormal", "huge")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().reshape(-1).view(torch.int32)


def _tensor(n: int, dtype, special, gen):
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 4, (1,), generator=gen).item()
    where = int(torch.randint(0, n, (1,), generator=gen))
    if special == "nan":
        x[where] = float("nan")
    elif special == "inf":
        x[where] = -float("inf")
    elif special == "zeros":
        x.zero_()
    elif special == "denormal":
        x = torch.full((n,), 1e-40 if dtype == torch.float32 else 1e-7)
    elif special == "huge":
        x[where] = -3e38 if dtype == torch.float32 else (-6e4 if dtype == torch.float16 else -3e38)
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("special", SPECIALS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_current_scale_of_matches_torch_bit_for_bit(dtype, n, special, fp8):
    gen = torch.Generator().manual_seed(hash((str(dtype), n, special, str(fp8))) % 2**31)
    x = _tensor(n, dtype, special, gen)
    limit = fp8_max(fp8)
    out = native_scaling.current_scale_of(x, limit)
    amax_ref = amax_torch(x)
    scale_ref = current_scale_torch(amax_ref, limit)
    if amax_ref.isnan():  # (NaN payloads differ: torch's max writes its own NaN)
        assert out[2].isnan()
    else:
        assert torch.equal(_bits(out[2]), _bits(amax_ref.abs()))  # (the kernel's amax of all zeros is +0)
    assert torch.equal(_bits(out[0]), _bits(scale_ref))
    assert torch.equal(_bits(out[1]), _bits(1.0 / scale_ref))


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_unaligned_views(offset):
    """A view that does not start on a 16-byte boundary goes through the scalar loop, same result."""
    base = torch.randn(70001, device="cuda", dtype=torch.bfloat16)
    x = base[offset:]
    x[-1] = -1000.0  # the amax sits in the tail
    assert torch.equal(_bits(native_scaling.current_scale_of(x, 448.0)[2]), _bits(amax_torch(x)))


def test_scale_from_amax_and_dispatch():
    limit = fp8_max(torch.float8_e4m3fn)
    for value in (0.0, 1e-45, 3.5, float("inf"), float("nan"), 1e38, -2.0):
        amax = torch.tensor([value], device="cuda")
        got = native_scaling.scale_from_amax(amax, limit)
        ref = current_scale_torch(amax, limit)
        assert torch.equal(_bits(got[0]), _bits(ref)) and torch.equal(_bits(got[1]), _bits(1.0 / ref))
        assert torch.equal(_bits(current_scale(amax, limit)), _bits(ref))  # the library's entry point
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(_bits(amax_of(x)), _bits(amax_torch(x)))
    # quantize_current through the kernels: the same bytes and scale_inv as through torch's amax and scale
    q = quantize_current(x, torch.float8_e4m3fn, transpose=True)
    q_ref = quantize_current(x, torch.float8_e4m3fn, amax=amax_torch(x), transpose=True)
    assert torch.equal(q.data.view(torch.uint8), q_ref.data.view(torch.uint8))
    assert torch.equal(q.transposed().view(torch.uint8), q_ref.transposed().view(torch.uint8))
    assert torch.equal(_bits(q.scale_inv), _bits(q_ref.scale_inv))


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="current_scale_of: x is"):
        native_scaling.current_scale_of(torch.randn(4, 4, device="cuda").t(), 448.0)
    with pytest.raises(ValueError, match="scale_from_amax: amax is"):
        native_scaling.scale_from_amax(torch.ones(2, device="cuda"), 448.0)
    with pytest.raises(RuntimeError, match="fp8_max"):
        native_scaling.current_scale_of(torch.randn(8, device="cuda"), float("inf"))
