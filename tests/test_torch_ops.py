"""te_parallel's torch custom ops (csrc/torch_ops; te_parallel/native/torch_ops.py) on the CPU: schemas,
fake kernels and registrations checked by torch.library.opcheck, the CPU kernels against the fp64
references, and the ops inside torch.compile(fullgraph=True). The CUDA kernels are checked against these
CPU kernels in tests/gpu/test_torch_ops_cuda.py."""
import pytest
import torch

from te_parallel.native import torch_ops
from te_parallel.ops.cast import quantize_reference
from te_parallel.ops.gemm import fp8_mm_reference
from te_parallel.fp8.tensor import Float8Tensor

pytestmark = pytest.mark.skipif(not torch_ops.usable(), reason="te_parallel._C was built without the torch ops "
                                                                 "(torch's headers were not found at build time)")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _scalar(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _cast_args(rows=32, cols=48, dtype=torch.bfloat16, delayed=True, amax=True, fp8=E4M3, rowwise=True,
               transpose=True, keep=False):
    x = torch.randn(rows, cols, dtype=dtype) * 3
    return (x, _scalar(17.5) if delayed else None, torch.full((1,), 0.25) if amax else None, fp8, rowwise,
            transpose, keep)


def _gemm_args(m=32, k=48, n=16, bias=True, acc=False, out=torch.bfloat16):
    a, b = (torch.randn(m, k) * 2).to(E4M3), (torch.randn(n, k) * 2).to(E4M3)
    return (a, _scalar(0.5), b, _scalar(0.25), out, torch.randn(n, dtype=out) if bias else None,
            torch.randn(m, n, dtype=out) if acc else None, False)


def _linear_args(delayed=True, bias=True, transpose=True):
    x = torch.randn(32, 48, dtype=torch.bfloat16)
    w = (torch.randn(16, 48) * 2).to(E4M3)
    return (x, _scalar(8.0) if delayed else None, torch.zeros(1) if delayed else None, E4M3, transpose, w,
            _scalar(0.125), torch.randn(16, dtype=torch.bfloat16) if bias else None, False)


CAST_CASES = {"delayed": _cast_args(), "current": _cast_args(delayed=False), "no_amax": _cast_args(amax=False),
              "only_t_e5m2": _cast_args(rowwise=False, fp8=E5M2, keep=True), "fp32_rows": _cast_args(dtype=torch.float32,
                                                                                                     transpose=False)}
GEMM_CASES = {"bias": _gemm_args(), "acc_fp32": _gemm_args(bias=False, acc=True, out=torch.float32),
              "plain_fp16": _gemm_args(bias=False, out=torch.float16)}
LINEAR_CASES = {"delayed": _linear_args(), "current_no_bias": _linear_args(delayed=False, bias=False),
                "no_transpose": _linear_args(transpose=False)}


@pytest.mark.parametrize("op,args", [("cast_fp8", a) for a in CAST_CASES.values()]
                         + [("fp8_gemm", a) for a in GEMM_CASES.values()]
                         + [("linear_fp8_fwd", a) for a in LINEAR_CASES.values()],
                         ids=[f"cast-{k}" for k in CAST_CASES] + [f"gemm-{k}" for k in GEMM_CASES]
                         + [f"linear-{k}" for k in LINEAR_CASES])
def test_opcheck(op, args):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype in (E4M3, E5M2) for a in args):
        # torch's schema checker compares inputs by arithmetic that FP8 tensors lack; their bytes are
        # compared here instead (nothing but the declared amax may change)
        utils = utils[1:]
        before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.dtype in (E4M3, E5M2) else
                  (a.clone() if isinstance(a, torch.Tensor) else a) for a in args]
        getattr(torch.ops.te_parallel, op).default(*args)
        for i, (a, b) in enumerate(zip(args, before)):
            if isinstance(a, torch.Tensor) and not (op == "linear_fp8_fwd" and i == 2):
                assert torch.equal(a.view(torch.uint8) if a.dtype in (E4M3, E5M2) else a, b), f"argument {i} changed"
    torch.library.opcheck(getattr(torch.ops.te_parallel, op).default, args, test_utils=utils)


