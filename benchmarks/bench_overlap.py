"""Comm-GEMM overlap at TP=2/4/8: AG+GEMM and GEMM+RS vs the GEMM alone, bf16 and FP8, plus a TransformerLayer.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_overlap.py [--json out.json] [--layer]

Shapes: per-rank input 4096×4096 (M = 4096·tp tokens in all), weight shard 6144×4096.
  column fprop  AG(x [M/tp, 4096]) · W[6144, 4096]ᵀ            -> [M, 6144]
  row fprop     RS(x [M, 6144] · W[4096, 6144]ᵀ)               -> [M/tp, 4096]
Rows per case: the GEMM alone (on already-gathered / unreduced data), NCCL collective then GEMM
(sequential), te_parallel's overlap; ratios are ÷ GEMM alone. Every time is the max over the ranks
of the per-rank median (CUDA events). `--layer` adds the GPT TransformerLayer (hidden 4096, ffn 16384,
32 heads, s 2048 × b 4; `--layer-batch 4 8` adds b=8) at TP=2+SP in FP8, fwd+bwd with and without
overlap, with the host's issue time per step beside it (a host-bound step cannot gain from overlap), and
two rows without any sequence all-gather / reduce-scatter: `_LocalTransfer` (local copies write every
output byte with real data: the no-communication step, which no overlap can beat) and `_NoTransfer` (outputs left
unwritten; its GEMMs on never-written memory draw less power and run ~20% faster under the power cap,
so it is no bound). The layer rows are timed interleaved (common.time_interleaved).
Op times are per call of loops issued back to back (the host runs ahead, as in training).
A last table gives NCCL's own all-gather / reduce-scatter bus bandwidth in the same run (nccl-tests'
convention: algorithm bandwidth = bytes of the whole gathered / unreduced tensor ÷ time, bus bandwidth =
that × (tp-1)/tp), at the op's size and a sweep, so the overlap rows can be read against the link.
The timeline rows prove overlap without nsys: CUDA events on the compute stream (each chunk's GEMM)
and on the copy stream (each pull), relative to the start of the op on rank 0. `--trace` adds, for
the default (native) schedule, every GPU activity of one call (torch.profiler: kernels and copies
with their streams), which the native calls cannot interleave with events.
The layer rows include schedule variants in the same run: short-K reduce-scatters (proj) in
OverlapConfig.rs_pieces pieces instead of rs_pieces_short_k, and the column backward's reduce-scatter
pipelined with its dgrad (ub_overlap_rs_dgrad) instead of bulk under wgrad.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import init_torchrun_nccl, max_over_ranks, report, time_cuda, time_interleaved  # noqa: E402
from te_parallel import recipe  # noqa: E402
from te_parallel.fp8.tensor import Float8Tensor  # noqa: E402
from te_parallel.ops import linear_overlap as ov  # noqa: E402
from te_parallel.parallel.overlap_config import OverlapConfig  # noqa: E402
from te_parallel.parallel.collectives import all_gather_dim0, reduce_scatter_dim0  # noqa: E402


def _timed(fn, iters=30) -> float:
    """Milliseconds per call of `iters` calls issued back to back (the host runs ahead of the GPU, as
    in training), median of 5 such loops, max over the ranks."""
    dist.barrier()

    def loop():
        for _ in range(iters):
            fn()
    return max_over_ranks(time_cuda(loop, warmup=1, iters=5) / iters)


def _synced(fn) -> float:
    """Milliseconds of one call with the GPU idle before it (host issue latency included)."""
    dist.barrier()
    return max_over_ranks(time_cuda(fn, warmup=5, iters=20))


def _host_us(fn, iters=20) -> float:
    """Host microseconds to issue one call (no synchronisation inside the loop)."""
    import time
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) / iters * 1e6
    torch.cuda.synchronize()
    return max_over_ranks(host)


def _fp8(t: torch.Tensor) -> Float8Tensor:
    return Float8Tensor(t.to(torch.float8_e4m3fn), torch.ones((), device=t.device))


def ag_cases(ub, group, rank, tp, m, k, n, use_fp8, cfg=None):
    """Column fprop: gather x [m, k] from every rank, multiply by W [n, k]ᵀ."""
    x_local = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    xq, wq = (_fp8(x_local), _fp8(w)) if use_fp8 else (x_local, w)
    x_full = all_gather_dim0(ov._bytes(xq), group)[0]
    x_full_op = ov._wrap(x_full, xq)
    out = torch.empty(tp * m, n, device="cuda", dtype=torch.bfloat16)

    def gemm_alone():
        ov.fprop_into(x_full_op, wq, None, out)

    def sequential():
        gathered = ov._wrap(all_gather_dim0(ov._bytes(xq), group)[0], xq)
        ov.fprop_into(gathered, wq, None, out)

    def overlapped():
        ov.ag_gemm(ub, xq, lambda a, o: ov.fprop_into(a, wq, None, o), n, torch.bfloat16, keep_gathered=False, w=wq,
                   cfg=cfg)

    y_ref = torch.empty_like(out)
    ov.fprop_into(x_full_op, wq, None, y_ref)
    y = ov.ag_gemm(ub, xq, lambda a, o: ov.fprop_into(a, wq, None, o), n, torch.bfloat16, keep_gathered=False, w=wq)[0]
    assert torch.equal(y, y_ref), "overlapped AG+GEMM differs from gather-then-GEMM"
    return gemm_alone, sequential, overlapped, lambda: _ag_timeline(ub, xq, wq, n, rank, tp)


def _ag_timeline(ub, xq, wq, n, rank, tp):
    """The events of one ov.ag_gemm call (the same code path as the timed rows)."""
    ub.transport.timing = True
    torch.cuda.synchronize()
    dist.barrier()
    cur = torch.cuda.current_stream()
    spans, handles = [], []
    real_all_gather = ub.all_gather

    def traced_all_gather(*a, **k):
        h = real_all_gather(*a, **k)
        handles.append(h)
        return h

    def traced_gemm(a, out):
        s = _ev(cur)
        ov.fprop_into(a, wq, None, out)
        spans.append((f"GEMM chunk {len(spans)}", s, _ev(cur)))

    ub.all_gather = traced_all_gather
    t0 = _ev(cur)
    try:
        ov.ag_gemm(ub, xq, traced_gemm, n, torch.bfloat16, keep_gathered=False)
    finally:
        del ub.all_gather
    for dst, e in handles[0].events.items():
        spans.append((f"push own chunk to rank {dst} (copy engine)", handles[0].push_started[dst], e))
    torch.cuda.synchronize()
    ub.transport.timing = False
    return [(name, t0.elapsed_time(a), t0.elapsed_time(b)) for name, a, b in spans]


def _ev(stream):
    e = torch.cuda.Event(enable_timing=True)
    e.record(stream)
    return e


def rs_cases(ub, group, rank, tp, m, k, n, use_fp8, cfg=None):
    """Row fprop: x [tp·m, k] · W [n, k]ᵀ, reduce-scattered to [m, n]."""
    x = torch.randn(tp * m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    xq, wq = (_fp8(x), _fp8(w)) if use_fp8 else (x, w)
    out = torch.empty(tp * m, n, device="cuda", dtype=torch.bfloat16)

    def gemm_alone():
        ov.fprop_into(xq, wq, None, out)

    def sequential():
        ov.fprop_into(xq, wq, None, out)
        reduce_scatter_dim0(out, group)

    def overlapped():
        ov.gemm_rs(ub, xq, lambda a, o, c=None: ov.fprop_into(a, wq, None, o, c), n, torch.bfloat16, cfg, w=wq)

    ov.fprop_into(xq, wq, None, out)
    ref = reduce_scatter_dim0(out, group)[0]
    y = ov.gemm_rs(ub, xq, lambda a, o, c=None: ov.fprop_into(a, wq, None, o, c), n, torch.bfloat16, cfg, w=wq)
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= 2 ** -6 * ref.float().abs().max().item(), f"overlapped GEMM+RS differs by {err}"
    return gemm_alone, sequential, overlapped, lambda: _rs_timeline(ub, xq, wq, n, rank, tp)


def _rs_timeline(ub, xq, wq, n, rank, tp):
    ub.transport.timing = True
    torch.cuda.synchronize()
    dist.barrier()
    cur = torch.cuda.current_stream()
    t0 = _ev(cur)
    rows, inner = ov._bytes(xq).shape
    m = rows // tp
    rs = ub.reduce_scatter(rows, n, torch.bfloat16, "cuda", pieces=OverlapConfig().rs_pieces_for(tp, m, inner))
    spans = []
    if len(rs.pieces) > 1:  # gemm_rs's TP=2 schedule: pieces, and the own GEMM adds the received ones
        peer = 1 - rank
        for j, (a, b) in enumerate(rs.pieces):
            s = _ev(cur)
            ov.fprop_into(ov._rows(xq, peer * m + a, peer * m + b), wq, None, rs.slot(peer)[a:b])
            spans.append((f"GEMM partial for rank {peer}, rows {a}:{b}", s, _ev(cur)))
            rs.ready(peer, j)
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        for j, (a, b) in enumerate(rs.pieces):
            acc = rs.received(peer, j)
            s = _ev(cur)
            ov.fprop_into(ov._rows(xq, rank * m + a, rank * m + b), wq, None, out[a:b], acc)
            spans.append((f"GEMM own rows {a}:{b} + received piece", s, _ev(cur)))
        rs.finish_accumulated(out)
    else:
        for k in range(1, tp + 1):
            d = (rank + k) % tp
            s = _ev(cur)
            ov.fprop_into(ov._rows(xq, d * m, (d + 1) * m), wq, None, rs.slot(d))
            spans.append((f"GEMM partial for rank {d}", s, _ev(cur)))
            rs.ready(d)
            if k > 1:
                rs.pull_step(k - 1)
        rs.finish(torch.bfloat16)
    for i, (a, b) in enumerate(rs.pulls):
        spans.append((f"pull partial {i} (copy engine)", a, b))
    torch.cuda.synchronize()
    ub.transport.timing = False
    return [(name, t0.elapsed_time(a), t0.elapsed_time(b)) for name, a, b in spans]


def gpu_trace(fn, tries: int = 3):
    """GPU activities (kernels, copies) of one call of fn, issued on an idle GPU after a barrier, from
    torch.profiler (CUPTI): [(name, start_us, end_us, stream)], relative to the first activity, of the
    last of `tries` calls. Shows where the native calls' copies run against their GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    spans = []
    for _ in range(tries):
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        acts = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
        t0 = min((e.start_ns() for e in acts), default=0)
        spans = sorted(((_short(e.name()), (e.start_ns() - t0) / 1e3, (e.start_ns() + e.duration_ns() - t0) / 1e3,
                         e.device_resource_id()) for e in acts), key=lambda r: r[1])
    return spans


