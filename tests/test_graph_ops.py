"""The native kernels as torch custom ops (te_parallel::norm_fwd, norm_bwd, bias_activation_fwd,
dbias_dactivation_bwd, rope, cast_transpose_amax, transpose_fp8): what a torch.compile graph calls in
place of the pybind11 wrappers. On the CPU: schemas, fake kernels and registrations by
torch.library.opcheck; the CPU kernels (the ops layer's PyTorch paths) against the fp64 references; and a
compiled layer whose native families are routed through the ops (the CPU stands in for CUDA: the
families' `usable` predicates are made true while tracing), which must trace into one graph holding
them and compute what eager mode computes. The CUDA kernels behind the same ops are checked in
tests/gpu/test_graph_ops_cuda.py."""
import contextlib

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.native import activation as native_act
from te_parallel.native import cast as native_cast
from te_parallel.native import norm as native_norm
from te_parallel.native import rope as native_rope
from te_parallel.ops import activation as act_ops
from te_parallel.ops import norm as norm_ops
from te_parallel.ops.cast import quantize_reference
from te_parallel.ops.rope import rope_torch
from tests.reference import rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.te_parallel
pytestmark = pytest.mark.skipif(not native_act.GATED_ACTIVATIONS and not te.native.available(),
                                reason="te_parallel._C is absent: the activation table names no gated activation")


def _scalar(v):
    return torch.tensor([v], dtype=torch.float32)


def _norm_args(norm="rms_norm", fp8=True, transpose=True, amax=True, out_dtype=None, dtype=torch.bfloat16):
    x = torch.randn(24, 64, dtype=dtype) * 2
    beta = torch.randn(64) * 0.1 if norm == "layer_norm" else None
    return (norm, x, torch.randn(64) * 0.1, beta, 1e-5, True, _scalar(3.0) if fp8 else None, E4M3 if fp8 else None,
            torch.full((1,), 0.5) if fp8 and amax else None, transpose, out_dtype)


def _norm_bwd_args(norm="rms_norm", with_dbeta=False):
    x = torch.randn(24, 64)
    mu = x.mean(-1) if norm == "layer_norm" else None
    rsigma = torch.rsqrt(((x - (mu[:, None] if mu is not None else 0)) ** 2).mean(-1) + 1e-5)
    return (norm, torch.randn(24, 64), x, mu, rsigma, torch.randn(64) * 0.1, True, with_dbeta)


def _act_args(name="swiglu", bias=False, high=False, fp8=True, amax=True, transpose=True):
    cols = 64
    return (name, torch.randn(32, cols, dtype=torch.bfloat16), torch.randn(cols, dtype=torch.bfloat16) if bias else None,
            high, E4M3 if fp8 else None, _scalar(2.0) if fp8 else None, torch.zeros(1) if amax else None, transpose)


def _dact_args(name="swiglu", bias=False, need_dbias=False, high=False, fp8=True, transpose=True):
    cols = 64
    out_cols = cols // 2 if name in act_ops._GATED else cols
    return (name, torch.randn(32, out_cols, dtype=torch.bfloat16), torch.randn(32, cols, dtype=torch.bfloat16),
            torch.randn(cols, dtype=torch.bfloat16) if bias else None, need_dbias, high, E5M2 if fp8 else None,
            _scalar(4.0) if fp8 else None, torch.zeros(1) if fp8 else None, transpose)


def _cast_args(transpose=True, rowwise=True, keep=False, dbias=None, amax=True):
    return (torch.randn(32, 48, dtype=torch.bfloat16) * 3, _scalar(5.0).reshape(()), E4M3,
            torch.full((1,), 0.25) if amax else None, transpose, rowwise, keep, dbias)


CASES = {
    "norm_fwd-rms-fp8": ("norm_fwd", _norm_args()),
    "norm_fwd-ln-fp8-no_t": ("norm_fwd", _norm_args("layer_norm", transpose=False)),
    "norm_fwd-ln-fp32_out": ("norm_fwd", _norm_args("layer_norm", fp8=False, out_dtype=torch.float32)),
    "norm_fwd-rms-no_amax": ("norm_fwd", _norm_args(amax=False)),
    "norm_bwd-rms": ("norm_bwd", _norm_bwd_args()),
    "norm_bwd-ln-dbeta": ("norm_bwd", _norm_bwd_args("layer_norm", True)),
    "act_fwd-swiglu-fp8": ("bias_activation_fwd", _act_args()),
    "act_fwd-gelu-bias-high": ("bias_activation_fwd", _act_args("gelu", bias=True, high=True, fp8=False, amax=False)),
    "act_fwd-srelu-amax_only": ("bias_activation_fwd", _act_args("srelu", fp8=False)),
    "dact-swiglu-fp8": ("dbias_dactivation_bwd", _dact_args()),
    "dact-gelu-dbias-high": ("dbias_dactivation_bwd", _dact_args("gelu", bias=True, need_dbias=True, high=True,
                                                                 fp8=False)),
    "dact-qgeglu-fp8-no_t": ("dbias_dactivation_bwd", _dact_args("qgeglu", transpose=False, high=True)),
    "rope-fwd": ("rope", (torch.randn(8, 2, 3, 16, dtype=torch.bfloat16), torch.randn(8, 12), False)),
    "rope-bwd": ("rope", (torch.randn(8, 2, 3, 16, dtype=torch.bfloat16), torch.randn(8, 16), True)),
    "cast-rows_t": ("cast_transpose_amax", _cast_args()),
    "cast-dbias_keep": ("cast_transpose_amax", _cast_args(transpose=False, dbias=torch.float32, amax=False)),
    "cast-only_t_keep": ("cast_transpose_amax", _cast_args(rowwise=False, keep=True)),
    "transpose_fp8": ("transpose_fp8", ((torch.randn(32, 48) * 4).to(E4M3),)),
}


