"""Comm-GEMM overlap captured in CUDA graphs: replays equal eager runs, bit for bit (CUDA only).

- Two ranks on ONE GPU (so it runs on a one-GPU machine): two processes on the same device share
  their communicator buffers through CUDA IPC (cudaIpcOpenMemHandle maps another process's
  allocation on the same device too), bootstrapped through the torch.distributed store of a gloo
  group. The overlapped ops of a TP=2 layer step (native FP8 and bf16 GEMM + reduce-scatter, pieced
  and whole; native FP8 all-gather + GEMM; the Python-issued schedules; the bulk column backward) are
  captured in one graph, replayed with new inputs and compared with eager runs of the same ops on the
  same communicator, and with the math. The modules cannot run this way: their other collectives
  need an NCCL group, and NCCL refuses two ranks on one GPU.
- A TransformerLayer at TP=2 + SP with ub_tp_comm_overlap in FP8, graphed by te.make_graphed_callables
  on two GPUs: its replays equal an eager twin on the same communicator, step after step (where eager
  itself is bit-reproducible; see _compare).
"""
import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import comm_overlap as native_comm
from te_parallel.native import gemm as native_gemm
from te_parallel.ops import linear_overlap as ov
from te_parallel.ops.cast import quantize_current
from te_parallel.parallel.overlap import CommOverlap, _Exchange
from te_parallel.parallel.ub_transport import IpcTransport
from tests.distributed.harness import spawn
from tests.reference import rel_err

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)


def _require_fp8_and_native() -> None:
    """Asked in the test, not at import: the spawned workers import this module before they pick
    their device, and these questions open a CUDA context."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability >= 8.9 for FP8")
    if not (native_comm.usable() and native_gemm.usable()):
        pytest.skip("te_parallel._C is absent or cuBLASLt did not open (the IPC communicator is native)")


TP, M, H, F = 2, 256, 256, 512  # ranks, rows per rank, hidden, ffn per rank
BF16, E4 = torch.bfloat16, torch.float8_e4m3fn
NATIVE_PIECED = te.OverlapConfig(rs_pieces=4, rs_pieces_short_k=4, rs_min_piece_rows=64, rs_own_group=2)
NATIVE_WHOLE = te.OverlapConfig(rs_pieces=1, rs_pieces_short_k=1)
PY_PIECED = te.OverlapConfig(rs_pieces=4, rs_pieces_short_k=4, rs_min_piece_rows=64, native_schedule=False)
PY_WHOLE = te.OverlapConfig(rs_pieces=1, rs_pieces_short_k=1, native_schedule=False)


# ----------------------------------------------------------------------------------------------------
# Two ranks on one GPU: the overlapped ops, captured


def _values(rank: int, step: int, device) -> dict:
    """Step `step`'s inputs of this rank, from a seed every rank shares (so each can build the
    reference itself): FP8 operands as (data, scale_inv), the gathered ones with one scale for all."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TP, M, H, generator=g)  # every rank's chunk of the gathered input
    w1 = torch.randn(TP, F, H, generator=g) / H ** 0.5  # each rank's column-parallel shard
    a2 = torch.randn(TP, TP * M, F, generator=g)  # each rank's row-parallel input (all rows)
    w2 = torch.randn(TP, H, F, generator=g) / F ** 0.5
    x8 = quantize_current(x.reshape(TP * M, H).to(device), E4)  # one scale over every rank's chunk
    v = {"x8": x8.data[rank * M : (rank + 1) * M].contiguous(), "x8_s": x8.scale_inv}
    for name, t in (("w1_8", w1[rank]), ("a2_8", a2[rank]), ("w2_8", w2[rank])):
        q = quantize_current(t.to(device), E4)
        v[name], v[name + "_s"] = q.data, q.scale_inv
    for name, t in (("xb", x[rank]), ("w1b", w1[rank]), ("a2b", a2[rank]), ("w2b", w2[rank])):
        v[name] = t.to(device, BF16)
    return v


def _fprop(w):
    return lambda a, out, c=None: ov.fprop_into(a, w, None, out, c)


