"""The linear autograd Function: y = x·Wᵀ + b, in FP8 or high precision, single-rank or tensor-parallel.

Shapes on one rank (tp = TP group size, M = tokens, rows ordered sequence-major so dim 0 of the
2-D view is the sequence dim that sequence parallelism shards):
    fprop y  = x·Wᵀ   (needs x, W)          dgrad dx = dy·W (needs dy, Wᵀ copy)
    wgrad dW = dyᵀ·x  (needs dyᵀ copy, xᵀ copy)
Column-parallel (W [N/tp, K]): x is replicated (no SP) or gathered from [M/tp, K] (SP, in FP8 when
autocast is on: the bytes are cast first, half of bf16); dx is a partial sum, all-reduced (no SP) or
reduce-scattered back to [M/tp, K] (SP). Row-parallel (W [N, K/tp]): y is a partial sum,
all-reduced (no SP) or reduce-scattered to [M/tp, N] (SP), bias added after; under SP backward
gathers dy (FP8 bytes) and all-reduces the bias gradient (each rank saw M/tp tokens).

Backward overlap (the rule: no exposed comm where a GEMM can hide it), in issue order on the stream:
    1. start the async re-gather of x (column+SP; only the local shard was kept)
    2. dgrad GEMM                                   <- overlaps 1
    3. start the async all-reduce / reduce-scatter of dx
    4. wait 1; wgrad GEMM                           <- overlaps 3
    5. wait 3
Async collectives run on the communicator's own stream after waiting for the current stream at
launch; `wait()` makes the current stream wait for them (no host block with NCCL). With NCCL set
CUDA_DEVICE_MAX_CONNECTIONS=1 so the collective's kernel is scheduled before the GEMM issued after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import BLOCK, BlockwiseTensor
from te_parallel.fp8.gemm_quantizers import BlockWeightSource, WeightSource
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import gemm
from te_parallel.ops import linear_overlap as ov
from te_parallel.parallel.collectives import all_gather_dim0, all_reduce, reduce_scatter_dim0
from te_parallel.parallel.groups import group_size


@dataclass(frozen=True)
class WgradTarget:
    """Where a fused wgrad accumulates: rows [start, end) of dW go into param.main_grad."""

    param: torch.nn.Parameter
    start: int
    end: int


@dataclass(frozen=True)
class LinearParallel:
    """How one linear layer is split across its tensor-parallel group."""

    mode: Optional[str] = None  # None, "column", "row"
    group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False
    fp8_gather: bool = True  # False: gather the high-precision input, then cast (twice the bytes; for comparison)
    # Comm-GEMM overlap (te_parallel.parallel.overlap.CommOverlap; sequence parallel only). ub_fprop /
    # ub_dgrad: the OverlapConfig of that pass's overlap, None where it does not overlap.
    ub: Optional[object] = None
    ub_fprop: Optional[object] = None  # column: AG+GEMM ring; row: GEMM+RS by destination chunk
    ub_dgrad: Optional[object] = None  # row: AG(dy)+dgrad ring; column: AG(x) under dgrad, RS(dx) under wgrad
    ub_rs_dgrad: bool = False  # column, with ub_dgrad: RS(dx) pipelined with dgrad instead (ub_overlap_rs_dgrad)
    # row + SP: the bias added after the reduce-scatter sees this rank's M/tp tokens, so its gradient is
    # partial; True sums it over the group here, False leaves it to the caller (TE: Megatron's gradient
    # finalisation reduces parameters marked sequence_parallel)
    sum_sp_bias_grad: bool = True
    # whether the layer is split at all, decided once: the properties below are read several times per GEMM
    active: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "active", self.mode is not None and group_size(self.group) > 1)

    @property
    def amax_group(self):
        """Current scaling: the ranks whose amaxes are all-reduced before a cast. Every operand of a
        split GEMM is reduced (not only gathered ones), so that TP=N quantizes exactly like TP=1."""
        return self.group if self.active else None

    @property
    def gathers_input(self) -> bool:  # column + SP: x [M/tp, K] -> [M, K]
        return self.active and self.mode == "column" and self.sequence_parallel

    @property
    def gathers_grad(self) -> bool:  # row + SP: dy [M/tp, N] -> [M, N]
        return self.active and self.mode == "row" and self.sequence_parallel

    @property
    def overlap_fprop(self) -> bool:
        return self.ub is not None and self.ub_fprop is not None and self.active and self.sequence_parallel

    @property
    def overlap_dgrad(self) -> bool:
        return self.ub is not None and self.ub_dgrad is not None and self.active and self.sequence_parallel


SINGLE = LinearParallel()


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """How one GEMM of a module runs in this call (made by GemmModule._gemm_plan, read by linear_fwd):
    fp8: its FP8 casts (ops.fp8_gemm_config.GemmFP8), or None in high precision; targets: where a fused
    wgrad accumulates (None: dW is returned); par: its tensor-parallel split; grad: autograd is recording."""

    fp8: Optional[object]
    targets: Optional[List[WgradTarget]]
    par: LinearParallel
    grad: bool
QUANTIZED = (Float8Tensor, BlockwiseTensor)  # the GEMM operands of an FP8 recipe (gemm.py dispatches on the pair)


def _accumulate_main_grad(targets: List[WgradTarget], dw: torch.Tensor) -> None:
    for t in targets:
        main_grad = getattr(t.param, "main_grad", None)
        if main_grad is None or main_grad.shape != t.param.shape:
            got = None if main_grad is None else tuple(main_grad.shape)
            raise RuntimeError(
                f"fuse_wgrad_accumulation=True needs weight.main_grad of shape {tuple(t.param.shape)} "
                f"(usually fp32) set before backward, got {got}"
            )
        main_grad.add_(dw[t.start : t.end].to(main_grad.dtype))
        if hasattr(t.param, "grad_added_to_main_grad"):
            t.param.grad_added_to_main_grad = True


def _gather(t, group, async_op=False):
    """All-gather dim 0 of a high-precision tensor or of FP8 bytes (which keep their shared scale_inv); a
    block-scaled tensor moves its bytes and its scales, each direction it has (synchronously)."""
    if type(t) is BlockwiseTensor:
        return _gather_block(t, group), None
    if isinstance(t, Float8Tensor):
        data, handle = all_gather_dim0(t.data, group, async_op)
        return Float8Tensor(data, t.scale_inv), handle
    return all_gather_dim0(t, group, async_op)


def _gather_block(t: BlockwiseTensor, group) -> BlockwiseTensor:
    """The rows of every rank's 1x128-tiled tensor, in rank order: rowwise bytes [M/tp, K] and scales
    [K/128, M/tp] join along rows, columnwise bytes [K, M/tp] along columns and their scales [M/tp/128, K]
    along rows (the tiles along M are whole on each rank: block_gather_ok)."""
    tp = group_size(group)
    data = scale_inv = data_t = scale_inv_t = None
    if t.data is not None:
        data = all_gather_dim0(t.data, group)[0]
        kt, m = t.scale_inv.shape
        parts = all_gather_dim0(t.scale_inv.reshape(1, kt * m), group)[0].view(tp, kt, m)
        scale_inv = parts.permute(1, 0, 2).reshape(kt, tp * m)
    if t.data_t is not None:
        k, m = t.data_t.shape
        parts = all_gather_dim0(t.data_t.view(torch.uint8).reshape(1, k * m), group)[0].view(tp, k, m)
        data_t = parts.permute(1, 0, 2).reshape(k, tp * m).view(t.fp8_dtype)
        scale_inv_t = all_gather_dim0(t.scale_inv_t, group)[0]
    return BlockwiseTensor(data, scale_inv, data_t, scale_inv_t, 1, t.fp8_dtype,
                           torch.Size((tp * t.shape[0], t.shape[1])))


def block_gather_ok(fp8, rows: int) -> bool:
    """Block scaling: a shard of `rows` rows can be cast before the all-gather (FP8 bytes on the wire) when
    its 1x128 tiles along the rows are the gathered tensor's, i.e. rows is a multiple of 128. Otherwise the
    high-precision rows are gathered and cast after (the bytes of one process's cast either way)."""
    return rows % BLOCK == 0


def _is_tiled(fp8) -> bool:
    """An FP8 GEMM whose input and gradient carry scales per tile (GemmFP8.tiled)."""
    return fp8 is not None and fp8.compute and fp8.tiled


def _mm(fp8, which: str):
    """The recipe's MMParams of this GEMM (fp8_gemm_fprop / _dgrad / _wgrad); the default without FP8."""
    return gemm.EXACT if fp8 is None else getattr(fp8.recipe, which)


def _fprop(x, w, bias, out_dtype, fp8=None, accumulate=None):
    if isinstance(x, QUANTIZED):
        return gemm.fprop(x, w, out_dtype, bias, accumulate=accumulate, mm=_mm(fp8, "fp8_gemm_fprop"))
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    return torch.nn.functional.linear(x, w, bias)


def _dgrad(dy, w, out_dtype, fp8=None):
    return gemm.dgrad(dy, w, out_dtype, mm=_mm(fp8, "fp8_gemm_dgrad")) if isinstance(dy, QUANTIZED) else dy @ w


def _wgrad(dy, x, out_dtype, fp8=None):
    if isinstance(dy, QUANTIZED):
        return gemm.wgrad(dy, x, out_dtype, mm=_mm(fp8, "fp8_gemm_wgrad"))
    return (dy.t() @ x).to(out_dtype)


def _reduce_output(y2d: torch.Tensor, par: LinearParallel) -> torch.Tensor:
    if par.sequence_parallel:
        return reduce_scatter_dim0(y2d, par.group)[0]
    all_reduce(y2d, par.group)
    return y2d


class LinearSaved:
    """What the backward of one linear forward needs (LinearFunction's context, or one GEMM of a fused
    Function such as ops.mlp's)."""

    __slots__ = ("fp8", "targets", "par", "act_dtype", "has_bias", "weight_dtype", "w_saved", "x_saved", "regather")


def _copy_saved(s: LinearSaved) -> LinearSaved:
    """A new LinearSaved with s's fields (a backward may then replace its operands, e.g. W by Wᵀ)."""
    copy = LinearSaved()
    for name in LinearSaved.__slots__:
        setattr(copy, name, getattr(s, name))
    return copy


def residual_in_gemm(plan, residual: Optional[torch.Tensor], act_dtype: torch.dtype) -> bool:
    """True where a residual added to this GEMM's output goes into the GEMM's epilogue (linear_fwd's
    `accumulate`: D = A·B + C, one rounding, no separate add): an FP8 GEMM on one rank, whose output is not
    reduced across ranks, and a contiguous residual in the output's dtype. Elsewhere the caller adds it."""
    fp8, par = plan.fp8, plan.par
    return (residual is not None and fp8 is not None and fp8.compute and not par.active
            and residual.dtype == act_dtype and residual.is_contiguous())


def linear_fwd(x2d: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor], plan,
               act_dtype: torch.dtype, x_q: Optional[Float8Tensor] = None,
               accumulate: Optional[torch.Tensor] = None):
    """y2d = x2d·Wᵀ + b (+ accumulate) on this rank (the collectives of `par` included); returns (y2d,
    LinearSaved).

    plan: a GemmPlan. x_q: the input already cast to
    FP8 with this GEMM's input scale (e.g. by the activation kernel before fc2; with its transpose when
    wgrad will need it), used instead of casting x2d (then None). Not with an input to gather.
    accumulate: [M, N] added in the GEMM's epilogue, only where residual_in_gemm(plan, ...) holds.
    """
    fp8, wgrad_targets, par, grad = plan.fp8, plan.targets, plan.par, plan.grad
    out_features, in_features = weight.shape
    row = par.active and par.mode == "row"
    gathers, overlap = par.gathers_input, par.overlap_fprop
    need_wgrad = grad and (weight.requires_grad or bool(wgrad_targets))
    # Gather FP8 bytes (cast first) unless told to gather high precision (kept to measure the saving).
    regather = gathers and (par.fp8_gather or fp8 is None or not fp8.compute or overlap)
    if regather and _is_tiled(fp8) and not block_gather_ok(fp8, x2d.shape[0]):
        regather = False
    fused = None
    if x_q is None and accumulate is None and fp8 is not None and fp8.compute and not (gathers or overlap or row) \
            and (fp8.quantizers.input.scale_known_before_cast or not par.active):
        # one rank's cast + GEMM in one native call (the host path of small layers); None where it cannot
        fused = fp8.fused_fprop(x2d, bias, transpose=need_wgrad)
    if fused is not None:
        y2d, x_local = fused
        w_used = fp8.weight
    else:
        x_local, w_used = _fprop_operands(x2d, weight, fp8, par, act_dtype, x_q, need_wgrad, regather)
        if accumulate is not None:  # (one rank, FP8: residual_in_gemm)
            y2d = _fprop(x_local, w_used, bias, act_dtype, fp8, accumulate)
        else:
            y2d = _fprop_on_ranks(x_local, w_used, bias, fp8, par, act_dtype, out_features, row, regather)
    if row and bias is not None:
        y2d = y2d + bias.to(act_dtype)
    s = LinearSaved()
    s.fp8, s.targets, s.par, s.act_dtype = fp8, wgrad_targets, par, act_dtype
    s.has_bias, s.weight_dtype, s.w_saved = bias is not None, weight.dtype, w_used
    if grad and fp8 is not None and fp8.compute:  # W is not needed after this GEMM unless cached
        s.w_saved = fp8.weight_for_backward()
    s.x_saved, s.regather = None, regather
    if need_wgrad:  # the local shard when backward re-gathers it, else (FP8) xᵀ only
        if type(x_local) is BlockwiseTensor:  # (re-gathered or not, backward reads its columnwise direction)
            s.x_saved = x_local.only_columnwise()
        else:
            keep = regather or not isinstance(x_local, Float8Tensor)
            s.x_saved = x_local if keep else _only_transposed(x_local)
    return y2d, s


