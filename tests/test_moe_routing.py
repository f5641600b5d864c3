"""MoE routing helpers (te_parallel.ops.moe_permute, moe_router, module.fp8_padding) against plain fp64
references: python loops over tokens and experts, gradients by autograd through those loops, and
torch.autograd.gradcheck of every differentiable input.

Tests taking `device` run the functions there (tests/conftest.py: the CPU; a tests/gpu re-export: CUDA)
and compare on the CPU, where the references run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import te_parallel as te
from te_parallel import recipe as R

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# References.
# ----------------------------------------------------------------------------------------------------

def ref_order_mask(routing_map):
    """The permuted buffer's slots (t, e): expert by expert, tokens in order."""
    n, e = routing_map.shape
    return [(t, x) for x in range(e) for t in range(n) if bool(routing_map[t, x])]


def ref_order_index(indices):
    """The permuted buffer's slots (t, k): by expert index, ties in (t, k) order (a stable sort)."""
    n, k = indices.shape
    slots = [(t, j) for t in range(n) for j in range(k)]
    return sorted(slots, key=lambda s: int(indices[s]))


def ref_permute(x, slots, num_out, probs=None):
    """Rows x[t] of the first num_out slots (zeros past the routed count, and where probs[t, c] == 0)."""
    kept = slots[:num_out] + [None] * max(num_out - len(slots), 0)
    rows, row_probs = [], []
    for s in kept:
        if s is None or (probs is not None and float(probs[s].detach()) == 0.0):
            rows.append(torch.zeros(x.shape[1], dtype=x.dtype))
        else:
            rows.append(x[s[0]])
        if probs is not None:
            row_probs.append(probs[s] if s is not None else torch.zeros((), dtype=probs.dtype))
    out = torch.stack(rows) if rows else x.new_zeros((0, x.shape[1]))
    if probs is None:
        return out, kept
    return out, torch.stack(row_probs) if row_probs else probs.new_zeros(0), kept


def ref_unpermute(y, kept, num_tokens, weights=None):
    out = [torch.zeros(y.shape[1], dtype=y.dtype) for _ in range(num_tokens)]
    for j, s in enumerate(kept):
        if s is not None:
            out[s[0]] = out[s[0]] + (weights[s] if weights is not None else 1.0) * y[j]
    return torch.stack(out) if out else y.new_zeros((0, y.shape[1]))


def random_mask(n, e, topk, gen=None):
    m = torch.zeros(n, e, dtype=torch.bool)
    for t in range(n):
        m[t, torch.randperm(e, generator=gen)[:topk]] = True
    return m


def random_index(n, e, topk):
    return torch.stack([torch.randperm(e)[:topk] for _ in range(n)]).to(torch.int32) if n else \
        torch.zeros(0, topk, dtype=torch.int32)


def leaf(t, device=None):
    """A fresh leaf copy of t (on device, when given) that requires grad."""
    return t.detach().to(device or t.device, copy=True).requires_grad_(True)


def cpu(*tensors):
    return [None if t is None else t.detach().cpu() for t in tensors]


def grads(out, upstream, *inputs):
    return torch.autograd.grad(out, inputs, upstream, allow_unused=True)


# ----------------------------------------------------------------------------------------------------
# moe_permute / moe_unpermute.
# ----------------------------------------------------------------------------------------------------

def test_row_id_map_format_mask(device):
    """The documented format on TE's own example: row_id_map[t, e] = the permuted row, -1 off the map."""
    routing_map = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.int32)
    x = torch.arange(10.0).view(5, 2)
    out, row_id_map = te.moe_permute(x.to(device), routing_map.to(device), num_out_tokens=7)
    assert row_id_map.dtype == torch.int64
    assert row_id_map.tolist() == [[0, 3, -1], [1, -1, 5], [-1, -1, 6], [2, 4, -1], [-1, -1, -1]]
    assert out[:, 0].tolist() == [0, 2, 6, 0, 6, 2, 4]