def _to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck(case, device):
    op, args = CASES[case]
    args = _to(args, device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype in (E4M3, E5M2) for a in args):
        utils = utils[1:]  # (torch's schema checker compares inputs by arithmetic that FP8 tensors lack)
    torch.library.opcheck(getattr(OPS, op).default, args, test_utils=utils)


def _bytes(t):
    return t.view(torch.uint8)


def test_norm_fwd_cpu_kernel_is_the_fp64_norm_then_the_cast():
    norm, x, gamma, beta, eps, zc, scale, fp8, amax, transpose, _ = _norm_args("layer_norm")
    amax_in = amax.clone()
    data, data_t, mu, rsigma = OPS.norm_fwd(norm, x, gamma, beta, eps, zc, scale, fp8, amax_in, transpose, None)
    y = norm_ops.layer_norm_reference(x, gamma, beta, eps, zc)
    y_model = norm_ops.layer_norm(x, gamma, beta, eps, zc)  # the rounded bf16 y the bytes quantize
    assert rel_err(y_model, y) < 1e-2
    assert torch.equal(_bytes(data), _bytes(quantize_reference(y_model, scale, fp8)))
    assert torch.equal(_bytes(data_t), _bytes(data.t().contiguous()))
    assert amax_in.item() == max(0.5, y_model.float().abs().max().item())
    assert rel_err(mu, x.double().mean(-1)) < 1e-6
    assert rel_err(rsigma, torch.rsqrt(x.double().var(-1, unbiased=False) + eps)) < 1e-6


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norm_bwd_cpu_kernel_matches_fp64(norm):
    _, dy, x, mu, rsigma, gamma, zc, _ = _norm_bwd_args(norm, True)
    dx, dgamma, dbeta = OPS.norm_bwd(norm, dy, x, mu, rsigma, gamma, zc, norm == "layer_norm")
    if norm == "layer_norm":
        want = norm_ops.layer_norm_bwd_reference(dy, x, gamma, torch.zeros_like(gamma), 1e-5, zc)
        assert rel_err(dbeta, want[2]) < 1e-6
    else:
        want = norm_ops.rms_norm_bwd_reference(dy, x, gamma, 1e-5, zc)
        assert dbeta.numel() == 0
    assert rel_err(dx, want[0]) < 1e-5 and rel_err(dgamma, want[1]) < 1e-5


@pytest.mark.parametrize("name", act_ops.ACTIVATIONS)
def test_dact_cpu_kernel_matches_fp64(name):
    cols = 64
    out_cols = cols // 2 if act_ops.is_gated(name) else cols
    x, bias = torch.randn(32, cols) * 2, torch.randn(cols)
    dy = torch.randn(32, out_cols)
    dx, dbias, data, _ = OPS.dbias_dactivation_bwd(name, dy, x, bias, True, True, None, None, None, False)
    want_dx, want_dbias = act_ops.dbias_dactivation_reference(name, dy, x, bias)
    assert rel_err(dx, want_dx) < 1e-5 and rel_err(dbias, want_dbias) < 1e-5 and data.numel() == 0


def test_act_fwd_cpu_kernel_bytes_are_quantize_of_the_output():
    name, x, bias, _, fp8, scale, amax, _ = _act_args("geglu", bias=True)
    y, data, data_t = OPS.bias_activation_fwd(name, x, bias, True, fp8, scale, amax, True)
    assert rel_err(y, act_ops.bias_activation_reference(name, x, bias)) < 1e-2
    assert torch.equal(_bytes(data), _bytes(quantize_reference(y, scale, fp8)))
    assert torch.equal(_bytes(data_t), _bytes(data.t().contiguous()))
    assert amax.item() == y.float().abs().max().item()