def _fprop_operands(x2d, weight, fp8, par: LinearParallel, act_dtype, x_q, need_wgrad: bool, regather: bool):
    """(x as the GEMM takes it on this rank, W as it takes it): FP8 (cast here, or x_q as given) or high
    precision; x gathered first when the high-precision input is gathered."""
    if x_q is not None:
        if par.gathers_input or fp8 is None or not fp8.compute:
            raise ValueError("linear_fwd: a pre-quantized input needs an FP8 GEMM whose input is not gathered")
        return x_q, fp8.weight
    if par.gathers_input and not regather:
        x2d = _gather(x2d, par.group)[0]
    if fp8 is not None and fp8.compute:
        # xᵀ for wgrad from the same pass, unless the gathered x is transposed in backward (block scaling:
        # its columnwise tiles come from this cast, and backward gathers them)
        transpose = need_wgrad and (not regather or _is_tiled(fp8))
        return fp8.cast_input(x2d, transpose=transpose, amax_group=par.amax_group), fp8.weight
    if fp8 is not None:
        fp8.record_amax(x2d, backward=False)
    return x2d, (weight if weight.dtype == act_dtype else weight.to(act_dtype))


def _fprop_on_ranks(x_local, w_used, bias, fp8, par: LinearParallel, act_dtype, out_features: int, row: bool,
                    regather: bool):
    """y = x·Wᵀ (+ b, column-parallel / single rank) with this layer's collectives: the gather ring or
    the reduce-scatter overlapped with the GEMM, or the plain gather / reduction around it."""
    mm = _mm(fp8, "fp8_gemm_fprop")
    if par.overlap_fprop and not row:  # column: gather ring under the GEMM
        fp = lambda a, out: ov.fprop_into(a, w_used, bias, out, mm=mm)  # noqa: E731
        return ov.ag_gemm(par.ub, x_local, fp, out_features, act_dtype, keep_gathered=False, w=w_used, bias=bias,
                          mm=mm, cfg=par.ub_fprop)[0]
    if par.overlap_fprop:  # row: reduce-scatter by destination chunk under the GEMM
        fp = lambda a, out, acc=None: ov.fprop_into(a, w_used, None, out, acc, mm=mm)  # noqa: E731
        return ov.gemm_rs(par.ub, x_local, fp, out_features, act_dtype, par.ub_fprop, w=w_used, mm=mm)
    if regather and type(x_local) is BlockwiseTensor:
        x_local = x_local.rowwise_only()  # (backward gathers the columnwise tiles it saved)
    x_used = _gather(x_local, par.group)[0] if regather else x_local
    y2d = _fprop(x_used, w_used, None if row else bias, act_dtype, fp8)
    return _reduce_output(y2d, par) if row else y2d