@pytest.mark.parametrize("num_out", ["default", "exact", "drop", "extra"])
def test_permute_mask_forward_and_backward(num_out, device):
    n, e, h, topk = 9, 5, 4, 2
    x_ref = leaf(torch.randn(n, h, dtype=F64))
    routing_map = random_mask(n, e, topk)
    routing_map[:, 3] = False  # an expert with no tokens
    slots = ref_order_mask(routing_map)
    count = {"default": len(slots), "exact": len(slots), "drop": len(slots) - 5, "extra": len(slots) + 3}[num_out]
    x = leaf(x_ref, device)
    out, row_id_map = te.moe_permute(x, routing_map.to(device), num_out_tokens=-1 if num_out == "default" else count)
    ref, kept = ref_permute(x_ref, slots, count)
    assert torch.equal(out.cpu(), ref)
    up = torch.randn_like(ref)
    torch.testing.assert_close(grads(out, up.to(device), x)[0].cpu(), grads(ref, up, x_ref)[0])
    # unpermute sums each token's kept rows back
    y_ref = leaf(torch.randn(count, h, dtype=F64))
    y = leaf(y_ref, device)
    back = te.moe_unpermute(y, row_id_map, restore_shape=(n, h))
    back_ref = ref_unpermute(y_ref, kept, n)
    torch.testing.assert_close(back.cpu(), back_ref)
    up = torch.randn_like(back_ref)
    torch.testing.assert_close(grads(back, up.to(device), y)[0].cpu(), grads(back_ref, up, y_ref)[0])


@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("drop", [0, 4])
def test_permute_index_forward_and_backward(topk, drop, device):
    n, e, h = 8, 4, 3
    x_ref = leaf(torch.randn(n, h, dtype=F64))
    indices = random_index(n, e, topk)
    slots = ref_order_index(indices)
    count = n * topk - drop
    x = leaf(x_ref, device)
    out, row_id_map = te.moe_permute(x, indices.to(device), num_out_tokens=count if drop else -1, map_type="index")
    ref, kept = ref_permute(x_ref, slots, count)
    assert torch.equal(out.cpu(), ref)
    up = torch.randn_like(ref)
    torch.testing.assert_close(grads(out, up.to(device), x)[0].cpu(), grads(ref, up, x_ref)[0])
    # unpermute with merging probs [N, topK]
    probs_ref, y_ref = leaf(torch.rand(n, topk, dtype=F64)), leaf(torch.randn(count, h, dtype=F64))
    probs, y = leaf(probs_ref, device), leaf(y_ref, device)
    back = te.moe_unpermute(y, row_id_map, merging_probs=probs, map_type="index")
    back_ref = ref_unpermute(y_ref, kept, n, probs_ref)
    torch.testing.assert_close(back.cpu(), back_ref)
    up = torch.randn_like(back_ref)
    for g, g_ref in zip(grads(back, up.to(device), y, probs), grads(back_ref, up, y_ref, probs_ref)):
        torch.testing.assert_close(g.cpu(), torch.zeros_like(g.cpu()) if g_ref is None else g_ref)


def test_num_out_tokens_as_a_0_dim_tensor(device):
    routing_map, x = random_mask(6, 4, 2).to(device), torch.randn(6, 3, device=device)
    want, _ = te.moe_permute(x, routing_map, num_out_tokens=9)
    got, _ = te.moe_permute(x, routing_map, num_out_tokens=torch.tensor(9))
    got_p, _, _ = te.moe_permute_with_probs(x, routing_map.float(), routing_map, num_out_tokens=torch.tensor(9))
    assert torch.equal(got, want) and torch.equal(got_p, want)


def test_index_map_num_out_zero_means_all_rows(device):
    indices = random_index(6, 4, 2)
    x = torch.randn(6, 3, dtype=F64)
    out0, _ = te.moe_permute(x.to(device), indices.to(device), num_out_tokens=0, map_type="index")
    ref, _ = ref_permute(x, ref_order_index(indices), 12)
    assert torch.equal(out0.cpu(), ref)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_round_trip_with_and_without_probs(map_type, device):
    n, e, h, topk = 10, 6, 5, 3
    x = torch.randn(n, h, dtype=F64, device=device)
    routing_map = random_mask(n, e, topk) if map_type == "mask" else random_index(n, e, topk)
    routing_map = routing_map.to(device)
    permuted, row_id_map = te.moe_permute(x, routing_map, map_type=map_type)
    plain = te.moe_unpermute(permuted, row_id_map, map_type=map_type)
    torch.testing.assert_close(plain, topk * x)
    shape = (n, e) if map_type == "mask" else (n, topk)
    probs = torch.rand(shape, dtype=F64, device=device)
    if map_type == "mask":
        probs = probs * routing_map
    probs = probs / probs.sum(dim=1, keepdim=True)
    merged = te.moe_unpermute(permuted, row_id_map, merging_probs=probs, restore_shape=x.shape, map_type=map_type)
    torch.testing.assert_close(merged, x)