def _short(name: str) -> str:
    if "Memcpy" in name or "memcpy" in name:
        return "copy " + name.split("(")[-1].rstrip(")") if "(" in name else name
    for key in ("nvjet", "sm90_xmma", "cutlass", "gemm", "reduce_kernel", "nccl"):
        if key in name:
            return f"{key}: {name[:60]}"
    return name[:70]


def nccl_rows(group, tp: int, sizes_mib) -> list:
    """NCCL all-gather and reduce-scatter (bf16, dim 0) of `sizes_mib` MiB whole tensors: time and bus bandwidth."""
    rows = []
    for mib in sizes_mib:
        numel = mib * 2 ** 20 // 2 // tp * tp
        full = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        part = full[: numel // tp].clone()
        for name, fn in (("all-gather", lambda: dist.all_gather_into_tensor(full, part, group=group)),
                         ("reduce-scatter", lambda: dist.reduce_scatter_tensor(part, full, group=group))):
            ms = _timed(fn, iters=20)
            algbw = numel * 2 / (ms * 1e-3) / 1e9
            rows.append({"collective": name, "MiB": mib, "ms": ms, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * (tp - 1) / tp})
    return rows


def gpt_layer_step(group, tp: int, batch: int, extra: dict):
    """(layer, step): the GPT TransformerLayer (hidden 4096, ffn 16384, 32 heads) at TP=tp + SP (`extra`:
    its overlap arguments) and one FP8 fwd+bwd of it on s 2048 × b `batch` tokens (gradients accumulate
    across steps)."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32, hidden_dropout=0.0,
                                attention_dropout=0.0, tp_group=group, sequence_parallel=True, set_parallel_mode=True,
                                params_dtype=torch.bfloat16, device="cuda", **extra)
    x = torch.randn(2048 // tp, batch, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):  # every GEMM in FP8, with and without overlap
            y = layer(x)
        y.backward(dy)
    return layer, step


class _NoTransfer:
    """The NCCL path's sequence all-gathers and reduce-scatters replaced by nothing (the outputs are left
    unwritten): the step's compute and host work alone, a bound no overlap can go below. Its
    numbers are wrong; only its time is read."""

    class _Done:
        def wait(self):
            pass

    def __enter__(self):
        from te_parallel.parallel import collectives

        self.saved = collectives._all_gather, collectives._reduce_scatter
        collectives._all_gather = collectives._reduce_scatter = \
            lambda out, t, group=None, async_op=False: self._Done() if async_op else None
        return self

    def __exit__(self, *exc):
        from te_parallel.parallel import collectives

        collectives._all_gather, collectives._reduce_scatter = self.saved


class _LocalTransfer(_NoTransfer):
    """The NCCL path's sequence all-gathers and reduce-scatters replaced by copies on this GPU that write
    every output byte with data of the same kind: each gathered slot gets this rank's own shard, and a
    reduce-scatter's output gets this rank's rows of its own partial (no sum). The GEMMs then read
    real numbers, not the never-written memory of `_NoTransfer`: under the power cap a GEMM on zeros
    draws less power and clocks higher, so that bound was too low. The copies (device-to-device memcpy,
    a few tens of µs each) stay in the step's time; `profile_layer_kernels.py` reports them apart."""

    def __enter__(self):
        from te_parallel.parallel import collectives

        self.saved = collectives._all_gather, collectives._reduce_scatter

        def all_gather(out, t, group=None, async_op=False):
            flat, src = out.view(-1), t.reshape(-1)
            for chunk in flat.split(src.numel()):
                chunk.copy_(src)
            return self._Done() if async_op else None

        def reduce_scatter(out, t, group=None, async_op=False):
            rank = dist.get_rank(group)
            out.view(-1).copy_(t.reshape(-1)[rank * out.numel():(rank + 1) * out.numel()])
            return self._Done() if async_op else None

        collectives._all_gather, collectives._reduce_scatter = all_gather, reduce_scatter
        return self


