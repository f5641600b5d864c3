"""tests/test_graph_ops.py on CUDA: the ops' CUDA kernels (the native kernels behind torch's dispatcher)
by torch.library.opcheck, each op's results against its family wrapper called eagerly (the same kernel:
bit for bit), and a compiled Llama-style layer whose graph calls them, equal to eager mode bit for bit."""
import pytest
import torch

from te_parallel.native import activation as native_act
from te_parallel.native import cast as native_cast
from te_parallel.native import norm as native_norm
from te_parallel.native import rope as native_rope
from tests.test_graph_ops import *  # noqa: F401,F403
from tests.test_graph_ops import CASES, OPS, _to


def _eager(op, args):
    """What the family wrapper returns for the op's arguments (None where the op returns an empty tensor)."""
    if op == "norm_fwd":
        norm, x, gamma, beta, eps, zc, scale, fp8, amax, transpose, out_dtype = args
        spec = None if fp8 is None else native_norm.FP8NormOutput(scale, fp8, amax, transpose)
        out, mu, rsigma = native_norm.forward(norm, x, gamma, beta, eps, zc, spec, out_dtype)
        return (*(out if spec is not None else (out, None)), mu, rsigma)
    if op == "norm_bwd":
        return native_norm.backward(*args)
    if op == "bias_activation_fwd":
        name, x, bias, high, fp8, scale, amax, transpose = args
        return native_act.bias_activation_forward(name, x, bias, high_precision=high, fp8_dtype=fp8, scale=scale,
                                                  amax_out=amax, transpose=transpose)
    if op == "dbias_dactivation_bwd":
        name, dy, x, bias, need_dbias, high, fp8, scale, amax, transpose = args
        return native_act.dbias_dactivation_backward(name, dy, x, bias, need_dbias=need_dbias, high_precision=high,
                                                     fp8_dtype=fp8, scale=scale, amax_out=amax, transpose=transpose)
    if op == "rope":
        return (native_rope.rope(*args),)
    if op == "transpose_fp8":
        return (native_cast.transpose_fp8(*args),)
    x, scale, fp8, amax, transpose, rowwise, keep, dbias_dtype = args
    scale_inv, snap = torch.empty((), device=x.device), torch.empty((), device=x.device) if keep else None
    dbias = None if dbias_dtype is None else torch.empty(x.shape[1], dtype=dbias_dtype, device=x.device)
    data, data_t = native_cast.cast_transpose_amax(x, scale, fp8, amax, transpose, scale_inv, dbias, rowwise=rowwise,
                                                   scale_out=snap)
    return data, data_t, scale_inv, snap, dbias


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("case", list(CASES))
def test_op_is_the_wrapper(case, device):
    op, args = CASES[case]
    args = _to(args, device)
    got = getattr(OPS, op)(*_clone(args))
    got = got if isinstance(got, tuple) else (got,)
    want = _eager(op, _clone(args))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g.numel() == 0, f"output {i}: {tuple(g.shape)} where the wrapper returns None"
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, f"output {i}"
            fp8 = g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            assert torch.equal(g.view(torch.uint8) if fp8 else g, w.view(torch.uint8) if fp8 else w), f"output {i}"