def test_permute_with_probs_forward_backward_and_padding(device):
    """Slots whose prob is 0 (capacity padding) come out as zero rows and pass no gradient to inp."""
    n, e, h = 7, 4, 3
    routing_map = random_mask(n, e, 2)
    probs = torch.rand(n, e, dtype=F64) * routing_map
    pad = routing_map.nonzero()[:3]
    probs[pad[:, 0], pad[:, 1]] = 0.0  # three routed slots are padding
    x_ref, p_ref = leaf(torch.randn(n, h, dtype=F64)), leaf(probs)
    x, p = leaf(x_ref, device), leaf(p_ref, device)
    out, pp, row_id_map = te.moe_permute_with_probs(x, p, routing_map.to(device))
    slots = ref_order_mask(routing_map)
    ref, ref_pp, kept = ref_permute(x_ref, slots, len(slots), p_ref)
    assert torch.equal(out.cpu(), ref) and torch.equal(pp.cpu(), ref_pp)
    assert (out.abs().sum(dim=1) == 0).sum() == 3
    up, up_p = torch.randn_like(ref), torch.randn_like(ref_pp)
    got = cpu(*torch.autograd.grad((out, pp), (x, p), (up.to(device), up_p.to(device))))
    want = torch.autograd.grad((ref, ref_pp), (x_ref, p_ref), (up, up_p))
    for g, g_ref in zip(got, want):
        torch.testing.assert_close(g, g_ref)
    # the probs' gradient lands on the routed slots only
    assert torch.equal(got[1] != 0, routing_map)


def test_permute_with_probs_dropping_and_unpermute_merge(device):
    n, e, h = 8, 4, 2
    routing_map = random_mask(n, e, 2)
    probs = (torch.rand(n, e, dtype=F64) + 0.1) * routing_map
    x = torch.randn(n, h, dtype=F64)
    count = int(routing_map.sum()) - 3
    out, pp, row_id_map = te.moe_permute_with_probs(x.to(device), probs.to(device), routing_map.to(device),
                                                    num_out_tokens=count)
    ref, ref_pp, kept = ref_permute(x, ref_order_mask(routing_map), count, probs)
    assert torch.equal(out.cpu(), ref) and torch.equal(pp.cpu(), ref_pp)
    merged = te.moe_unpermute(out * pp.unsqueeze(1), row_id_map, restore_shape=x.shape)
    torch.testing.assert_close(merged.cpu(), ref_unpermute(ref, kept, n, probs))


def test_empty_and_single_token_experts(device):
    n, e, h = 5, 4, 3
    routing_map = torch.zeros(n, e, dtype=torch.bool, device=device)
    routing_map[2, 1] = True  # expert 1: one token; experts 0, 2, 3: none
    x = leaf(torch.randn(n, h, dtype=F64), device)
    out, row_id_map = te.moe_permute(x, routing_map, num_out_tokens=1)
    assert torch.equal(out, x[2:3].detach())
    out.sum().backward()
    assert x.grad.cpu().tolist() == [[float(t == 2)] * h for t in range(n)]
    back = te.moe_unpermute(out, row_id_map, merging_probs=torch.full((n, e), 0.5, dtype=F64, device=device))
    want = torch.zeros_like(x).index_copy_(0, torch.tensor([2], device=device), 0.5 * x[2:3].detach())
    torch.testing.assert_close(back, want)
    for map_type, rmap in (("mask", torch.zeros(0, e, dtype=torch.bool)),
                           ("index", torch.zeros(0, 2, dtype=torch.int32))):
        empty, rim = te.moe_permute(torch.zeros(0, h, device=device), rmap.to(device), map_type=map_type)
        assert empty.shape == (0, h)
        assert te.moe_unpermute(empty, rim, map_type=map_type).shape == (0, h)


def test_bf16_sums_round_once(device):
    """Unpermute of bf16 rows with fp32 probs accumulates in fp32: within one bf16 rounding of the fp64 sum."""
    n, e, h = 16, 8, 64
    routing_map = random_mask(n, e, 4)
    x = torch.randn(n, h).to(torch.bfloat16)
    probs = torch.rand(n, e) * routing_map
    permuted, row_id_map = te.moe_permute(x.to(device), routing_map.to(device))
    got = te.moe_unpermute(permuted, row_id_map, merging_probs=probs.to(device))
    want = x.double() * probs.double().sum(dim=1, keepdim=True)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_gradcheck_permute_unpermute(map_type, device):
    n, e, h, topk = 5, 3, 2, 2
    rmap = (random_mask(n, e, topk) if map_type == "mask" else random_index(n, e, topk)).to(device)
    num_out = n * topk - 2  # with dropping
    x = leaf(torch.randn(n, h, dtype=F64), device)
    assert torch.autograd.gradcheck(lambda a: te.moe_permute(a, rmap, num_out, map_type=map_type)[0], (x,))
    _, row_id_map = te.moe_permute(x, rmap, num_out, map_type=map_type)
    y = leaf(torch.randn(num_out, h, dtype=F64), device)
    w = leaf(torch.rand(row_id_map.shape, dtype=F64), device)
    assert torch.autograd.gradcheck(lambda a, b: te.moe_unpermute(a, row_id_map, b, map_type=map_type), (y, w))
    assert torch.autograd.gradcheck(lambda a: te.moe_unpermute(a, row_id_map, map_type=map_type), (y,))