@pytest.mark.parametrize("case", list(CAST_CASES))
def test_cast_matches_fp64_reference(case):
    x, scale, amax, fp8, rowwise, transpose, keep = CAST_CASES[case]
    x = torch.randn_like(x) * 5
    amax_in = None if amax is None else amax.clone()
    data, data_t, scale_inv, snap = torch_ops.cast_fp8(x, scale, amax_in, fp8, rowwise, transpose, keep)
    x_amax = x.double().abs().max()
    if scale is None:
        limit = 448.0 if fp8 is E4M3 else 57344.0
        scale = torch.tensor(limit, dtype=torch.float32) / x_amax.float()
    want = quantize_reference(x, scale, fp8)
    if rowwise:
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    else:
        assert data.shape == (0, x.shape[1])
    if transpose:
        assert torch.equal(data_t.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    else:
        assert data_t.shape == (0, x.shape[0])
    assert scale_inv.shape == () and torch.equal(scale_inv, torch.reciprocal(scale.float()))
    assert snap.shape == ((1,) if keep else (0,))
    if amax is not None:
        expect = x_amax if CAST_CASES[case][1] is None else torch.maximum(x_amax, amax.double()[0])
        assert amax_in.item() == pytest.approx(expect.item(), rel=0)


def test_current_scaling_of_zero_keeps_scale_one():
    data, _, scale_inv, _ = torch_ops.cast_fp8(torch.zeros(16, 16), None, None, E4M3, True, False, False)
    assert scale_inv.item() == 1.0 and not data.float().any()


@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_gemm_matches_fp64_reference(case):
    a, sa, b, sb, out_dtype, bias, acc, fast = GEMM_CASES[case]
    got = torch_ops.fp8_gemm(a, sa, b, sb, out_dtype, bias, acc, fast)
    want = fp8_mm_reference(Float8Tensor(a, sa), Float8Tensor(b, sb))
    if bias is not None:
        want = want + bias.double()
    if acc is not None:
        want = want + acc.double()
    assert got.dtype == out_dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=torch.finfo(out_dtype).eps, atol=1e-6)


def test_linear_is_cast_then_gemm():
    x, scale, amax, fp8, transpose, w, w_si, bias, fast = _linear_args()
    amax_a, amax_b = amax.clone(), amax.clone()
    y, data, data_t, scale_inv = torch_ops.linear_fp8_fwd(x, scale, amax_a, fp8, transpose, w, w_si, bias, fast)
    d2, dt2, si2, _ = torch_ops.cast_fp8(x, scale, amax_b, fp8, True, transpose, False)
    assert torch.equal(data.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(data_t.view(torch.uint8),
                                                                                      dt2.view(torch.uint8))
    assert torch.equal(scale_inv, si2) and torch.equal(amax_a, amax_b) and amax_a.item() > 0
    assert torch.equal(y, torch_ops.fp8_gemm(d2, si2, w, w_si, x.dtype, bias, None, fast))


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"^te_parallel::fp8_gemm: got a \(4, 8\).*need FP8 a \[m, k\]") as err:
        torch_ops.fp8_gemm(torch.zeros(4, 8, dtype=E4M3), _scalar(1), torch.zeros(4, 7, dtype=E4M3), _scalar(1),
                           torch.bfloat16)
    assert "\n" not in str(err.value)


def test_ops_compile_in_one_graph():
    """The ops are single nodes of a compiled graph (fullgraph=True: no break), with eager's results and
    the amax written in place."""
    torch._dynamo.reset()
    x, scale, amax, fp8, transpose, w, w_si, bias, fast = _linear_args()

    def step(x, amax):
        y, data, data_t, si = torch.ops.te_parallel.linear_fp8_fwd(x, scale, amax, fp8, transpose, w, w_si, bias, fast)
        return torch.relu(y) * 2, data_t

    amax_e, amax_c = amax.clone(), amax.clone()
    want = step(x, amax_e)
    got = torch.compile(step, fullgraph=True)(x, amax_c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(amax_c, amax_e)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("shape", [(32, 48), (4, 8, 48)], ids=["2d", "3d"])
def test_one_call_run_equals_apply(recipe_name, shape):
    """OneCallFP8Linear.run (the one-call forward's entry: torch's C Function.apply with grad on, the op
    alone with grad off) gives apply's bytes: output, gradients of x, W and bias, the amaxes recorded; with
    grad off it adds no autograd node. The CPU kernels stand in for the CUDA ones (same math)."""
    import te_parallel as te
    from te_parallel import recipe as R
    from te_parallel.fp8 import autocast as ac
    from te_parallel.ops import linear as linear_ops

    assert linear_ops._C_APPLY is not None  # present on the supported torch versions: run() takes it
    rec = R.DelayedScaling() if recipe_name == "delayed" else R.Float8CurrentScaling()
    torch.manual_seed(0)
    mods = [te.Linear(48, 16, params_dtype=torch.bfloat16, device="cpu") for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    x = torch.randn(*shape, dtype=torch.bfloat16)
    dy = torch.randn(*shape[:-1], 16, dtype=torch.bfloat16)
    results = []
    for m, entry in zip(mods, ("apply", "run")):
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=rec):
            cfg = m._gemm_fp8(ac.current_frame(), 0, [m.weight], m.weight, None)
            if entry == "apply":
                y = linear_ops.OneCallFP8Linear.apply(xi, m.weight, m.bias, cfg)
            else:
                y = linear_ops.OneCallFP8Linear.run(xi, m.weight, m.bias, cfg)
        assert type(y.grad_fn).__name__ == "OneCallFP8LinearBackward"
        y.backward(dy)
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=rec):
            cfg = m._gemm_fp8(ac.current_frame(), 0, [m.weight], m.weight, None)
            y0 = linear_ops.OneCallFP8Linear.run(x, m.weight, m.bias, cfg)
        assert y0.grad_fn is None and y0.shape == y.shape
        results.append([y.detach(), xi.grad, m.weight.grad, m.bias.grad, y0] + [b.clone() for b in m.fp8_state.buffers()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