def linear_bwd(s: LinearSaved, dy2d: Optional[torch.Tensor], need_dx: bool, need_dw: bool, need_dbias: bool,
               dy_q: Optional[Float8Tensor] = None, dbias: Optional[torch.Tensor] = None, dx_rows=None):
    """(dx2d, dw, dbias) of one linear_fwd (None where not needed; dw None when accumulated into
    main_grad). dy2d [M or M/tp, N] in the activation dtype; or dy_q, the output gradient already cast
    with this GEMM's gradient scale (with its transpose when wgrad is needed) together with its dbias
    (e.g. by the activation's backward kernel, which also counted the cast: GemmFP8.cast_dactivation).

    dx_rows = (rows per chunk, consume): make dx in row chunks after wgrad, handing each to
    consume(first row, dx rows) before the next is made (dx2d is then None); only where dx needs no
    reduction across ranks and dgrad is not overlapped (ops.mlp uses it to bound fc2's dgrad output)."""
    if torch.compiler.is_compiling():  # (the forward's object stays as it was: a traced backward may not write it)
        s = _copy_saved(s)
    fp8, targets, par = s.fp8, s.targets, s.par
    if dx_rows is not None and (par.overlap_dgrad or (par.active and par.mode == "column") or not need_dx):
        raise ValueError("linear_bwd: dx_rows needs dx without a cross-rank reduction or dgrad overlap")
    gathered = False
    if dy_q is None and _is_tiled(fp8) and par.gathers_grad and not block_gather_ok(fp8, dy2d.shape[0]):
        dy2d, gathered = _gather(dy2d, par.group)[0], True  # (the tiles of a shard would not be the whole's)
        if need_dbias:  # (of the whole sequence: no sum across ranks after)
            dbias = dy2d.sum(0)
            need_dbias = False
    if dy_q is not None:
        dy = dy_q
    elif fp8 is not None and fp8.compute:
        # dyᵀ for wgrad and the bias gradient from the cast's read of dy (the gathered dy, if any,
        # is transposed after the gather)
        dbias = dy2d.new_empty(dy2d.shape[1]) if need_dbias else dbias
        transpose = need_dw and (not par.gathers_grad or _is_tiled(fp8))
        dy = fp8.cast_grad(dy2d, transpose=transpose, amax_group=par.amax_group,
                           dbias_out=dbias if need_dbias else None)
    else:
        if fp8 is not None:
            fp8.record_amax(dy2d, backward=True)
        dy = dy2d
        dbias = dy2d.sum(0) if need_dbias else dbias
    if dbias is not None and par.gathers_grad and par.sum_sp_bias_grad and not gathered:  # each rank: its M/tp tokens
        all_reduce(dbias, par.group)
    if need_dx and dx_rows is None:
        _make_weight_transpose(s)
    # (the column path re-gathers the saved local shard: only when forward kept the shard)
    if par.overlap_dgrad and (par.mode == "row" or s.regather):
        dx2d, dy, dw = _overlapped_backward(s, dy, need_dx, need_dw)
    else:
        dx2d, dw = _backward(s, dy, need_dx, need_dw, dx_rows, gathered)
    if targets and dw is not None:
        _accumulate_main_grad(targets, dw)
        dw = None
    return dx2d, dw, dbias


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, plan, x_q=None, residual=None):
        # plan: a GemmPlan, in one argument: autograd's apply() walks every argument on each call (host time
        # of small layers). x_q: inp already cast
        # (linear_fwd's x_q); inp then only carries its gradient. residual: added in the GEMM's epilogue
        # (the output's shape; only where residual_in_gemm holds); its gradient is the output's.
        out_features, in_features = weight.shape
        flat = inp.dim() == 2  # (no reshape views of a 2-D input and output: host time of small layers)
        acc = None if residual is None else residual.view(-1, out_features)
        ctx.res_shape = None if residual is None else residual.shape
        y2d, ctx.s = linear_fwd(inp if flat else inp.reshape(-1, in_features), weight, bias, plan,
                                inp.dtype, x_q, acc)  # x [M or M/tp, K]
        ctx.inp_shape = inp.shape
        if flat:
            return y2d
        if inp.dim() == 1:
            return y2d.reshape(out_features)
        return y2d.reshape(-1, *inp.shape[1:-1], out_features)  # dim 0: s, s·tp (gathered) or s/tp (scattered)

    @staticmethod
    def backward(ctx, grad_out):
        s = ctx.s
        dy2d = grad_out.reshape(-1, grad_out.shape[-1]).to(s.act_dtype)  # [M or M/tp, N]
        need_dw = ctx.needs_input_grad[1] or bool(s.targets)
        dx2d, dw, dbias = linear_bwd(s, dy2d, ctx.needs_input_grad[0], need_dw,
                                          s.has_bias and ctx.needs_input_grad[2])
        if not keep_graph():
            ctx.s = None  # x and W as saved: free them now, not when the whole graph is released
        dx = None if dx2d is None else dx2d.reshape(ctx.inp_shape)
        needs = ctx.needs_input_grad  # (as many as apply() was given: the residual is the sixth)
        dres = grad_out.reshape(ctx.res_shape) if len(needs) > 5 and needs[5] else None
        return dx, dw, dbias, None, None, dres