def layer_rows(ub, group, rank, tp, batch):
    """The layer's cases timed together: every case in each of 5 rounds (common.time_interleaved, so no
    case gains from its place in the run), max over ranks of each case's median."""
    ovl = dict(ub_tp_comm_overlap=True, ub_comm=ub)
    cfg = ub.default
    long_k_pieces = dict(ub_tp_comm_overlap=True,
                         ub_comm=ub.with_config(dataclasses.replace(cfg, rs_pieces_short_k=cfg.rs_pieces)))
    cases = [("no overlap (NCCL)", {}, contextlib.nullcontext), ("overlap", ovl, contextlib.nullcontext),
             (f"overlap, short-K reduce-scatters in {cfg.rs_pieces} pieces (not {cfg.rs_pieces_short_k})",
              long_k_pieces, contextlib.nullcontext),
             ("overlap, column dgrad + reduce-scatter pipelined (ub_overlap_rs_dgrad)",
              dict(ovl, ub_overlap_rs_dgrad=True), contextlib.nullcontext),
             ("no communication, outputs left unwritten (_NoTransfer)", {}, _NoTransfer),
             ("no communication at all, outputs written locally (_LocalTransfer)", {}, _LocalTransfer)]

    def under(ctx, step):
        def run():
            with ctx():
                step()
        return run
    steps = {name: under(ctx, gpt_layer_step(group, tp, batch, extra)[1]) for name, extra, ctx in cases}
    dist.barrier()
    times = time_interleaved(steps, warmup=3, iters=10, rounds=5)
    rows = []
    for name, step in steps.items():
        ms = max_over_ranks(times[name])
        rows.append({"case": f"TransformerLayer TP={tp} SP FP8 fwd+bwd, b={batch}, {name}", "ms": ms,
                     "synced_ms": _synced(step), "host_ms": _host_us(step, iters=5) / 1e3,
                     "speedup": rows[0]["ms"] / ms if rows else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=6144, help="weight shard rows (column) / inner shard (row)")
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--layer-batch", type=int, nargs="+", default=[4], help="micro-batches of the layer rows")
    ap.add_argument("--skip-ops", action="store_true", help="only the layer rows (with --layer) and NCCL's bandwidth")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", action="store_true",
                    help="also print each op's GPU activities (torch.profiler) for one call of the default schedule")
    args = ap.parse_args()
    rank, tp, group = init_torchrun_nccl()
    tokens = max(tp * args.m, 2048 * max(args.layer_batch))
    ub = te.initialize_ub([tokens, max(args.k, args.n)], group, use_fp8=True, dtype=torch.bfloat16)
    rows, timelines, traces = [], [], []
    for kind, make in () if args.skip_ops else (("AG+GEMM", ag_cases), ("GEMM+RS", rs_cases)):
        for use_fp8 in (False, True):
            if kind == "AG+GEMM":
                fns = make(ub, group, rank, tp, args.m, args.k, args.n, use_fp8)
            else:  # row: x [M, n] · W[k, n]ᵀ -> [M, k] reduce-scattered
                fns = make(ub, group, rank, tp, args.m, args.n, args.k, use_fp8)
            alone, seq, ovl, timeline = fns
            label = f"{kind} {'fp8' if use_fp8 else 'bf16'}"
            t_alone, t_seq, t_ovl = _timed(alone), _timed(seq), _timed(ovl)
            rows.append({"case": label, "gemm_alone_ms": t_alone, "sequential_ms": t_seq, "overlap_ms": t_ovl,
                         "sequential_x": t_seq / t_alone, "overlap_x": t_ovl / t_alone,
                         "overlap_synced_ms": _synced(ovl), "seq_synced_ms": _synced(seq),
                         "overlap_host_us": _host_us(ovl), "seq_host_us": _host_us(seq)})
            # The schedule's variants, same run:
            # (pieces, own pieces per GEMM, native call)
            default = OverlapConfig()
            variants = [(default.rs_pieces, default.rs_own_group, False)]
            if kind == "GEMM+RS" and tp == 2:
                variants += [(1, 1, True), (4, 1, True), (4, 2, True), (8, 4, True)]
            for pieces, own, native in variants:
                cfg = OverlapConfig(rs_pieces=pieces, rs_pieces_short_k=pieces, rs_own_group=own, native_schedule=native,
                                    rs_min_piece_rows=1 << 30 if pieces == 1 else 16)
                name = ("issued step by step from Python" if not native else
                        "1 piece (fp32 sum pass)" if pieces == 1 else f"{pieces} pieces, own GEMM per {own}")
                shape = (args.m, args.k, args.n) if kind == "AG+GEMM" else (args.m, args.n, args.k)
                variant = make(ub, group, rank, tp, *shape, use_fp8, cfg=cfg)[2]
                rows.append({"case": f"{label}, {name}", "gemm_alone_ms": t_alone,
                             "overlap_ms": (t := _timed(variant)), "overlap_x": t / t_alone,
                             "overlap_synced_ms": _synced(variant), "overlap_host_us": _host_us(variant)})
            for _ in range(3):  # the last of three (warm clocks and caches)
                spans = timeline()
            timelines.append((label, spans))
            if args.trace:
                traces.append((f"{label}, default schedule", gpu_trace(ovl)))
    layer = [r for b in args.layer_batch for r in layer_rows(ub, group, rank, tp, b)] if args.layer else []
    issue_mib = tp * args.m * args.k * 2 // 2 ** 20  # the AG rows' gathered bf16 input
    nccl = nccl_rows(group, tp, sorted({8, 64, issue_mib, 512}))
    if rank == 0:
        title = (f"TP={tp} comm-GEMM overlap ({ub.transport_name}), per-rank {args.m}x{args.k}, shard "
                 f"{args.n}x{args.k} (max over ranks of median ms; x = / GEMM alone)")
        if rows:
            report(title, rows, ["case", "gemm_alone_ms", "sequential_ms", "overlap_ms", "sequential_x", "overlap_x",
                                 "seq_synced_ms", "overlap_synced_ms", "seq_host_us", "overlap_host_us"], args.json)
        for label, spans in timelines:
            print(f"\ntimeline {label} (rank 0, ms from op start; GEMM+RS: its schedule issued from Python, so "
                  f"that events can be recorded between the steps)")
            for name, a, b in spans:
                print(f"  {name:<40} {a:8.3f} .. {b:8.3f}")
        for label, spans in traces:
            print(f"\nGPU activities, {label} (rank 0, one call on an idle GPU, us from its first activity)")
            for name, a, b, stream in spans:
                print(f"  stream {stream:<3} {a:8.1f} .. {b:8.1f}  ({b - a:6.1f})  {name}")
        if layer:
            report(f"TransformerLayer (h 4096, ffn 16384, 32 heads) TP={tp}+SP FP8", layer,
                   ["case", "ms", "speedup", "synced_ms", "host_ms"],
                   args.json.replace(".json", "_layer.json") if args.json else None)
        report(f"NCCL bus bandwidth, TP={tp} (bf16; {issue_mib} MiB is the AG rows' gathered input)", nccl,
               ["collective", "MiB", "ms", "algbw_GBps", "busbw_GBps"],
               args.json.replace(".json", "_nccl.json") if args.json else None)
        if args.json:
            import json
            with open(args.json.replace(".json", "_timeline.json"), "w") as f:
                json.dump({label: spans for label, spans in timelines}, f, indent=1)
    ub.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
