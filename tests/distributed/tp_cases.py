"""Tensor/sequence-parallel modules vs a single-process model built from the unsharded weights.

Every rank builds the reference (same seed → same weights and data everywhere), builds the TP
module, copies its shards in, runs two steps (the first sets delayed scales, then an in-place
"optimizer step" on both) and compares outputs, input gradient and every parameter gradient
with the matching slices of the reference. Exact (torch.equal) where no reduction crosses ranks,
else relative error below TOL. FP8 states must be bit-identical on all ranks after every step.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe as R
from tests.distributed.harness import agree
from tests.reference import rel_err

S, B, H, N = 16, 4, 32, 128  # sequence, batch, hidden (in), out / ffn (TP=8 shards: 16, FP8's minimum)
RECIPES = {"off": None, "delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling(),
           "block": R.Float8BlockScaling()}
# Block scaling: sizes at which every rank's tiles are the one process's (out / ffn shards and sequence shards of
# whole 128-row tiles at TP=2 and 4), so the TP modules quantize exactly as the reference does; BLOCK_DIMS_GATHER_HP
# has sequence shards of 96 rows at TP=2 (the high-precision gather, then the cast).
BLOCK_DIMS = (64, 8, 128, 512)
BLOCK_DIMS_GATHER_HP = (48, 4, 128, 512)


def tol(recipe_name: str, device: torch.device) -> float:
    if recipe_name == "off":
        return 1e-5
    return 1.2e-2 if device.type == "cuda" else 5e-4


@dataclass(frozen=True)
class Case:
    module: str  # linear-column, linear-row, lnlinear-column, mlp, mlp-chunked (fused backward in row chunks)
    sp: bool
    bias: bool
    recipe: str

    def __str__(self) -> str:
        return f"{self.module} sp={self.sp} bias={self.bias} fp8={self.recipe}"


def all_cases():
    mods = ["linear-column", "linear-row", "lnlinear-column", "mlp"]
    recipes = [r for r in RECIPES if r != "block"]  # (block scaling: block_cases, at sizes of whole tiles)
    cases = [Case(*c) for c in itertools.product(mods, [False, True], [True, False], recipes)]
    return cases + [Case("mlp-chunked", sp, bias, rec) for sp in (False, True) for bias in (True, False) for rec in recipes]


def block_cases():
    """Every module kind under Float8BlockScaling, with and without SP (bias on: gelu MLP; off: swiglu)."""
    mods = ["linear-column", "linear-row", "lnlinear-column", "mlp"]
    return [Case(m, sp, bias, "block") for m in mods for sp in (False, True) for bias in (True, False)]


def _chunk_16_rows(module) -> None:
    """mlp-chunked: the fused MLP backward makes fc2's dgrad output 16 rows at a time (ops/mlp.py)."""
    w2 = module.fc2_weight  # [hidden, ffn on this rank]: a row of fc2's input is ffn elements
    module.bwd_chunk_bytes = 16 * w2.shape[1] * w2.element_size()


@contextlib.contextmanager
def _mlp_chunks(case: Case):
    """mlp-chunked: counts the row chunks of the MLP backward (_chunk_16_rows set them up)."""
    if case.module != "mlp-chunked":
        yield
        return
    from te_parallel.ops import mlp

    real_fp8, real_hp = mlp.GemmFP8.cast_dactivation_rows, mlp._dact_into
    chunks = []
    mlp.GemmFP8.cast_dactivation_rows = lambda self, *a: chunks.append(1) or real_fp8(self, *a)
    mlp._dact_into = lambda *a: chunks.append(1) or real_hp(*a)
    try:
        yield
    finally:
        mlp.GemmFP8.cast_dactivation_rows, mlp._dact_into = real_fp8, real_hp
    assert len(chunks) > 1, f"{case}: the MLP backward did not run in row chunks ({len(chunks)})"


def _build(case: Case, tp: int, group, device, dims=(S, B, H, N)):
    H, N = dims[2], dims[3]
    kw = dict(bias=case.bias, device=device)
    tpkw = dict(tp_group=group, tp_size=tp, sequence_parallel=case.sp)
    act = "gelu" if case.bias else "swiglu"
    if case.module.startswith("mlp"):
        init = dict(init_method=lambda w: torch.nn.init.normal_(w, 0, 0.1))
        mods = (te.LayerNormMLP(H, N, activation=act, **init, **kw),
                te.LayerNormMLP(H, N, activation=act, set_parallel_mode=True, **tpkw, **kw))
        for m in mods if case.module == "mlp-chunked" else ():
            _chunk_16_rows(m)
        return mods
    if case.module == "lnlinear-column":
        return te.LayerNormLinear(H, N, **kw), te.LayerNormLinear(H, N, parallel_mode="column", **tpkw, **kw)
    mode = case.module.split("-")[1]
    k, n = (H, N) if mode == "column" else (N, H)
    return te.Linear(k, n, **kw), te.Linear(k, n, parallel_mode=mode, **tpkw, **kw)