class OneCallFP8Linear(torch.autograd.Function):
    """The forward of the plainest FP8 linear, one rank's y = x·Wᵀ (+ b) with x cast in the same native call
    (te_parallel::linear_fp8_fwd), for the host time of small layers; its backward is LinearFunction's.
    It saves what linear_fwd saves for this case. The caller (module.linear.Linear) has checked that the
    case is this one: no TP, no fused wgrad, a cast FP8 weight, an input the op takes. Call it through
    `run`."""

    @staticmethod
    def forward(ctx, inp, weight, bias, fp8):
        need_wgrad = weight.requires_grad
        y, data, data_t, scale_inv = _one_call_op(inp, bias, fp8, need_wgrad)
        s = LinearSaved()
        s.fp8, s.targets, s.par, s.act_dtype, s.regather = fp8, None, SINGLE, inp.dtype, False
        s.has_bias, s.weight_dtype = bias is not None, weight.dtype
        s.w_saved = fp8.weight_for_backward()
        s.x_saved = Float8Tensor(data_t.t(), scale_inv, data_t) if need_wgrad else None  # xᵀ only
        ctx.s, ctx.inp_shape = s, inp.shape
        return y if inp.dim() == 2 else y.view(*inp.shape[:-1], y.shape[1])

    backward = staticmethod(LinearFunction.backward)

    @staticmethod
    def run(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fp8) -> torch.Tensor:
        """y, issued with the least host work. With grad off nothing is saved, so the op runs alone (no
        autograd node). With grad on, the autograd node is made by torch's C entry of Function.apply,
        which is what `apply` calls when no functorch transform is active, less its Python wrapper
        (docs/benchmarks.md, "Host time")."""
        if not torch.is_grad_enabled():
            y = _one_call_op(inp, bias, fp8, False)[0]
            return y if inp.dim() == 2 else y.view(*inp.shape[:-1], y.shape[1])
        if _C_APPLY is None or torch._C._are_functorch_transforms_active():
            return OneCallFP8Linear.apply(inp, weight, bias, fp8)
        return _C_APPLY(_unwrap_if_dead(inp), weight, bias, fp8)


