"""Context parallelism, CP = 2 and 4, launched from pytest (gloo on CPU, NCCL on GPUs).

Every comm type ("p2p", "all_gather", "a2a"; "a2a+p2p" at CP = 4 as 2 × 2) on bshd, sbhd and thd (packed
sequences of uneven lengths, one empty, each padded to a multiple of 2·cp), causal and without a mask,
sliding windows where the comm type takes them, GQA (4 query heads, 2 key heads; 1 key head for the
a2a head-repeat path): DotProductAttention on each rank's load-balanced shard against one process holding
the whole sequence, outputs and the gradients of q, k, v. fp64: to 1e-10; bf16: within 2× the error of the
same one-process run in bf16, both against fp64. Then TransformerLayer / MultiheadAttention (RoPE, GQA) the
same way, with every parameter's gradient summed over the CP ranks; then the one-line errors.
"""
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel.parallel import context_parallel as cpm
from tests.distributed.harness import Checks, spawn
from tests.reference import rel_err

H, G, D, B = 4, 2, 16, 2


@dataclass(frozen=True)
class Case:
    comm: str
    fmt: str
    mask: str
    window: Optional[Tuple[int, int]] = None
    groups: int = G
    cross: bool = False  # keys twice as long as the queries

    def __str__(self) -> str:
        extra = (f" window={self.window}" if self.window else "") + (" cross" if self.cross else "")
        return f"{self.comm} {self.fmt} {self.mask}{extra} kv_heads={self.groups}"


def cases(cp_size: int):
    comms = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if cp_size == 4 else [])
    for comm in comms:
        for fmt in ("bshd", "sbhd", "thd"):
            for mask, window in (("causal", None), ("no_mask", None), ("causal", (3, 0)), ("no_mask", (2, 2))):
                if window and (comm not in ("a2a", "all_gather") or fmt == "sbhd"):
                    continue  # (windows: a2a and all_gather only; sbhd's windows are bshd's, transposed)
                if window and fmt == "thd" and mask == "no_mask" and comm == "all_gather":
                    continue  # refused (see _errors)
                yield Case(comm, fmt, mask, window)
        yield Case(comm, "bshd", "no_mask", cross=True)
    yield Case("a2a", "bshd", "causal", groups=1)
    if cp_size == 4:
        yield Case("a2a+p2p", "thd", "causal", groups=1)


class Groups:
    """One CP group as this rank sees it: the group, this rank's place in it and its size, the members'
    global ranks, and (CP = 4) the same ranks as an [a2a group, p2p group] pair of 2 × 2 (global rank =
    p2p_rank · 2 + a2a_rank, so that the layout's rank is the rank in the group)."""

    def __init__(self, group, rank: int, size: int, global_ranks, pair=None) -> None:
        self.group, self.rank, self.size, self.global_ranks, self.pair = group, rank, size, list(global_ranks), pair

    def for_comm(self, comm: str):
        return self.pair if comm == "a2a+p2p" else self.group