def test_gradcheck_permute_with_probs(device):
    n, e, h = 5, 3, 2
    rmap = random_mask(n, e, 2).to(device)
    x, p = leaf(torch.randn(n, h, dtype=F64), device), leaf(torch.rand(n, e, dtype=F64) + 0.1, device)
    fn = lambda a, b: te.moe_permute_with_probs(a, b, rmap, num_out_tokens=8)[:2]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, p))


def test_permute_and_pad_with_probs(device):
    n, e, h, align = 9, 3, 2, 4
    routing_map = random_mask(n, e, 2)
    probs = (torch.rand(n, e, dtype=F64) + 0.1) * routing_map
    x = leaf(torch.randn(n, h, dtype=F64), device)
    counts = routing_map.sum(dim=0)
    out, pp, row_id_map, pad_offsets, padded = te.moe_permute_and_pad_with_probs(
        x, probs.to(device), routing_map.to(device), counts.to(device), align)
    want_sizes = [(int(c) + align - 1) // align * align for c in counts]
    assert padded.tolist() == want_sizes and out.shape == (sum(want_sizes), h)
    start, x_cpu, out_cpu, pp_cpu = 0, *cpu(x, out, pp)
    for expert, size in enumerate(want_sizes):  # each expert: its tokens in order, then zero rows
        tokens = [t for t in range(n) if routing_map[t, expert]]
        block = out_cpu[start:start + size]
        assert torch.equal(block[:len(tokens)], x_cpu[tokens]) and not block[len(tokens):].any()
        assert torch.equal(pp_cpu[start:start + len(tokens)], probs[tokens, expert])
        start += size
    shifts = [sum(w - int(c) for w, c in zip(want_sizes[:i], counts[:i])) for i in range(e)]
    assert pad_offsets is None and not any(shifts) or pad_offsets.tolist() == shifts
    back = te.moe_unpermute(out, row_id_map, merging_probs=probs.to(device), restore_shape=x.shape,
                            pad_offsets=pad_offsets)
    torch.testing.assert_close(back.cpu(), x_cpu * probs.sum(dim=1, keepdim=True))
    back.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), probs.sum(dim=1, keepdim=True).expand(n, h))
    aligned = torch.full((e,), align, device=device)
    rmap = torch.zeros(align * e // 2, e, dtype=torch.bool, device=device)
    rmap[torch.arange(rmap.shape[0]).repeat(2), torch.arange(e).repeat_interleave(align)] = True
    *_, no_pad, _ = te.moe_permute_and_pad_with_probs(torch.randn(rmap.shape[0], h, device=device), rmap.double(),
                                                      rmap, aligned, align)
    assert no_pad is None


# ----------------------------------------------------------------------------------------------------
# moe_sort_chunks_by_index.
# ----------------------------------------------------------------------------------------------------

def ref_sort_chunks(x, split_sizes, sorted_index):
    chunks, start = [], 0
    for size in split_sizes:
        chunks.append(x[start:start + size])
        start += size
    return torch.cat([chunks[i] for i in sorted_index])


@pytest.mark.parametrize("ep, experts", [(1, 3), (2, 3), (4, 2)])
def test_sort_chunks_by_index_with_probs(ep, experts, device):
    """[rank][expert] chunks (some empty, some of one row) to [expert][rank] and back."""
    gen = torch.Generator().manual_seed(ep)
    sizes = torch.randint(0, 4, (ep * experts,), generator=gen)
    sizes[0], sizes[-1] = 0, 1
    order = torch.arange(ep * experts).view(ep, experts).t().reshape(-1)
    rows = int(sizes.sum())
    x_ref, p_ref = leaf(torch.randn(rows, 3, dtype=F64)), leaf(torch.rand(rows, dtype=F64))
    x, p, sizes_d, order_d = leaf(x_ref, device), leaf(p_ref, device), sizes.to(device), order.to(device)
    out, out_p = te.moe_sort_chunks_by_index_with_probs(x, p, sizes_d, order_d)
    ref = ref_sort_chunks(x_ref, sizes.tolist(), order.tolist())
    ref_p = ref_sort_chunks(p_ref, sizes.tolist(), order.tolist())
    assert torch.equal(out.cpu(), ref) and torch.equal(out_p.cpu(), ref_p)
    up, up_p = torch.randn_like(ref), torch.randn_like(ref_p)
    for g, g_ref in zip(cpu(*torch.autograd.grad((out, out_p), (x, p), (up.to(device), up_p.to(device)))),
                        torch.autograd.grad((ref, ref_p), (x_ref, p_ref), (up, up_p))):
        assert torch.equal(g, g_ref)
    inverse = torch.empty_like(order_d).scatter_(0, order_d, torch.arange(order.numel(), device=device))
    back = te.moe_sort_chunks_by_index(out, sizes_d[order_d], inverse)
    assert torch.equal(back, x)
    assert torch.autograd.gradcheck(lambda a, b: te.moe_sort_chunks_by_index_with_probs(a, b, sizes_d, order_d), (x, p))


# ----------------------------------------------------------------------------------------------------
# Router.
# ----------------------------------------------------------------------------------------------------

def ref_choose(values, topk, num_groups=None, group_topk=None):
    """Indices of the topk largest values, among the experts of the group_topk best groups."""
    candidates = list(range(len(values)))
    if group_topk:
        size = len(values) // num_groups
        group_score = [sum(sorted(values[g * size:(g + 1) * size], reverse=True)[:topk // group_topk])
                       for g in range(num_groups)]
        best = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
        candidates = [i for g in best for i in range(g * size, (g + 1) * size)]
    return sorted(candidates, key=lambda i: -values[i])[:topk]


def ref_score(x, score_function):
    if score_function == "softmax":
        return torch.exp(x) / torch.exp(x).sum()
    if score_function == "sigmoid":
        return 1 / (1 + torch.exp(-x))
    return torch.log1p(torch.exp(x)).sqrt()


def ref_router(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias):
    rows, maps = [], []
    for t in range(logits.shape[0]):
        x = logits[t]
        if score_function == "softmax" and not use_pre_softmax:
            chosen = ref_choose(x.tolist(), topk, num_groups, group_topk)
            vals = ref_score(x[chosen], "softmax")
        else:
            s = ref_score(x, score_function)
            select = (s + expert_bias) if expert_bias is not None else s
            chosen = ref_choose(select.tolist(), topk, num_groups, group_topk)
            vals = s[chosen]
            if score_function != "softmax" and topk > 1:
                vals = vals / (vals.sum() + 1e-20)
        if scaling_factor is not None:
            vals = vals * scaling_factor
        row = torch.zeros(logits.shape[1], dtype=logits.dtype)
        rows.append(row.index_put((torch.tensor(chosen),), vals))
        maps.append(torch.zeros(logits.shape[1], dtype=torch.bool).index_fill_(0, torch.tensor(chosen), True))
    return torch.stack(rows), torch.stack(maps)


ROUTER_CASES = [
    # topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, bias
    (2, False, None, None, None, "softmax", False),
    (3, True, None, None, 2.5, "softmax", False),
    (1, False, None, None, None, "sigmoid", False),
    (4, False, None, None, 1.5, "sigmoid", True),
    (4, False, 4, 2, None, "sigmoid", True),
    (4, True, 4, 2, None, "softmax", False),
    (3, False, 4, 3, None, "softmax", False),
    (2, False, None, None, None, "sqrtsoftplus", True),
]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_topk_with_score_function(case, device):
    topk, pre, groups, gtopk, scale, fn, bias = case
    t, e = 12, 16
    logits_ref = leaf(torch.randn(t, e, dtype=F64))
    expert_bias = torch.randn(e, dtype=F64) * 0.5 if bias else None
    bias_d = None if expert_bias is None else expert_bias.to(device)
    logits = leaf(logits_ref, device)
    probs, routing_map = te.fused_topk_with_score_function(logits, topk, pre, groups, gtopk, scale, fn, bias_d)
    ref, ref_map = ref_router(logits_ref, topk, pre, groups, gtopk, scale, fn, expert_bias)
    assert torch.equal(routing_map.cpu(), ref_map) and routing_map.dtype == torch.bool
    assert torch.equal(probs != 0, routing_map)
    torch.testing.assert_close(probs.cpu(), ref)
    up = torch.randn_like(ref)
    torch.testing.assert_close(grads(probs, up.to(device), logits)[0].cpu(), grads(ref, up, logits_ref)[0])
    small = leaf(torch.randn(3, e, dtype=F64), device)
    assert torch.autograd.gradcheck(
        lambda a: te.fused_topk_with_score_function(a, topk, pre, groups, gtopk, scale, fn, bias_d)[0], (small,))


def test_expert_bias_changes_the_choice_only(device):
    logits = torch.randn(6, 8, dtype=F64, device=device)
    bias = torch.zeros(8, dtype=F64, device=device)
    bias[7] = 10.0  # expert 7 always chosen
    probs, routing_map = te.fused_topk_with_score_function(logits, 2, False, None, None, None, "sigmoid", bias)
    assert routing_map[:, 7].all()
    s = torch.sigmoid(logits)
    chosen = s * routing_map
    torch.testing.assert_close(probs, chosen / chosen.sum(dim=1, keepdim=True))


def test_router_keeps_dtype_and_leading_dims(device):
    logits = torch.randn(2, 3, 8, device=device).to(torch.bfloat16)
    probs, routing_map = te.fused_topk_with_score_function(logits, 2, False, None, None, None, "softmax", None)
    assert probs.dtype == torch.bfloat16 and probs.shape == (2, 3, 8) and routing_map.shape == (2, 3, 8)
    routing_map, scores = te.fused_compute_score_for_moe_aux_loss(logits, 2, "sigmoid")
    assert scores.dtype == torch.float32 and scores.shape == (2, 3, 8)


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("topk", [1, 3])
def test_compute_score_for_aux_loss(fn, topk, device):
    t, e = 10, 6
    logits_ref = leaf(torch.randn(t, e, dtype=F64))
    logits = leaf(logits_ref, device)
    routing_map, scores = te.fused_compute_score_for_moe_aux_loss(logits, topk, fn)
    ref_scores, ref_map = [], []
    for i in range(t):
        s = ref_score(logits_ref[i], fn)
        if fn != "softmax":  # normalized whatever topk is
            s = s / (s.sum() + 1e-20)
        ref_scores.append(s)
        chosen = torch.tensor(ref_choose(s.tolist(), topk))
        ref_map.append(torch.zeros(e, dtype=torch.bool).index_fill_(0, chosen, True))
    ref = torch.stack(ref_scores)
    assert torch.equal(routing_map.cpu(), torch.stack(ref_map))
    torch.testing.assert_close(scores.cpu(), ref)
    up = torch.randn_like(ref)
    torch.testing.assert_close(grads(scores, up.to(device), logits)[0].cpu(), grads(ref, up, logits_ref)[0])
    assert torch.autograd.gradcheck(lambda a: te.fused_compute_score_for_moe_aux_loss(a, topk, fn)[1],
                                    (leaf(torch.randn(3, e, dtype=F64), device),))


@pytest.mark.parametrize("total_kind", ["int", "int tensor", "float tensor"])
def test_moe_aux_loss(total_kind, device):
    t, e, topk, coeff, total = 7, 5, 2, 0.01, 21
    probs = leaf(torch.rand(t, e, dtype=F64), device)
    tokens_per_expert = torch.randint(0, 10, (e,))
    total_arg = {"int": total, "int tensor": torch.tensor(total, device=device),  # (Megatron: a count / topk)
                 "float tensor": torch.tensor(2.0 * total, device=device) / 2}[total_kind]
    loss = te.fused_moe_aux_loss(probs, tokens_per_expert.to(device), total_arg, e, topk, coeff)
    ref, probs_cpu = 0.0, probs.detach().cpu()
    for x in range(e):
        for i in range(t):
            ref = ref + float(probs_cpu[i, x]) * int(tokens_per_expert[x])
    ref = ref * e * coeff / (topk * total * total)
    assert loss.dim() == 0 and loss.dtype == F64
    assert abs(float(loss.detach()) - ref) <= 1e-12 * abs(ref)
    (g,) = torch.autograd.grad(loss, probs)
    want = (e * coeff / (topk * total * total) * tokens_per_expert.double()).expand(t, e)
    torch.testing.assert_close(g.cpu(), want)
    tpe = tokens_per_expert.to(device)
    assert torch.autograd.gradcheck(lambda p: te.fused_moe_aux_loss(p, tpe, total_arg, e, topk, coeff), (probs,))
    assert te.fused_moe_aux_loss(probs.float(), tpe, total, e, topk, coeff).dtype == torch.float32


# ----------------------------------------------------------------------------------------------------
# Fp8Padding / Fp8Unpadding.
# ----------------------------------------------------------------------------------------------------

def ref_pad(x, m_splits, align):
    parts, start = [], 0
    for m in m_splits:
        padded = (m + align - 1) // align * align
        parts += [x[start:start + m], torch.zeros(padded - m, x.shape[1], dtype=x.dtype)]
        start += m
    return torch.cat(parts)


@pytest.mark.parametrize("align", [None, 4, 16])
def test_fp8_padding_round_trip_and_gradients(align, device):
    m_splits = [0, 1, 5, 16, 3]
    x = leaf(torch.randn(sum(m_splits), 3, dtype=F64), device)
    pad, unpad = te.Fp8Padding(5, align_size=align), te.Fp8Unpadding(5, align_size=align)
    out, padded = pad(x, m_splits)
    a = align or 16
    assert padded == [(m + a - 1) // a * a for m in m_splits] and pad.align_size == a
    assert torch.equal(out.cpu(), ref_pad(x.detach().cpu(), m_splits, a))
    back = unpad(out, m_splits)
    assert torch.equal(back, x)
    up = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, up)[0], unpad(up, m_splits))
    assert torch.autograd.gradcheck(lambda t: pad(t, m_splits)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: unpad(t, m_splits), (leaf(out),))


def test_fp8_padding_no_padding_returns_inputs(device):
    x = torch.randn(32, 4, device=device)
    out, splits = te.Fp8Padding(2)(x, [16, 16])
    assert out is x and splits == [16, 16]
    assert te.Fp8Unpadding(2)(x, [16, 16]) is x


@pytest.mark.parametrize("recipe, align", [(R.DelayedScaling(), 16), (R.Float8CurrentScaling(), 16),
                                           (R.Float8BlockScaling(), 128)])
def test_fp8_padding_align_from_recipe(recipe, align):
    pad = te.Fp8Padding(2)
    with te.fp8_autocast(fp8_recipe=recipe):
        out, padded = pad(torch.randn(10, 4), [3, 7])
    assert pad.align_size == align and padded == [align, align] and out.shape == (2 * align, 4)
    with te.fp8_autocast(fp8_recipe=R.Float8BlockScaling()):
        pad(torch.randn(10, 4), [3, 7])
    assert pad.align_size == align  # decided once, on the first forward (TE's rule)


# ----------------------------------------------------------------------------------------------------
# Errors: one line, what was given and what is needed, before any work.
# ----------------------------------------------------------------------------------------------------

def _bad_calls():
    x, rmap = torch.randn(4, 3), random_mask(4, 5, 2)
    _, row_id_map = te.moe_permute(x, rmap)
    return [
        (lambda: te.moe_permute(x, rmap[:3]), "routing_map is \\(3, 5\\)"),
        (lambda: te.moe_permute(x, rmap.float()), "must be bool or integer"),
        (lambda: te.moe_permute(x, rmap, map_type="dense"), "map_type must be one of"),
        (lambda: te.moe_permute(x[0], rmap), "inp is \\(3,\\)"),
        (lambda: te.moe_permute(x, rmap, num_out_tokens=2.0), "num_out_tokens must be an int"),
        (lambda: te.moe_permute(x, rmap.int(), map_type="index").__len__(), None),  # integer index map is fine
        (lambda: te.moe_permute(x, rmap, map_type="index"), "must be integer"),
        (lambda: te.moe_permute_with_probs(x, torch.rand(4, 4), rmap), "probs is \\(4, 4\\)"),
        (lambda: te.moe_unpermute(x, row_id_map.int()), "need the int64"),
        (lambda: te.moe_unpermute(torch.randn(8, 3), row_id_map, restore_shape=(5, 3)), "restore_shape is"),
        (lambda: te.moe_unpermute(torch.randn(8, 3), row_id_map, merging_probs=torch.rand(4, 2)),
         "merging_probs is \\(4, 2\\)"),
        (lambda: te.moe_unpermute(torch.randn(8, 3), row_id_map, torch.rand(4, 5), probs=torch.rand(4, 5)),
         "both merging_probs and probs"),
        (lambda: te.moe_sort_chunks_by_index(x, torch.tensor([1, 2]), torch.tensor([1, 0])), "sum to 3"),
        (lambda: te.moe_sort_chunks_by_index(x, torch.tensor([2, 2]), torch.tensor([0])), "one length"),
        (lambda: te.moe_sort_chunks_by_index_with_probs(x, torch.rand(3), [2, 2], [1, 0]), "probs is \\(3,\\)"),
        (lambda: te.moe_permute_and_pad_with_probs(x, torch.rand(4, 5), rmap, torch.ones(5), 0), "align_size"),
        (lambda: te.fused_topk_with_score_function(torch.randn(4, 8), 9, False, None, None, None, "softmax", None),
         "topk is 9"),
        (lambda: te.fused_topk_with_score_function(torch.randn(4, 8), 2, False, None, None, None, "relu", None),
         "score_function must be one of"),
        (lambda: te.fused_topk_with_score_function(torch.randn(4, 8), 2, False, None, None, None, "softmax",
                                                   torch.zeros(8)), "expert_bias is used with"),
        (lambda: te.fused_topk_with_score_function(torch.randn(4, 8), 2, False, None, None, None, "sigmoid",
                                                   torch.zeros(7)), "expert_bias is \\(7,\\)"),
        (lambda: te.fused_topk_with_score_function(torch.randn(4, 8), 2, False, 3, 1, None, "sigmoid", None),
         "needs num_groups"),
        (lambda: te.fused_topk_with_score_function(torch.randn(4, 8), 4, False, 4, 1, None, "sigmoid", None),
         "group_topk is 1"),
        (lambda: te.fused_topk_with_score_function(torch.zeros(4, 8, dtype=torch.int64), 2, False, None, None, None,
                                                   "softmax", None), "floating-point"),
        (lambda: te.fused_compute_score_for_moe_aux_loss(torch.randn(4, 8), 0, "softmax"), "topk is 0"),
        (lambda: te.fused_moe_aux_loss(torch.rand(4, 8), torch.ones(7), 4, 8, 2, 0.1), "tokens_per_expert is"),
        (lambda: te.fused_moe_aux_loss(torch.rand(4, 8), torch.ones(8), 0, 8, 2, 0.1), "total_num_tokens"),
        (lambda: te.fused_moe_aux_loss(torch.rand(4, 8), torch.ones(8), torch.ones(2), 8, 2, 0.1), "0-dim"),
        (lambda: te.Fp8Padding(0), "num_gemms"),
        (lambda: te.Fp8Padding(2, align_size=0), "align_size"),
        (lambda: te.Fp8Padding(2)(x, [1, 2]), "inp has 4 rows; m_splits sum to 3"),
        (lambda: te.Fp8Padding(2)(x, [4]), "need 2 ints"),
        (lambda: te.Fp8Unpadding(2)(x, [1, 3]), "inp has 4 rows"),
    ]


def test_bad_inputs_raise_one_line_value_errors():
    for call, match in _bad_calls():
        if match is None:
            call()
            continue
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)


# ----------------------------------------------------------------------------------------------------
# A fuzz over shapes and drop counts, and the compat re-exports.
# ----------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 9), e=st.integers(1, 5), data=st.data())
def test_fuzz_permute_unpermute(n, e, data):
    map_type = data.draw(st.sampled_from(["mask", "index"]))
    topk = data.draw(st.integers(1, e))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    x = torch.randn(n, 3, dtype=F64, generator=gen)
    if map_type == "mask":
        rmap = torch.rand(n, e, generator=gen) < data.draw(st.floats(0.0, 1.0))
        slots = ref_order_mask(rmap)
    else:
        rmap = torch.randint(0, e, (n, topk), generator=gen)
        slots = ref_order_index(rmap)
    num_out = data.draw(st.integers(0, len(slots) + 2))
    if map_type == "index" and num_out == 0:
        num_out = len(slots)
    out, row_id_map = te.moe_permute(x, rmap, num_out_tokens=num_out, map_type=map_type)
    ref, kept = ref_permute(x, slots, num_out)
    assert torch.equal(out, ref)
    w = torch.rand(row_id_map.shape, dtype=F64, generator=gen)
    torch.testing.assert_close(te.moe_unpermute(out, row_id_map, w, map_type=map_type), ref_unpermute(ref, kept, n, w))


def test_compat_names_are_te_parallel_functions():
    code = ("import te_parallel as tp\n"
            "import transformer_engine.pytorch as te\n"
            "from transformer_engine.pytorch import permutation, router\n"
            "from transformer_engine.pytorch.module.fp8_padding import Fp8Padding\n"
            "from transformer_engine.pytorch.module.fp8_unpadding import Fp8Unpadding\n"
            "assert te.moe_permute is tp.moe_permute and te.moe_unpermute is tp.moe_unpermute\n"
            "assert te.moe_sort_chunks_by_index_with_probs is tp.moe_sort_chunks_by_index_with_probs\n"
            "assert permutation.moe_permute_and_pad_with_probs is tp.moe_permute_and_pad_with_probs\n"
            "assert router.fused_topk_with_score_function is tp.fused_topk_with_score_function\n"
            "assert router.fused_moe_aux_loss is tp.fused_moe_aux_loss\n"
            "assert te.Fp8Padding is Fp8Padding is tp.Fp8Padding and te.Fp8Unpadding is Fp8Unpadding\n")
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "compat"))
    try:
        from transformer_engine._real_te import find_real_te
    finally:
        sys.path.remove(str(root / "compat"))
    if find_real_te(p for p in sys.path if isinstance(p, str)) is not None:
        pytest.skip("NVIDIA's Transformer Engine is installed here, and compat refuses to load beside it")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "compat"), str(root)]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