def _one_call_op(inp: torch.Tensor, bias: Optional[torch.Tensor], fp8, need_wgrad: bool):
    """The op of OneCallFP8Linear on inp's rows: (y [M, N], x data, x data_t or [0, M], x scale_inv)."""
    return fp8.linear_op(inp if inp.dim() == 2 else inp.view(-1, inp.shape[-1]), bias, need_wgrad)


# torch's C implementation of Function.apply, bound to OneCallFP8Linear (None where this torch lacks it:
# `apply` then runs). Function.apply adds to it only the functorch handling: dead-wrapper unwrapping, done
# here for the one input that can be a wrapper, and the transforms, which take `apply`.
_C_APPLY = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
_C_APPLY = None if _C_APPLY is None else _C_APPLY.__get__(None, OneCallFP8Linear)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def keep_graph() -> bool:
    """True while the running backward keeps the graph (retain_graph=True): saved operands must outlive it.
    (True where torch cannot tell, so nothing is freed early; and under torch.compile, whose compiled
    backward owns the saved tensors' lifetimes and may not write to objects saved by the forward.)"""
    if torch.compiler.is_compiling():
        return True
    fn = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if fn is None else bool(fn())


def _backward(s, dy, need_dx: bool, need_dw: bool, dx_rows=None, gathered: bool = False):
    """dgrad and wgrad with NCCL collectives (async where a GEMM can hide them; see the module doc).
    gathered: dy is already the gathered gradient (block scaling of shards whose tiles would not align)."""
    par, targets = s.par, s.targets
    if par.gathers_grad and not gathered:
        dy = _gather(dy, par.group)[0]
    if dx_rows is not None:
        return None, _wgrad_then_dgrad_rows(s, dy, need_dw, *dx_rows)
    x_full, x_handle = s.x_saved, None
    if need_dw and s.regather:
        x_full, x_handle = _gather(s.x_saved, par.group, async_op=True)  # overlaps dgrad
    dx2d, dx_handle = None, None
    if need_dx:
        dx2d = _dgrad(dy, s.w_saved, s.act_dtype, s.fp8)
        dx2d, dx_handle = _reduce_dgrad(dx2d, par)  # async, overlaps wgrad
    if need_dw and not keep_graph():
        _release_dgrad_operands(s, dy)
    dw = None
    if need_dw:
        if x_handle is not None:
            x_handle.wait()
        dw = _wgrad(dy, x_full, torch.float32 if targets else s.weight_dtype, s.fp8)
    if dx_handle is not None:
        dx_handle.wait()
    return dx2d, dw