@pytest.mark.parametrize("backward", [False, True])
def test_rope_cpu_kernel(backward):
    x, angles = torch.randn(8, 2, 3, 16, dtype=torch.float64), torch.randn(8, 12, dtype=torch.float64)
    if not backward:
        assert torch.equal(OPS.rope(x, angles, False), rope_torch(x, angles[:, None, None, :]))
    else:  # the transpose of the forward map: <R x, y> = <x, Rᵀ y>
        y = torch.randn_like(x)
        lhs = (OPS.rope(x, angles, False) * y).sum()
        assert abs(lhs - (x * OPS.rope(y, angles, True)).sum()) < 1e-9 * lhs.abs().clamp(min=1)


# ------------------------------------------------------------------------------------------------
# A compiled layer through the ops

@contextlib.contextmanager
def _native_families_in_graphs(monkeypatch, device):
    """On the CPU: the native families' predicates true while tracing (and only then: eager mode keeps the
    CPU's PyTorch paths), so that the graph routes them through their ops as it does on CUDA. On CUDA: as
    they are."""
    if device == "cpu":
        for family in (native_norm, native_act, native_rope, native_cast):
            monkeypatch.setattr(family, "usable", lambda *a, **k: torch.compiler.is_compiling())
    yield


def _op_calls(graphs):
    """(op name, {argument: value}) of every te_parallel op in the AOT graphs (an op that writes an argument
    sits inside auto_functionalized, its arguments as keywords)."""
    calls = []
    for g in graphs:
        for n in g.graph.nodes:
            if n.op != "call_function":
                continue
            wrapped = "auto_functionalized" in str(n.target)
            target = n.args[0] if wrapped else n.target
            if not str(target).startswith("te_parallel."):
                continue
            args = dict(n.kwargs)
            if not wrapped:
                args.update(zip([a.name for a in target._schema.arguments], n.args))
            calls.append((str(target).split(".")[1], args))
    return calls


def _op_names(graphs):
    return {name for name, _ in _op_calls(graphs)}


LLAMA = dict(num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", bias=False, hidden_dropout=0.0,
             attention_dropout=0.0)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_llama_layer_calls_the_native_ops(monkeypatch, recipe, device):
    """A Llama-style layer with RoPE: one graph with no break, made by the first step, none after; the graph
    holds the activation, RoPE and cast ops (and under delayed scaling the norm's, which writes FP8);
    outputs and gradients as eager mode's: on CUDA within fp32 summation order (the same kernels run; the
    graph adds the residual and gradient sums in its own order), on the CPU within the FP8 chain (eager's
    PyTorch paths and the CPU kernels' derivative formulas round differently)."""
    fp8 = R.DelayedScaling(amax_history_len=4) if recipe == "delayed" else R.Float8CurrentScaling()
    torch.manual_seed(0)
    eager = te.TransformerLayer(64, 128, 4, device=device, **LLAMA)
    twin = te.TransformerLayer(64, 128, 4, device=device, **LLAMA)
    twin.load_state_dict(eager.state_dict())
    freqs = te.RotaryPositionEmbedding(16)(16).to(device)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    with _native_families_in_graphs(monkeypatch, device):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(twin, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(16, 2, 64, generator=gen).to(device)
            dy = torch.randn(16, 2, 64, generator=gen).to(device)
            outs = []
            for module, fn in ((eager, eager), (twin, compiled)):
                with te.fp8_autocast(fp8_recipe=fp8):
                    y = fn(x, rotary_pos_emb=freqs)
                y.backward(dy)
                outs.append([y.detach()] + [p.grad.clone() for p in module.parameters()])
                module.zero_grad()
            for a, b in zip(*outs):
                assert rel_err(b, a) < (5e-3 if device == "cpu" else 1e-5), f"relative error {rel_err(b, a):.3g}"
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        torch._dynamo.reset()
    names = _op_names(graphs)
    want = {"bias_activation_fwd", "dbias_dactivation_bwd", "rope"}
    want |= {"norm_fwd", "norm_bwd"} if recipe == "delayed" else set()  # (current: torch's norm, then the cast)
    want |= {"cast_fp8"} if te.native.torch_ops.usable() else {"cast_transpose_amax"}
    want |= {"fp8_gemm"} if device == "cuda" else set()
    assert want <= names, f"ops in the graphs: {sorted(names)}"
    # The MLP runs as one Function (ops/mlp.py), as eagerly: the activation writes fc2's FP8 input, and under
    # delayed scaling its backward writes fc1's FP8 output gradient.
    fp8_out = {name for name, args in _op_calls(graphs) if args.get("fp8_dtype") is not None}
    assert ({"bias_activation_fwd", "dbias_dactivation_bwd"} if recipe == "delayed" else {"bias_activation_fwd"}) <= fp8_out
