"""Comm-GEMM overlap (initialize_ub + ub_* flags): overlapped == non-overlapped, outputs and gradients.

On CPU (gloo) the overlap runs its torch.distributed point-to-point fallback; on GPUs with peer access
(NCCL group) it runs over CUDA IPC + copy engines. Equality: bit-exact where each output element comes
from one GEMM on both paths and nothing is summed across ranks (column fprop, row dgrad; the chunks of
an AG+GEMM are separate GEMMs over fewer rows, which cuBLAS/CPU BLAS compute row-independently at these
shapes); where partials are summed across ranks (row fprop, column dgrad) the order of that sum may
differ from NCCL's, so the tolerance is a few units in the last place of the activation dtype. The FP8
all-gather ring on GPUs runs te_parallel's own cuBLASLt call (one native call per op) while the
reference runs torch._scaled_mm, whose kernel may differ: there the same tolerance applies.
"""
import os
import subprocess
import warnings

import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel.ops import linear_overlap
from te_parallel import recipe as R
from tests.distributed.harness import Checks, spawn, worlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _recipe(name):
    return {"off": None, "delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling()}[name]


def _run(module, x, dy, recipe):
    x = x.clone().requires_grad_(True)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _compare(name, got, want, exact_out, exact_dx, tol):
    (y, dx, grads), (y0, dx0, grads0) = got, want

    def check(what, a, b, exact):
        if exact:
            assert torch.equal(a, b), f"{name}: {what} differs (max {(a.float() - b.float()).abs().max().item():.3g})"
        else:  # against the tensor's largest element: NCCL's ring reduce-scatter rounds its running bf16 sum
            # at each of tp-1 hops, so where partials cancel an element's error is relative to the partials,
            # not to the element (seen at TP=4: 0.25 on an element of ~5); a wrong chunk errs by O(max)
            err, top = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
            assert err <= tol * max(top, 1.0), f"{name}: {what} max diff {err:.3g} > {tol} x max |ref| {top:.3g}"

    check("output", y, y0, exact_out)
    check("dx", dx, dx0, exact_dx)
    for n in grads0:
        # wgrad / dbias never cross ranks differently on the two paths (same gathered operands)
        check(f"grad {n}", grads[n], grads0[n], exact_out and exact_dx)


def _linear_case(mode, bias, recipe_name, rank, world, group, device, ub, seq=64, hidden=64, rs_dgrad=False):
    dtype = _dtype(device)
    gen = torch.Generator().manual_seed(1)
    ffn = 96 * world
    in_f, out_f = (hidden, ffn) if mode == "column" else (ffn, hidden)
    kw = dict(parallel_mode=mode, sequence_parallel=True, tp_group=group, bias=bias, params_dtype=dtype, device=device)
    ref = te.Linear(in_f, out_f, **kw)
    flags = dict(ub_overlap_ag=True) if mode == "column" else dict(ub_overlap_rs=True, ub_overlap_ag=True)
    if rs_dgrad:  # column backward: dx's reduce-scatter pipelined with dgrad instead of bulk under wgrad
        flags["ub_overlap_rs_dgrad"] = True
    ovl = te.Linear(in_f, out_f, ub_comm=ub, ub_name="qkv" if mode == "column" else "proj", **flags, **kw)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), ovl.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen).to(dtype))
            q.copy_(p)
    rows_in = seq // world if mode == "column" else seq
    rows_out = seq if mode == "column" else seq // world
    local_in = in_f if mode == "column" else in_f // world
    local_out = out_f // world if mode == "column" else out_f
    x_all = torch.randn(world, rows_in, 2, local_in, generator=gen).to(dtype)
    dy_all = torch.randn(world, rows_out, 2, local_out, generator=gen).to(dtype)
    x, dy = x_all[rank].to(device), dy_all[rank].to(device)
    recipe = _recipe(recipe_name)
    want = _run(ref, x, dy, recipe)
    before = dict(ub.counts)
    pipelined = []
    dgrad_rs = linear_overlap.dgrad_rs
    linear_overlap.dgrad_rs = lambda *a, **k: (pipelined.append(1), dgrad_rs(*a, **k))[1]
    try:
        got = _run(ovl, x, dy, recipe)
    finally:
        linear_overlap.dgrad_rs = dgrad_rs
    assert len(pipelined) == int(rs_dgrad), f"ub_overlap_rs_dgrad={rs_dgrad}: pipelined dgrad ran {len(pipelined)}x"
    # column: AG in fprop, AG(x) + RS(dx) in backward; row: RS in fprop, AG(dy) in backward
    want_ops = {"all_gather": 2, "reduce_scatter": 1} if mode == "column" else {"all_gather": 1, "reduce_scatter": 1}
    assert {k: ub.counts[k] - before[k] for k in before} == want_ops, (ub.counts, before)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    name = f"Linear {mode} bias={bias} fp8={recipe_name}{' rs_dgrad' if rs_dgrad else ''}"
    # FP8 AG+GEMM through the native schedule runs te_parallel's cuBLASLt call, the reference torch's
    # _scaled_mm: two callers of cuBLASLt whose kernels may differ, so no bit-exactness is claimed
    exact = not (recipe is not None and ub.transport_name == "ipc" and _native_schedule(ub))
    _compare(name, got, want, exact_out=(mode == "column" and exact), exact_dx=(mode == "row" and exact), tol=tol)
    if recipe_name == "delayed":  # the overlapped path fed the same amaxes into the scale update
        assert torch.equal(ovl.fp8_state.fwd_scale, ref.fp8_state.fwd_scale), name