def _release_dgrad_operands(s, dy) -> None:
    """After dgrad (if any), before wgrad allocates dW: drop the backward's Wᵀ and the row-major FP8 dy
    (wgrad reads only dy's transposed copy, made here if its cast did not make it). On the Llama layer's
    fc1 that is 2 × [tokens, ffn] bytes less at the step's peak (docs/fp8.md, "Saved operands are freed
    when their backward has run"). dy here is always this backward's own tensor; the caller checks that
    the graph is not kept."""
    s.w_saved = None
    if type(dy) is BlockwiseTensor:
        dy.drop_rowwise()
    elif isinstance(dy, Float8Tensor):
        dy.transposed()
        dy.data = dy.data_t.t()  # same shape, a view of the transposed bytes: the row-major ones are freed


def _make_weight_transpose(s) -> None:
    """Wᵀ for dgrad, made once per backward and dropped with it: from the cached FP8 W, or re-encoded
    from the high-precision weight (docs/fp8.md, "Which cast makes which transpose")."""
    if isinstance(s.w_saved, (Float8Tensor, WeightSource, BlockwiseTensor, BlockWeightSource)):
        s.w_saved = s.w_saved.with_transpose()


def _wgrad_then_dgrad_rows(s, dy, need_dw: bool, chunk: int, consume):
    """wgrad first, so that its operands (xᵀ, dyᵀ) are freed before dx exists; then dx chunk by chunk."""
    dw = _wgrad(dy, s.x_saved, torch.float32 if s.targets else s.weight_dtype, s.fp8) if need_dw else None
    if isinstance(dy, (Float8Tensor, BlockwiseTensor)):
        dy.data_t = None  # dyᵀ was wgrad's; this backward's own tensor
    if not keep_graph():
        s.x_saved = None
    _make_weight_transpose(s)  # only now: after wgrad has released its operands
    for r0 in range(0, _rows_of(dy), chunk):
        if type(dy) is BlockwiseTensor:
            rows = dy.row_slice(r0, min(r0 + chunk, _rows_of(dy)))
        elif isinstance(dy, Float8Tensor):
            rows = Float8Tensor(dy.data[r0 : r0 + chunk], dy.scale_inv)
        else:
            rows = dy[r0 : r0 + chunk]
        consume(r0, _dgrad(rows, s.w_saved, s.act_dtype, s.fp8))
    return dw