def _ops(ub, s: dict, device) -> dict:
    """Every overlapped schedule of a TP=2 step, reading the static inputs `s`."""
    f8 = {n: Float8Tensor(s[n], s[n + "_s"]) for n in ("x8", "w1_8", "a2_8", "w2_8")}
    out = {}
    y, gathered = ov.ag_gemm(ub, f8["x8"], _fprop(f8["w1_8"]), F, BF16, keep_gathered=True, w=f8["w1_8"])
    out["ag fp8 native"], out["ag fp8 gathered"] = y, gathered.data
    for name, cfg, w in (("rs fp8 native pieced", NATIVE_PIECED, f8["w2_8"]), ("rs fp8 native whole", NATIVE_WHOLE,
                         f8["w2_8"]), ("rs fp8 python pieced", PY_PIECED, None)):
        out[name] = ov.gemm_rs(ub, f8["a2_8"], _fprop(f8["w2_8"]), H, BF16, cfg, w=w)
    out["rs bf16 native pieced"] = ov.gemm_rs(ub, s["a2b"], _fprop(s["w2b"]), H, BF16, NATIVE_PIECED, w=s["w2b"])
    out["rs bf16 python whole"] = ov.gemm_rs(ub, s["a2b"], _fprop(s["w2b"]), H, BF16, PY_WHOLE)
    out["ag bf16 python"], out["ag bf16 gathered"] = ov.ag_gemm(ub, s["xb"], _fprop(s["w1b"]), F, BF16,
                                                                keep_gathered=True, w=s["w1b"])
    bulk = ov.BulkBackward(ub, s["xb"])  # column backward: AG(x) under dgrad, RS(dx) under wgrad
    bulk.dgrad_rs(s["a2b"], s["w1b"], TP * M, H, BF16, device)
    out["bulk x gathered"] = bulk.x_full()
    out["bulk wgrad"] = s["a2b"].t() @ out["bulk x gathered"]
    out["bulk dx"] = bulk.dx_local()
    return out


def _reference(rank: int, step: int, device) -> dict:
    """The math of _ops in fp64 from every rank's inputs (dequantized FP8 where the op is FP8), quantized
    on the same device by the same kernels as each rank's own (so the FP8 bytes are the same)."""
    vs = [_values(r, step, device) for r in range(TP)]
    dq = lambda v, n: v[n].double() * v[n + "_s"].double()  # noqa: E731
    rows = slice(rank * M, (rank + 1) * M)
    me = vs[rank]
    x8_full = torch.cat([dq(v, "x8") for v in vs])
    xb_full = torch.cat([v["xb"].double() for v in vs])
    rs8 = sum(dq(v, "a2_8")[rows] @ dq(v, "w2_8").t() for v in vs)
    rsb = sum(v["a2b"].double()[rows] @ v["w2b"].double().t() for v in vs)
    return {"ag fp8 native": x8_full @ dq(me, "w1_8").t(), "rs fp8 native pieced": rs8, "rs fp8 native whole": rs8,
            "rs fp8 python pieced": rs8, "rs bf16 native pieced": rsb, "rs bf16 python whole": rsb,
            "ag bf16 python": xb_full @ me["w1b"].double().t(), "bulk x gathered": xb_full,
            "bulk wgrad": me["a2b"].double().t() @ xb_full,
            "bulk dx": sum((v["a2b"].double() @ v["w1b"].double())[rows] for v in vs),
            "ag fp8 gathered": torch.cat([v["x8"] for v in vs])}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (FP8 compared as bytes)."""
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


def _one_gpu_worker(rank: int, world: int, _device) -> None:
    device = torch.device("cuda", 0)  # both ranks: one GPU
    torch.cuda.set_device(device)
    group = dist.group.WORLD  # gloo: only the IPC handles and a barrier go through it
    exchange = _Exchange(group, "store", 120.0)
    transport = IpcTransport(rank, world, M * H * 2, exchange.allgather_bytes, device)
    ub = CommOverlap([world * M, H], group, True, BF16, {}, transport, exchange)
    native = []
    for name in ("gemm_rs", "ag_gemm"):  # count the native calls: the test must reach them
        real = getattr(transport, name)
        setattr(transport, name, lambda *a, _real=real, _name=name, **k: native.append(_name) or _real(*a, **k))
    static = _values(rank, 0, device)
    side = torch.cuda.Stream(device)  # warm-up off the default stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _ops(ub, static, device)
    torch.cuda.current_stream().wait_stream(side)
    assert sorted(native) == ["ag_gemm", "gemm_rs", "gemm_rs", "gemm_rs"], native
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _ops(ub, static, device)
    for step in range(1, 5):
        for name, t in _values(rank, step, device).items():
            static[name].copy_(t)
        graph.replay()
        if step % 2:
            graph.replay()  # twice in a row: graph after graph
        replayed = {k: t.clone() for k, t in captured.items()}
        eager = _ops(ub, static, device)  # eager between replays, on the same communicator
        torch.cuda.synchronize()
        for k in eager:
            a, b = replayed[k], eager[k]
            assert _same(a, b), (f"rank {rank} step {step} {k}: replay differs from eager (max "
                                 f"{(a.double() - b.double()).abs().max().item():.3g})")
        ref = _reference(rank, step, device)
        assert _same(eager["ag fp8 gathered"], ref.pop("ag fp8 gathered")), f"rank {rank} step {step}: gathered bytes"
        for k, want in ref.items():
            err = rel_err(eager[k], want)
            assert err < 2e-2, f"rank {rank} step {step} {k}: relative error {err:.3g} against the fp64 math"
    ub.destroy()


def test_overlapped_ops_captured_two_ranks_one_gpu(monkeypatch):
    _require_fp8_and_native()
    monkeypatch.setenv("TE_PARALLEL_TEST_DEVICE", "cpu")  # the harness's gloo group; the workers take cuda:0
    monkeypatch.setenv("TE_PARALLEL_TEST_HANG_S", "300")
    spawn(_one_gpu_worker, TP)


# ----------------------------------------------------------------------------------------------------
# A TransformerLayer through make_graphed_callables (two GPUs)


def _layer(group, ub):
    torch.manual_seed(0)
    return te.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=BF16,
                               device="cuda", tp_group=group, sequence_parallel=True, set_parallel_mode=True,
                               ub_tp_comm_overlap=True, ub_comm=ub, ub_overlap_rs_dgrad=True)


def _step(module, x, dy, recipe=None):
    x = x.clone().requires_grad_(True)
    if recipe is None:  # the graphed callable carries its own fp8_autocast region
        y = module(x)
    else:
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = module(x)
    y.backward(dy)
    return [("output", y.detach()), ("dx", x.grad)] + [(n, p.grad) for n, p in module.named_parameters()]


def _compare(rank, step, graphed, eager, twin) -> None:
    """graphed == eager bit for bit wherever a second eager layer (twin) reproduces eager bit for bit;
    elsewhere (an op without a deterministic kernel) within the twin's own distance, x4, + 1e-3."""
    for (name, g), (_, e), (_, t) in zip(graphed, eager, twin):
        if torch.equal(t, e):
            assert torch.equal(g, e), (f"rank {rank} step {step} {name}: graphed differs from eager (rel err "
                                       f"{rel_err(g, e):.3g})")
        else:
            assert rel_err(g, e) <= 4 * rel_err(t, e) + 1e-3, f"rank {rank} step {step} {name}: {rel_err(g, e):.3g}"