def _native_schedule(ub):
    from te_parallel.native import gemm as native_gemm

    return ub.default.native_schedule and native_gemm.usable()


def _transformer_case(recipe_name, rank, world, group, device, ub, seq=64, hidden=128, rs_dgrad=False):
    dtype = _dtype(device)
    torch.manual_seed(3)
    kw = dict(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=8, hidden_dropout=0.0,
              attention_dropout=0.0, tp_group=group, sequence_parallel=True, set_parallel_mode=True,
              params_dtype=dtype, device=device)
    ref = te.TransformerLayer(**kw)
    ovl = te.TransformerLayer(ub_tp_comm_overlap=True, ub_comm=ub, ub_overlap_rs_dgrad=rs_dgrad, **kw)
    ovl.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(world, seq // world, 2, hidden, generator=gen).to(dtype)[rank].to(device)
    dy = torch.randn(world, seq // world, 2, hidden, generator=gen).to(dtype)[rank].to(device)
    recipe = _recipe(recipe_name)
    want = _run(ref, x, dy, recipe)
    before = dict(ub.counts)
    got = _run(ovl, x, dy, recipe)
    # qkv + fc1 (column): 2 AG + 1 RS each; proj + fc2 (row): 1 AG + 1 RS each
    assert {k: ub.counts[k] - before[k] for k in before} == {"all_gather": 6, "reduce_scatter": 4}, ub.counts
    tol = (8e-2 if recipe else 3e-2) if dtype == torch.bfloat16 else (1e-4 if recipe is None else 5e-2)
    _compare(f"TransformerLayer fp8={recipe_name} rs_dgrad={rs_dgrad}", got, want, exact_out=False, exact_dx=False,
             tol=tol)


def _primitives(rank, world, group, device, ub):
    """all_gather chunk by chunk and reduce_scatter by slot against plain collectives."""
    dtype = _dtype(device)
    x = (torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16) + 1000 * rank).to(dtype).to(device)
    handle = ub.all_gather(x, torch.empty(8 * world, 16, dtype=dtype, device=device))
    for src in range(world):
        want = (torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16) + 1000 * src).to(dtype).to(device)
        assert torch.equal(handle.chunk(src), want), f"all_gather chunk {src}"
    full = handle.wait()
    ref = torch.empty_like(full)
    dist.all_gather_into_tensor(ref, x, group=group)
    assert torch.equal(full, ref), "all_gather whole"
    parts = torch.randn(world, 8 * world, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    rs = ub.reduce_scatter(8 * world, 16, dtype, device)
    for k in range(1, world + 1):
        d = (rank + k) % world
        rs.slot(d).copy_(parts[rank, d * 8 : (d + 1) * 8].to(device))
        rs.ready(d)
    out = rs.finish(dtype)
    want = parts.float().sum(0)[rank * 8 : (rank + 1) * 8].to(dtype)
    assert torch.equal(out.cpu(), want), f"reduce_scatter max diff {(out.cpu().float() - want.float()).abs().max()}"
    for _ in range(3):  # repeated ops reuse the shared buffers: the ready/busy handshake keeps them apart
        y = ub.all_gather(x + 1, torch.empty(8 * world, 16, dtype=dtype, device=device)).wait()
        assert torch.equal(y[rank * 8 : (rank + 1) * 8], x + 1)


def _transport_state(ub) -> dict:
    """The transport's attributes: the objects, and a copy of each dict or list (shallow)."""
    return {k: (v, dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else None)
            for k, v in vars(ub.transport).items()}


def _replayed_sequence(rank, world, group, device, ub):
    """The same recorded sequence of ops, issued again and again (what replays of a captured graph
    do): bit-identical results every time, and the transport unchanged (it keeps no per-op state that
    a replay would leave stale)."""
    from te_parallel.ops import linear_overlap as ov

    dtype = _dtype(device)
    gen = torch.Generator().manual_seed(21)
    x_all = torch.randn(world, 32, 64, generator=gen).to(dtype)
    w = torch.randn(48, 64, generator=gen).to(dtype).to(device)
    w2 = torch.randn(64, 48, generator=gen).to(dtype).to(device)
    x = x_all[rank].to(device)
    cfg = te.OverlapConfig(rs_pieces=2, rs_min_piece_rows=16, native_schedule=False)

    def sequence():
        y = ov.ag_gemm(ub, x, lambda a, out: ov.fprop_into(a, w, None, out), 48, dtype, keep_gathered=False)[0]
        z = ov.gemm_rs(ub, y, lambda a, out, c=None: ov.fprop_into(a, w2, None, out, c), 64, dtype, cfg)
        bulk = ov.BulkBackward(ub, z)
        bulk.dgrad_rs(y, w, world * 32, 64, dtype, device)
        return [y, z, bulk.x_full(), bulk.dx_local()]

    before = _transport_state(ub)
    first = [t.clone() for t in sequence()]
    for _ in range(3):
        again = sequence()
        assert all(torch.equal(a, b) for a, b in zip(again, first)), "a repeated sequence of ops gave other results"
    after = _transport_state(ub)
    assert after.keys() == before.keys(), "ops added or removed transport attributes"
    for k, (obj, copied) in before.items():
        assert after[k][0] is obj and after[k][1] == copied, f"ops changed the transport's {k!r}"
    want = torch.cat([x_all[r] for r in range(world)]).to(device).float() @ w.float().t()
    err = (first[0].float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"all-gather + GEMM off by {err:.3g}"


def _pieced_primitives(rank, world, group, device, ub):
    """TP=2 over IPC: partials signalled and pulled in row pieces, the owner adding each received
    piece itself (as gemm_rs's GEMM epilogue does), mixed with unpieced ops on the same buffers."""
    dtype = _dtype(device)
    gen = torch.Generator().manual_seed(11)
    peer = 1 - rank
    for pieces in (4, 1, 3, 2):
        parts = torch.randn(world, 64 * world, 16, generator=gen).to(dtype)  # the same on both ranks
        rs = ub.reduce_scatter(64 * world, 16, dtype, device, pieces=pieces)
        assert len(rs.pieces) == pieces and rs.pieces[0][0] == 0 and rs.pieces[-1][1] == 64, rs.pieces
        if pieces == 1:
            for k in (1, 2):
                d = (rank + k) % world
                rs.slot(d).copy_(parts[rank, d * 64 : (d + 1) * 64].to(device))
                rs.ready(d)
            out = rs.finish(dtype)
        else:
            for j, (a, b) in enumerate(rs.pieces):
                rs.slot(peer)[a:b].copy_(parts[rank, peer * 64 + a : peer * 64 + b].to(device))
                rs.ready(peer, j)
                rs.pull_step(1, j)
            out = torch.empty(64, 16, dtype=dtype, device=device)
            own = parts[rank, rank * 64 : (rank + 1) * 64].to(device)
            for j, (a, b) in enumerate(rs.pieces):
                torch.add(own[a:b], rs.received(peer, j), out=out[a:b])
            out = rs.finish_accumulated(out)
        want = (parts[rank].float() + parts[peer].float())[rank * 64 : (rank + 1) * 64].to(dtype)
        got = (parts[0].float() + parts[1].float())[rank * 64 : (rank + 1) * 64].to(dtype)
        assert torch.equal(want, got)
        assert torch.equal(out.cpu(), want), f"pieces={pieces}: max diff {(out.cpu().float() - want.float()).abs().max()}"


def _pieced_linear(rank, world, group, device, ub):
    """The row-parallel Linear cases again with pieces short enough to run gemm_rs's TP=2 pieced
    schedule at these sizes (64 rows per rank: 4 pieces of 16 rows), issued by the native call (own
    partial per piece and per two pieces) and from Python, checking which ran."""
    from te_parallel.native import gemm as native_gemm
    from te_parallel.parallel import ub_transport

    calls = []
    finish, native = ub_transport.IpcReduceScatter.finish_accumulated, ub_transport.IpcTransport.gemm_rs
    ub_transport.IpcReduceScatter.finish_accumulated = lambda self, out: calls.append(("python", len(self.pieces))) \
        or finish(self, out)
    ub_transport.IpcTransport.gemm_rs = lambda self, *a: calls.append(("native", a[5])) or native(self, *a)
    try:
        for schedule, own_group in ((True, 1), (True, 2), (False, 1)):
            cfg = te.OverlapConfig(rs_min_piece_rows=16, rs_pieces=4, native_schedule=schedule, rs_own_group=own_group)
            for bias in (False, True):
                for rec in ("off", "delayed", "current"):
                    _linear_case("row", bias, rec, rank, world, group, device, ub.with_config(cfg), seq=64)
    finally:
        ub_transport.IpcReduceScatter.finish_accumulated, ub_transport.IpcTransport.gemm_rs = finish, native
    first = "native" if native_gemm.usable() else "python"
    assert calls == [(first, 4)] * 12 + [("python", 4)] * 6, calls  # one pieced reduce-scatter per forward


def _native_rs_whole(rank, world, group, device, ub):
    """The native schedule with whole partials (any TP: the fp32 sum pass) against NCCL, FP8 and bf16."""
    from te_parallel.native import gemm as native_gemm
    from te_parallel.ops.cast import quantize_current

    if not native_gemm.usable():
        return
    gen = torch.Generator().manual_seed(5)
    a_all = torch.randn(world, 64 * world, 96, generator=gen)
    w_all = torch.randn(world, 48, 96, generator=gen)
    a, w = a_all[rank].to(device), w_all[rank].to(device)
    for fp8 in (False, True):
        if fp8:
            aq, wq = quantize_current(a, torch.float8_e4m3fn), quantize_current(w, torch.float8_e4m3fn)
            ops = (aq.data, aq.scale_inv, wq.data, wq.scale_inv)
            part = (aq.data.float() * aq.scale_inv.float()) @ (wq.data.float() * wq.scale_inv.float()).t()
        else:
            ops = (a.to(torch.bfloat16), None, w.to(torch.bfloat16), None)
            part = ops[0].float() @ ops[2].float().t()
        for _ in range(2):  # twice: the flags of the second op build on the first
            got = ub.gemm_rs(*ops, torch.bfloat16, pieces=1)
        want = torch.empty(64, 48, device=device)
        dist.reduce_scatter_tensor(want, part.contiguous(), group=group)
        err, top = (got.float() - want).abs().max().item(), want.abs().max().item()
        assert err <= 2e-2 * top, f"native gemm_rs fp8={fp8}: max diff {err:.3g} (max |ref| {top:.3g})"
    # bad arguments fail on every rank before anything is enqueued (so no rank waits for another)
    comm, a16, w16 = ub.transport.comm, a.to(torch.bfloat16), w.to(torch.bfloat16)
    out = torch.empty(64, 48, device=device, dtype=torch.bfloat16)
    operands = (a16, None, w16, None, out, out)  # a [64·world, 96], b [48, 96], out (and received) [64, 48]
    args = dict(send_offset=0, slot_stride=64 * 48 * 2, piece_starts=[], own_group=1, ready_flag=0, busy_flag=0,
                stream=0, side_stream=0)
    with pytest.raises(RuntimeError, match="own_group=0 .* need m >= 1"):
        comm.gemm_rs(*operands, **(args | dict(own_group=0)))
    if world == 2:
        with pytest.raises(RuntimeError, match="piece_starts must rise strictly from 0 to m=64"):
            comm.gemm_rs(*operands, **(args | dict(piece_starts=[0, 48, 32, 64])))
    else:
        with pytest.raises(RuntimeError, match="more than 1 only at world size 2"):
            comm.gemm_rs(*operands, **(args | dict(piece_starts=[0, 32, 64])))


def _suite(rank, world, device):
    group = dist.new_group(list(range(world)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ub = te.initialize_ub([64 * 2, 96 * world * 4], group, use_fp8=True, dtype=_dtype(device), timeout=60)
    fallback = [str(w.message) for w in caught if "comm-GEMM overlap" in str(w.message)]
    checks = Checks(rank)
    want_transport = "ipc" if device.type == "cuda" else "p2p"
    checks.run("transport", _expect, ub.transport_name, want_transport, fallback)
    checks.run("primitives", _primitives, rank, world, group, device, ub)
    checks.run("replayed sequence", _replayed_sequence, rank, world, group, device, ub)
    if ub.transport_name == "ipc" and world == 2:
        checks.run("pieced reduce-scatter", _pieced_primitives, rank, world, group, device, ub)
        checks.run("pieced Linear row", _pieced_linear, rank, world, group, device, ub)
    if ub.transport_name == "ipc":
        checks.run("native gemm_rs, whole partials", _native_rs_whole, rank, world, group, device, ub)
    for mode in ("column", "row"):
        for bias in (False, True):
            for rec in ("off", "delayed", "current"):
                checks.run(f"Linear {mode} {bias} {rec}", _linear_case, mode, bias, rec, rank, world, group, device, ub)
    for rec in ("off", "delayed"):
        checks.run(f"Linear column rs_dgrad {rec}", _linear_case, "column", True, rec, rank, world, group, device, ub,
                   64, 64, True)
    for rec in ("off", "delayed"):
        checks.run(f"TransformerLayer {rec}", _transformer_case, rec, rank, world, group, device, ub)
    checks.run("TransformerLayer delayed rs_dgrad", _transformer_case, "delayed", rank, world, group, device, ub,
               64, 128, True)
    checks.run("buffer too small", _too_small, rank, world, group, device, ub)
    checks.run("bad arguments", _bad_arguments, rank, world, group, device, ub)
    checks.run("ub_cfgs method off", _cfg_off, rank, world, group, device)
    ub.destroy()
    checks.raise_if_failed()


def _expect(name, want, fallback):
    assert name == want, f"transport {name!r}, expected {want!r} (warnings: {fallback})"
    if want == "p2p":
        assert len(fallback) == 1 and "CPU" in fallback[0], fallback


def _bad_arguments(rank, world, group, device, ub):
    cases = [
        (dict(shape=[64]), ValueError, r"shape=\[64\]; need \[tokens, hidden\]"),
        (dict(shape=[63, 64]), ValueError, "divisible by tp_size"),
        (dict(dtype=torch.int32), ValueError, "dtype=torch.int32"),
        (dict(bootstrap_backend="tcp"), ValueError, "bootstrap_backend='tcp'"),
        (dict(ub_cfgs={"qkv_fprob": {}}), ValueError, "ub_cfgs key 'qkv_fprob'"),
        (dict(ub_cfgs={"qkv_fprop": {"method": "magic"}}), ValueError, r"ub_cfgs\['qkv_fprop'\]: OverlapConfig.method='magic'"),
        (dict(ub_cfgs={"qkv_fprop": {"colour": 1}}), ValueError, r"unknown keys \['colour'\]"),
    ]
    for kw, err, match in cases:
        args = dict(shape=[64, 64], tp_group=group) | kw
        with pytest.raises(err, match=match):
            te.initialize_ub(**args)
    with pytest.raises(TypeError, match="ProcessGroup"):
        te.initialize_ub([64, 64], "group")
    kw = dict(tp_group=group, device=device)
    with pytest.raises(ValueError, match="needs parallel_mode 'column'/'row' with sequence_parallel=True"):
        te.Linear(64, 64, parallel_mode="column", ub_overlap_ag=True, ub_comm=ub, **kw)
    with pytest.raises(TypeError, match="ub_comm must be the object returned by initialize_ub"):
        te.Linear(64, 64, parallel_mode="column", sequence_parallel=True, ub_overlap_ag=True, ub_comm=object(), **kw)
    other = dist.new_group(list(range(world)))
    m = te.Linear(64, 64 * world, parallel_mode="column", sequence_parallel=True, ub_overlap_ag=True, ub_comm=ub,
                  tp_group=other, device=device)
    with pytest.raises(ValueError, match="initialised for another tp_group"):
        m(torch.randn(8, 64, device=device))


def _cfg_off(rank, world, group, device):
    """ub_cfgs {"qkv_fprop": {"method": "off"}} turns that GEMM's overlap off, nothing else."""
    ub = te.initialize_ub([64, 64], group, dtype=_dtype(device), ub_cfgs={"qkv_fprop": {"method": "off"}})
    m = te.Linear(64, 32 * world, parallel_mode="column", sequence_parallel=True, tp_group=group, device=device,
                  params_dtype=_dtype(device), ub_overlap_ag=True, ub_name="qkv", ub_comm=ub)
    x = torch.randn(32 // world, 64, device=device, dtype=_dtype(device), requires_grad=True)
    m(x).sum().backward()
    assert ub.counts == {"all_gather": 1, "reduce_scatter": 1}, ub.counts  # backward only
    ub.destroy()


def _too_small(rank, world, group, device, ub):
    x = torch.randn(4096, 8192, device=device)
    with pytest.raises(ValueError, match="pass a larger shape"):
        ub.all_gather(x, None)


@pytest.mark.parametrize("world", worlds(2, 4, 8))
def test_overlap_matches_plain_path(world):
    spawn(_suite, world)


def _never_joins(rank, world, device):
    group = dist.new_group(list(range(world)))
    if rank == 1:
        return  # never calls initialize_ub
    with pytest.raises(TimeoutError, match=r"rank 0 of the TP group.*ranks \[1\].*did not join within 2 s"):
        te.initialize_ub([64, 64], group, timeout=2)


def test_rank_that_never_joins_times_out():
    spawn(_never_joins, 2)


def test_initialize_ub_bad_arguments():
    with pytest.raises(RuntimeError, match="not initialised"):
        te.initialize_ub([64, 64], None)


def test_mpi_bootstrap():
    """initialize_ub(bootstrap_backend='mpi') under launch/mpirun.sh, then an overlapped Linear."""
    from tests.distributed.test_launchers import mpi_env_or_skip

    env = mpi_env_or_skip()
    job = os.path.join(ROOT, "tests", "distributed", "mpi_ub_job.py")
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "mpirun.sh"), job], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert proc.stdout.count("mpi bootstrap ok") == 2, log