def _overlapped_backward(s, dy, need_dx: bool, need_dw: bool):
    """Backward with comm-GEMM overlap; returns (dx2d, dy as used, dw)."""
    par, targets = s.par, s.targets
    wdtype = torch.float32 if targets else s.weight_dtype
    dx2d, dw = None, None
    if par.mode == "row":  # dy [m, N] gathered chunk by chunk under dgrad; the whole dy kept for wgrad
        n_in = s.w_saved.shape[1]
        if need_dx:
            mm = _mm(s.fp8, "fp8_gemm_dgrad")
            dg = lambda a, out: ov.dgrad_into(a, s.w_saved, out, mm=mm)  # noqa: E731
            w_t = (Float8Tensor(s.w_saved.transposed(), s.w_saved.scale_inv)  # B = Wᵀ [K, N] (FP8 keeps one)
                   if isinstance(s.w_saved, Float8Tensor) else None)
            dx2d, dy_full = ov.ag_gemm(par.ub, dy, dg, n_in, s.act_dtype, keep_gathered=need_dw, w=w_t, mm=mm,
                                       cfg=par.ub_dgrad)
        else:
            dy_full = _gather(dy, par.group)[0]
        if need_dw:
            dw = _wgrad(dy_full, s.x_saved, wdtype, s.fp8)
        return dx2d, dy_full, dw
    # column: x re-gathered under dgrad; dx reduce-scattered under wgrad (bulk) or pipelined with dgrad
    bulk = ov.BulkBackward(par.ub, s.x_saved if need_dw else None)
    mm = _mm(s.fp8, "fp8_gemm_dgrad")
    if need_dx and par.ub_rs_dgrad:
        dx2d = ov.dgrad_rs(par.ub, dy, s.w_saved, s.act_dtype, par.ub_dgrad, mm)
    elif need_dx:
        rows = _rows_of(dy)
        bulk.dgrad_rs(dy, s.w_saved, rows, s.w_saved.shape[1], s.act_dtype, _device_of(dy), mm)
    if need_dw:
        dw = _wgrad(dy, bulk.x_full(), wdtype, s.fp8)
    if need_dx and dx2d is None:
        dx2d = bulk.dx_local()
    return dx2d, dy, dw


def _rows_of(t) -> int:
    return t.shape[0] if type(t) is BlockwiseTensor else t.data.shape[0] if isinstance(t, Float8Tensor) else t.shape[0]


def _device_of(t) -> torch.device:
    if type(t) is BlockwiseTensor:
        return (t.data if t.data is not None else t.data_t).device
    return t.data.device if isinstance(t, Float8Tensor) else t.device


def _only_transposed(q: Float8Tensor) -> Float8Tensor:
    """Keep only xᵀ for wgrad (data becomes a view of it: no extra bytes)."""
    data_t = q.transposed()
    return Float8Tensor(data_t.t(), q.scale_inv, data_t)


def _reduce_dgrad(dx2d: torch.Tensor, par: LinearParallel):
    """Column-parallel dx is a partial sum over the N shards: all-reduce, or reduce-scatter under SP."""
    if not (par.active and par.mode == "column"):
        return dx2d, None
    if par.sequence_parallel:
        return reduce_scatter_dim0(dx2d, par.group, async_op=True)
    return dx2d, all_reduce(dx2d, par.group, async_op=True)