def _layer_worker(rank: int, world: int, device) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    group = dist.new_group(list(range(world)))
    ub = te.initialize_ub([128 * 2, 1024], group, use_fp8=True, dtype=BF16)
    assert ub.transport_name == "ipc", ub.transport_name
    recipe = R.DelayedScaling(amax_history_len=8)
    layers = [_layer(group, ub) for _ in range(3)]  # graphed, eager, twin
    x = torch.randn(128 // world, 2, 256, device="cuda", dtype=BF16, requires_grad=True)
    graphed = te.make_graphed_callables(layers[0], (x,), fp8_enabled=True, fp8_recipe=recipe)
    for layer in layers[1:]:  # the warm-up moved the graphed layer's scales: start all three alike
        layer.load_state_dict(layers[0].state_dict())
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.01) for layer in layers]
    for step in range(4):
        gen = torch.Generator(device="cuda").manual_seed(100 * step + rank)
        inp = torch.randn(x.shape, device="cuda", dtype=BF16, generator=gen)
        dy = torch.randn(x.shape, device="cuda", dtype=BF16, generator=gen)
        results = [_step(graphed, inp, dy)] + [_step(layer, inp, dy, recipe) for layer in layers[1:]]
        _compare(rank, step, *results)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)  # (p.grad of the graphed layer is the graph's static buffer)
    ub.destroy()


def test_graphed_transformer_layer_with_overlap_matches_eager():
    _require_fp8_and_native()
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}: the layer's own collectives "
                    f"need NCCL, which refuses two ranks on one GPU (the one-GPU test above captures the "
                    f"overlapped ops without them)")
    spawn(_layer_worker, 2)
