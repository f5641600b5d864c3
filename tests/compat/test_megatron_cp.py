"""Megatron-core's context parallelism through the compat package: its GPTModel on the TE spec at
context_parallel_size=2 (gloo, 2 processes), the batch cut by Megatron's get_batch_on_this_cp_rank, with the
p2p, all_gather and a2a cp_comm_types and under FP8 (delayed scaling). TE's DotProductAttention gets Megatron's
cp_group, cp_global_ranks, cp_stream and cp_comm_type; the losses are finite and falling, and the losses and the
gradient norms are those of context_parallel_size=1 from the same seed."""
from tests.compat import stand_in

stand_in.require()

import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (.ci/install_clients.sh installs it)")

from tests.compat.megatron_cases import CP_CASES, SEQ  # noqa: E402
from tests.distributed.harness import spawn  # noqa: E402

# Relative difference CP=2 vs CP=1. fp32: the same sums cut in two halves (the ring's blocks merged by their
# log-sum-exp in fp32, the gradients of the two halves averaged by Megatron's DDP): ~1e-7 measured, 1e-5 allowed.
# FP8 (delayed scaling): the first forward matches to 1e-7 (the amaxes are reduced over TP x DP x CP, so both
# layouts quantize with the same scales), but a CP rank's loss is the mean of half the tokens, so the gradients its
# backward quantizes are twice CP=1's, and at the first step's scale of 1 a factor of 2 moves small values across
# E5M2's subnormal range: measured 2e-3 on the gradient norms and 1e-4 on the losses of later steps.
CP_TOL = {"cp-fp8-delayed": 1e-3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.compat.megatron_cases import cp_worker

    path = str(tmp_path_factory.mktemp("mcore_cp") / "cp.pt")
    spawn(cp_worker, 2, path, list(CP_CASES), cpu=True)  # (a CPU suite: gloo, also on a GPU host)
    return torch.load(path)


@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp2_trains(runs, name):
    r = runs[2][name]
    losses = r["losses"]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.05, f"loss is not falling: {losses}"
    assert r["tokens"] == SEQ // 2  # this rank's chunks of the sequence
    # every layer's attention ran context-parallel with Megatron's comm type over the two ranks
    comm = CP_CASES[name]["cp_comm_type"]
    assert r["attention"] == [(comm, 2, [0, 1])] * 2, r["attention"]
    assert runs[1][name]["attention"] == []
    if name.startswith("cp-fp8"):
        assert r["fp8_modules"] == 8, r


@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp2_matches_cp1(runs, name):
    tol = CP_TOL.get(name, 1e-5)
    a, b = runs[1][name], runs[2][name]
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        assert abs(x - y) <= tol * abs(x), f"step {step}: CP=1 {x} vs CP=2 {y} (tol {tol})"
    # the gradients too: Adam would hide a wrong scale (a CP rank's gradient summed instead of averaged)
    for step, (x, y) in enumerate(zip(a["grad_norms"], b["grad_norms"])):
        assert abs(x - y) <= 10 * tol * x, f"step {step}: gradient norm CP=1 {x} vs CP=2 {y}"