def _cp_groups(world: int):
    """CP = world over every rank; with 4 ranks also CP = 2 over ranks {0, 1} and {2, 3} (one launch for both)."""
    rank, everyone = dist.get_rank(), dist.new_group(list(range(world)))
    if world != 4:
        return [Groups(everyone, rank, world, range(world))]
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = halves[rank // 2]
    return [Groups(everyone, rank, 4, range(4), pair=[mine, columns[rank % 2]]),
            Groups(mine, rank % 2, 2, (2 * (rank // 2), 2 * (rank // 2) + 1))]


def _lengths(cp_size: int):
    return [10, 0, 3, 16] if cp_size == 2 else [10, 0, 3, 21]


def _inputs(case: Case, cp_size: int, device):
    """Full q, k, v, dout in fp64 (the same on every rank) and the packed sequences' boundaries."""
    gen = torch.Generator().manual_seed(11)
    seqs = None
    if case.fmt == "thd":
        cu = torch.nn.functional.pad(torch.tensor(_lengths(cp_size)).cumsum(0), (1, 0)).to(torch.int32)
        cu_pad = cpm.pad_cu_seqlens(cu, cp_size)
        shape = lambda n: (int(cu_pad[-1]), n, D)  # noqa: E731
        seqs = dict(cu_seqlens_q=cu.to(device), cu_seqlens_q_padded=cu_pad.to(device), max_seqlen_q=max(_lengths(cp_size)))
    else:
        s = 8 * cp_size
        shape = (lambda n, m=1: (s * m, B, n, D)) if case.fmt == "sbhd" else (lambda n, m=1: (B, s * m, n, D))  # noqa: E731
    kv_len = dict(m=2) if case.cross else {}
    q, k, v = (torch.randn(shape(n, **({} if i == 0 else kv_len)), generator=gen, dtype=torch.float64)
               for i, n in enumerate((H, case.groups, case.groups)))
    dout = torch.randn(*q.shape[:-2], H * D, generator=gen, dtype=torch.float64)
    return [t.to(device) for t in (q, k, v, dout)], seqs


def _shard(x, case: Case, seqs, rank: int, cp_size: int):
    if case.fmt == "thd":
        return cpm.shard_thd(x, seqs["cu_seqlens_q_padded"], rank, cp_size)
    return cpm.shard_sequence(x, 0 if case.fmt == "sbhd" else 1, rank, cp_size)


def _gather(x, case: Case, seqs, group, cp_size: int):
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if case.fmt == "thd":
        return cpm.unshard_thd(parts, seqs["cu_seqlens_q_padded"])
    return cpm.unshard_sequence(parts, 0 if case.fmt == "sbhd" else 1)


def _run(dpa, tensors, seqs, dtype):
    q, k, v, dout = (t.detach().to(dtype) for t in tensors)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = dpa(q, k, v, **(seqs or {}))
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _attention_case(case: Case, groups: Groups, device):
    rank, cp_size = groups.rank, groups.size
    full, seqs = _inputs(case, cp_size, device)
    kw = dict(num_gqa_groups=case.groups, qkv_format=case.fmt, attn_mask_type=case.mask, window_size=case.window)
    one = te.DotProductAttention(H, D, **kw)
    cp = te.DotProductAttention(H, D, cp_group=groups.for_comm(case.comm), cp_global_ranks=groups.global_ranks,
                                cp_comm_type=case.comm, **kw)
    local = [_shard(t, case, seqs, rank, cp_size) for t in full]
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        got = [_gather(t, case, seqs, groups.group, cp_size) for t in _run(cp, local, seqs, dtype)]
        results[dtype] = (got, _run(one, full, seqs, dtype))
    ref = results[torch.float64][1]
    names = ("out", "dq", "dk", "dv")
    for name, got, want in zip(names, results[torch.float64][0], ref):
        err = rel_err(got, want)
        assert err < 1e-10, f"fp64 {name}: relative error {err:.2e}"
    for name, got, same, want in zip(names, results[torch.bfloat16][0], results[torch.bfloat16][1], ref):
        err, base = rel_err(got, want), rel_err(same, want)
        assert err <= 2 * base + 1e-6, f"bf16 {name}: relative error {err:.2e} > 2 × {base:.2e} (one process, bf16)"


def _params(m):
    return {n: p for n, p in m.named_parameters()}


def _module_case(kind: str, comm: str, groups: Groups, device):
    """TransformerLayer (sbhd, causal, GQA, RoPE) or MultiheadAttention (thd, causal, GQA, RoPE) under CP against
    one process: output, input gradient and every parameter gradient (summed over the CP ranks)."""
    rank, cp_size = groups.rank, groups.size
    hidden, s = 64, 8 * cp_size
    torch.manual_seed(5)
    kw = dict(num_gqa_groups=G, params_dtype=torch.float64, device=device)
    if kind == "layer":
        fused = dict(fuse_qkv_params=True) if comm == "p2p" else {}  # (RoPE inside the fused QKV split)
        make = lambda **cp: te.TransformerLayer(hidden, 128, H, hidden_dropout=0.0, attention_dropout=0.0,  # noqa: E731
                                                self_attn_mask_type="causal", **fused, **kw, **cp)
        case, seqs = Case(comm, "sbhd", "causal"), None
        x = torch.randn(s, B, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    else:
        make = lambda **cp: te.MultiheadAttention(hidden, H, attention_dropout=0.0, attn_mask_type="causal",  # noqa: E731
                                                  qkv_format="thd", input_layernorm=True, **kw, **cp)
        case = Case(comm, "thd", "causal")
        _, seqs = _inputs(case, cp_size, device)
        x = torch.randn(int(seqs["cu_seqlens_q_padded"][-1]), hidden, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1)).to(device)
    one = make()
    cp = make(cp_group=groups.for_comm(comm), cp_global_ranks=groups.global_ranks, cp_comm_type=comm)
    cp.load_state_dict(one.state_dict())
    rope = te.RotaryPositionEmbedding(D)(x.shape[0] if kind == "mha" else s).to(device)
    fwd = dict(rotary_pos_emb=rope, **(seqs or {}))
    x_one, x_cp = x.clone().requires_grad_(True), _shard(x, case, seqs, rank, cp_size).requires_grad_(True)
    y_one, y_cp = one(x_one, **fwd), cp(x_cp, **fwd)
    dy = torch.randn(y_one.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
    y_one.backward(dy)
    y_cp.backward(_shard(dy, case, seqs, rank, cp_size))
    out, dx = (_gather(t, case, seqs, groups.group, cp_size) for t in (y_cp.detach(), x_cp.grad))
    grads = {n: p.grad.clone() for n, p in _params(cp).items()}
    for g in grads.values():
        dist.all_reduce(g, group=groups.group)
    assert rel_err(out, y_one) < 1e-10, f"output: {rel_err(out, y_one):.2e}"
    assert rel_err(dx, x_one.grad) < 1e-10, f"input gradient: {rel_err(dx, x_one.grad):.2e}"
    for n, p in _params(one).items():
        assert rel_err(grads[n], p.grad) < 1e-10, f"{n}.grad: {rel_err(grads[n], p.grad):.2e}"


def _expect(match: str, fn) -> None:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert "\n" not in str(info.value), str(info.value)


def _errors(groups: Groups, device):
    """One-line errors, raised on every rank before any collective."""
    g, cp_size = groups.group, groups.size
    x = lambda s, n=H: torch.randn(B, s, n, D, device=device)  # noqa: E731
    dpa = lambda **kw: te.DotProductAttention(H, D, num_gqa_groups=kw.pop("groups", H), qkv_format="bshd",  # noqa: E731
                                              cp_group=g, **kw)
    _expect(rf"sequence length must be divisible by 2·cp = {2 * cp_size}", lambda: dpa()(x(3), x(3), x(3)))
    _expect("sliding windows .* use cp_comm_type 'a2a' or 'all_gather'",
            lambda: dpa(window_size=(4, 0))(x(4), x(4), x(4)))
    _expect("attn_mask_type='padding' is not supported .* use qkv_format='thd'",
            lambda: dpa(attn_mask_type="padding")(x(4), x(4), x(4), attention_mask=torch.zeros(B, 1, 1, 4, dtype=torch.bool,
                                                                                                device=device)))
    _expect("attention dropout .* is not supported", lambda: dpa(attention_dropout=0.1)(x(4), x(4), x(4)))
    heads = cp_size + 1
    _expect(f"{heads} attention heads on this rank are not divisible by the {cp_size} ranks",
            lambda: te.DotProductAttention(heads, D, qkv_format="bshd", cp_group=g, cp_comm_type="a2a")(
                x(4, heads), x(4, heads), x(4, heads)))
    _expect("a causal mask or sliding window with different query and key sequences",
            lambda: dpa()(x(4), x(6), x(6)))
    _expect(rf"cp_global_ranks has {cp_size + 1} ranks but cp_group has {cp_size}",
            lambda: dpa(cp_global_ranks=groups.global_ranks + [99]))
    _expect("cp_global_ranks=.* does not match cp_group", lambda: dpa(cp_global_ranks=groups.global_ranks[::-1]))
    cu = torch.tensor([0, 3, 8 * cp_size], dtype=torch.int32, device=device)
    thd = torch.randn(8, H, D, device=device)
    _expect(rf"slot must be a multiple of 2·cp = {2 * cp_size}", lambda: te.DotProductAttention(
        H, D, qkv_format="thd", cp_group=g)(thd, thd, thd, cu_seqlens_q=cu))
    pad = cpm.pad_cu_seqlens(cu, cp_size)
    win = te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="no_mask", window_size=(2, 2), cp_group=g,
                                 cp_comm_type="all_gather")
    t = int(pad[-1]) // cp_size
    _expect("a sliding window without a causal mask is not supported", lambda: win(
        *(torch.randn(t, H, D, device=device) for _ in range(3)), cu_seqlens_q=cu, cu_seqlens_q_padded=pad))


def _suite(rank, world, device):
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share CI's cores: spinning OpenMP threads slow these small ops ~100×
    checks = Checks(rank)
    for groups in _cp_groups(world):
        cp = f"cp={groups.size}"
        for case in cases(groups.size):
            checks.run(f"{cp} {case}", _attention_case, case, groups, device)
        for comm in ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if groups.pair else []):
            checks.run(f"{cp} TransformerLayer {comm}", _module_case, "layer", comm, groups, device)
        for comm in ("p2p", "a2a"):
            checks.run(f"{cp} MultiheadAttention thd {comm}", _module_case, "mha", comm, groups, device)
        checks.run(f"{cp} errors", _errors, groups, device)
    checks.raise_if_failed()


def _launches():
    """4 ranks run CP = 4 and, in two groups of 2, CP = 2 (one launch: CI's time); a machine with 2 or 3 GPUs
    (NCCL needs a GPU per rank) runs CP = 2 alone."""
    gpus = 0 if os.environ.get("TE_PARALLEL_TEST_DEVICE") == "cpu" else torch.cuda.device_count()
    return [pytest.param(2, id="cp2")] if 2 <= gpus < 4 else [pytest.param(4, id="cp4+cp2")]


@pytest.mark.parametrize("world", _launches())
def test_context_parallel(world):
    spawn(_suite, world)