def _shard(name: str, full: torch.Tensor, case: Case, r: int, tp: int) -> torch.Tensor:
    """This rank's piece of a reference parameter (or gradient)."""
    col = case.module in ("linear-column", "lnlinear-column")
    if name.startswith("layer_norm") or (name == "bias" and not col) or name == "fc2_bias":
        return full
    if name in ("weight", "bias") and col:
        return full.chunk(tp, 0)[r]
    if name == "weight":  # row
        return full.chunk(tp, 1)[r]
    if name == "fc2_weight":
        return full.chunk(tp, 1)[r]
    if case.bias:  # fc1 (gelu): rows of this rank
        return full.chunk(tp, 0)[r]
    a, b = full.chunk(2, 0)  # fc1 (swiglu): [a_r; b_r]
    return torch.cat([a.chunk(tp, 0)[r], b.chunk(tp, 0)[r]])


def _io_slices(case: Case, r: int, tp: int):
    """Slicers for (input, output) from the full tensors to what this rank holds."""
    seq = (lambda t: t.chunk(tp, 0)[r]) if case.sp else (lambda t: t)
    last = lambda t: t.chunk(tp, -1)[r]  # noqa: E731
    if case.module == "linear-row":
        return (lambda t: last(t)), seq  # input split on features; output sequence-sharded under SP
    if case.module.startswith("mlp"):
        return seq, seq
    return seq, last  # column: input sequence-sharded under SP; output split on features


def _state_identical_on_all_ranks(module, group) -> None:
    for name, buf in module.fp8_state.named_buffers():
        bits = buf.contiguous().view(torch.int32 if buf.dtype == torch.float32 else buf.dtype)
        everyone = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, bits, group=group)
        assert all(torch.equal(everyone[0], e) for e in everyone), f"fp8_state.{name} differs across ranks"


def run_case(case: Case, r: int, tp: int, group, device, dims=(S, B, H, N)) -> None:
    torch.manual_seed(1000)
    S, B = dims[0], dims[1]
    ref, mod = _build(case, tp, group, device, dims)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            p.copy_(_shard(name, dict(ref.named_parameters())[name], case, r, tp))
    recipe = RECIPES[case.recipe]
    in_sl, out_sl = _io_slices(case, r, tp)
    t = tol(case.recipe, device)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(S, B, ref_in(ref), generator=g) * 2).to(device)
        dy = torch.randn(S, B, ref_out(ref), generator=g).to(device)
        x_ref, x_tp = x.clone().requires_grad_(True), in_sl(x).clone().requires_grad_(True)
        for m, xi, gi in ((ref, x_ref, dy), (mod, x_tp, out_sl(dy))):
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = m(xi)
            with _mlp_chunks(case):
                y.backward(gi)
            if m is ref:
                y_ref = y
            else:
                y_tp = y
        if recipe is not None:  # the collective first: a failed comparison on one rank must not hang the rest
            _state_identical_on_all_ranks(mod, group)

        def local_checks():
            _compare(case, "output", y_tp, out_sl(y_ref), t, exact=_exact_out(case))
            _compare(case, "input grad", x_tp.grad, in_sl(x_ref.grad), t, exact=False)
            for name, p in mod.named_parameters():
                full = dict(ref.named_parameters())[name].grad
                _compare(case, f"grad {name}", p.grad, _shard(name, full, case, r, tp), t, exact=False)
        agree(group, device, local_checks)
        with torch.no_grad():  # "optimizer step" on both: recasts weights with the new scales
            for m in (ref, mod):
                for p in m.parameters():
                    p.mul_(1.01)
                m.zero_grad(set_to_none=True)


def ref_in(m) -> int:
    return m.hidden_size if hasattr(m, "hidden_size") else m.in_features


def ref_out(m) -> int:
    return m.hidden_size if hasattr(m, "hidden_size") else m.out_features


def _exact_out(case: Case) -> bool:
    """Column-parallel forward: each rank computes its own output columns, nothing is summed across ranks."""
    return case.recipe == "off" and case.module in ("linear-column", "lnlinear-column")


def _compare(case, what, got, want, t, exact) -> None:
    assert got is not None, f"{what} is None"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if exact:
        assert torch.equal(got, want), f"{what}: not bit-exact (rel err {rel_err(got.cpu(), want.cpu()):.2e})"
    else:
        err = rel_err(got.cpu(), want.cpu())
        assert err < t, f"{what}: relative error {err:.2e} >= {t:.0e}"
