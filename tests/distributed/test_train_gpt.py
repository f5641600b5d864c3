"""The main job on CPU (gloo): FP8 training lowers the loss and a resumed run is exact (FSDP2 over dp2,
and TP=2 + SP), the data-parallel engines give the hand-averaged reference's losses and gradient norms
(clipped), FSDP2 and DDP reach the same parameters, a worker leaves no thread of its process groups
running into interpreter shutdown, and at dp2 x tp2 under FSDP2 a checkpoint round-trips every rank's
model, optimizer and random state bit for bit."""
import json
from pathlib import Path

import pytest
import torch

import te_parallel as te

from te_parallel.examples.cli import build_parser
from te_parallel.examples.data import VOCAB, ByteData
from te_parallel.examples.gpt import GPT, GPTConfig
from te_parallel.examples.layout import Launch
from te_parallel.examples.train_gpt import Trainer, lr_at, main, make_optimizer, prepare, worker
from te_parallel.examples.world import run_world
from tests.distributed.harness import Checks, spawn

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64", "--micro-batch", "8",
         "--corpus-bytes", str(1 << 20), "--device", "cpu", "--quiet"]
TINY = MODEL + ["--nproc", "2", "--steps", "40", "--warmup", "5", "--eval-every", "20", "--eval-batches", "2"]


def _log(path):
    return json.loads((path / "log.json").read_text())["log"]


# delayed: dp2 under FSDP2 (the default engine); current: TP=2 + SP, no data parallelism. Both 2 processes
# (4 on CI's 2 cores cost three times as much per step: dp2 x tp2 is test_checkpoint_round_trips_every_rank)
@pytest.mark.parametrize("fp8, tp", [("delayed", "1"), ("current", "2")])
def test_training_lowers_loss_and_resumes_exactly(tmp_path, fp8, tp):
    full, first, second = tmp_path / "full", tmp_path / "first", tmp_path / "second"
    args = TINY + ["--tp", tp, "--fp8", fp8]
    main(args + ["--out", str(full)])
    record = json.loads((full / "log.json").read_text())
    log = record["log"]
    assert len(log) == 40 and (full / "loss.png").stat().st_size > 1000
    assert record["config"]["dp_engine"] == "fsdp2" and record["config"]["dp"] == 2 // int(tp)
    assert record["throughput"]["tokens_per_s"] > 0 and record["throughput"]["mfu"] is None  # no peak on a CPU
    early = sum(r["loss"] for r in log[:5]) / 5
    late = sum(r["loss"] for r in log[-5:]) / 5
    assert late < early - 1.0, (early, late)  # 5.5 nats/byte at init; learns byte statistics fast
    assert log[-1]["val_loss"] < log[19]["val_loss"]
    ckpt = tmp_path / "ckpt"
    # (the stop at 25 comes after the evaluation at 20: what an evaluation leaves behind must not matter)
    main(args + ["--out", str(first), "--save", str(ckpt), "--stop-after", "25", "--no-plot"])
    main(args + ["--out", str(second), "--resume", str(ckpt), "--no-plot"])
    resumed = _log(second)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in log]  # bit-identical, steps 1..40
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in log]
    assert resumed[-1]["val_loss"] == log[-1]["val_loss"]


def test_overlap_needs_tp_and_sp():
    with pytest.raises(SystemExit):
        main(["--overlap", "--tp", "1"])


SHORT = MODEL + ["--steps", "12", "--warmup", "4", "--eval-every", "12", "--eval-batches", "2", "--no-plot"]


def test_overlap_gives_the_same_losses(tmp_path):
    """--overlap (on CPU: the P2P fallback of the overlapped schedules) vs the plain collectives, FP8."""
    args = SHORT + ["--nproc", "2", "--tp", "2", "--fp8", "delayed"]
    main(args + ["--out", str(tmp_path / "plain")])
    main(args + ["--overlap", "--out", str(tmp_path / "overlap")])  # (ranks warn: P2P fallback)
    a, b = _log(tmp_path / "plain"), _log(tmp_path / "overlap")
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) < 1e-4, [(x["loss"], y["loss"]) for x, y in zip(a, b)]


def test_tp2_sp_matches_tp1_same_seed(tmp_path):
    """Parity across layouts: the same seed gives the same losses and gradient norms (each TP shard counted
    once, each whole parameter once; clipped to the default --clip-grad 1.0) with TP=1 and TP=2 + SP (fp32,
    no FP8), and the same model FLOPs per step (MFU's numerator does not depend on the layout)."""
    args = SHORT + ["--fp8", "off"]
    main(args + ["--nproc", "1", "--tp", "1", "--out", str(tmp_path / "tp1")])
    main(args + ["--nproc", "2", "--tp", "2", "--out", str(tmp_path / "tp2")])
    a, b = _log(tmp_path / "tp1"), _log(tmp_path / "tp2")
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) < 1e-5
    assert max(abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] for x, y in zip(a, b)) < 1e-5, (a, b)
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) < 1e-5
    flops = [json.loads((tmp_path / d / "log.json").read_text())["config"]["flops_per_step"] for d in ("tp1", "tp2")]
    assert flops[0] == flops[1]


# --- data parallelism against the hand-averaged reference -------------------------------------------

DP_STEPS = 8
DP_ARGS = MODEL + ["--steps", str(DP_STEPS), "--warmup", "3", "--eval-every", str(DP_STEPS), "--eval-batches", "1",
                   "--no-plot", "--fp8", "off", "--nproc", "2", "--tp", "1"]
# The tolerance leaves room for a backend that sums the two replicas' gradients in another order than the
# reference, and for FSDP2's gradient norm, taken from each gradient's dp shards, whose last bit can differ
# from the whole gradient's (fp32 rounding, ~1e-7 relative; the clipping factor follows it).
DP_TOLERANCE = 1e-6


def _hand_averaged_run(argv) -> tuple:
    """(losses, gradient norms) of the trainer's dp2 run in one process: the same TP=1 model, both
    replicas' batches (their data generators seeded as the trainer seeds them), each replica's gradient
    computed on its own and the two averaged by hand, clipped to --clip-grad,
    before the same AdamW step; the loss is the replicas' mean."""
    args = build_parser("").parse_args(argv)
    args.ffn = 4 * args.hidden
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(VOCAB, args.layers, args.hidden, args.heads, args.ffn, args.seq_len))
    model.init_like_single_rank(args.seed)
    opt = make_optimizer(model.parameters(), args)
    data = ByteData(args.corpus_bytes, args.seq_len)
    gens = [torch.Generator().manual_seed(args.seed * 1000 + r) for r in range(2)]
    losses, norms = [], []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        replica_losses, replica_grads = [], []
        for gen in gens:
            loss = model(*data.batch(gen, args.micro_batch, "cpu"))
            loss.backward()
            replica_losses.append(loss.detach())
            replica_grads.append([p.grad for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for p, g0, g1 in zip(model.parameters(), *replica_grads):
            p.grad = (g0 + g1) / 2
        # (te's norm at TP=1: fp64 sums, rounded once; equal to torch's to an ulp, tests/distributed/test_clip.py)
        clip = te.clip_grad_norm_(model, args.clip_grad) if args.clip_grad else te.get_total_norm(model)
        norms.append(clip.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(((replica_losses[0] + replica_losses[1]) / 2).item())
    return losses, norms


def test_dp_engines_match_the_hand_averaged_reference(tmp_path):
    """dp2 (TP=1, fp32) under FSDP2 and under DDP, clipped to the default --clip-grad 1.0 (which every
    step here exceeds): the losses and gradient norms of the one-process, hand-averaged run."""
    ref_losses, ref_norms = _hand_averaged_run(DP_ARGS)
    assert min(ref_norms) > 1.0, ref_norms
    for engine in ("fsdp2", "ddp"):
        main(DP_ARGS + ["--dp-engine", engine, "--out", str(tmp_path / engine)])
        log = _log(tmp_path / engine)
        assert len(log) == DP_STEPS
        diff = max(abs(r["loss"] - ref) for r, ref in zip(log, ref_losses))
        assert diff <= DP_TOLERANCE, (engine, diff, [r["loss"] for r in log], ref_losses)
        diff = max(abs(r["grad_norm"] - ref) / ref for r, ref in zip(log, ref_norms))
        assert diff <= DP_TOLERANCE, (engine, diff, [r["grad_norm"] for r in log], ref_norms)


# --- FSDP2 and DDP reach the same parameters ---------------------------------------------------------

ENGINE_STEPS = 3
# dp2 at TP=1 with FP8 delayed: one rank per TP group, so fc2's FP8 GEMM adds the residual in its epilogue
# and that GEMM's output is the transformer block's output, the tensor FSDP2 hooks for its backward
ENGINE_ARGS = ["--tp", "1", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--micro-batch", "4",
               "--steps", str(ENGINE_STEPS), "--warmup", "1", "--corpus-bytes", str(1 << 18), "--eval-batches", "1",
               "--fp8", "delayed"]
def _full_parameters(model) -> dict:
    """{name: whole tensor} of a GPT under FSDP2 (DTensors: gathered over dp, a collective) or DDP."""
    inner = getattr(model, "module", model)
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in inner.named_parameters()}


def _engine_run(args, world) -> tuple:
    """(step results, parameters, the FSDP2 warnings that a block returned a view) of ENGINE_STEPS steps."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(args, world)
        steps = [t.train_step() for _ in range(ENGINE_STEPS)]
    views = sorted({str(w.message) for w in caught if "returned a view tensor" in str(w.message)})
    return steps, _full_parameters(t.model), views


def _engines_agree(rank, world, device):
    from te_parallel.examples.world import make_world

    w = make_world(1, device)
    checks = Checks(rank)
    runs = {}
    for clip in ("0", "1.0"):  # 1.0, the default, clips every one of these steps (norms 3 to 5)
        args = build_parser("").parse_args(ENGINE_ARGS + ["--clip-grad", clip])
        args.ffn = 4 * args.hidden
        for engine in ("fsdp2", "ddp"):
            args.dp_engine = engine
            runs[clip, engine] = _engine_run(args, w)

    def bit_equal(clip):
        (fsdp_steps, fsdp_params, _), (ddp_steps, ddp_params, _) = runs[clip, "fsdp2"], runs[clip, "ddp"]
        assert fsdp_params.keys() == ddp_params.keys(), sorted(fsdp_params.keys() ^ ddp_params.keys())
        bad = {k: (fsdp_params[k] - ddp_params[k]).abs().max().item() for k in fsdp_params
               if not torch.equal(fsdp_params[k], ddp_params[k])}
        assert not bad, f"parameters that differ (max abs difference): {bad}"
        assert [s.loss for s in fsdp_steps] == [s.loss for s in ddp_steps], (fsdp_steps, ddp_steps)
        assert [s.grad_norm for s in fsdp_steps] == [s.grad_norm for s in ddp_steps], (fsdp_steps, ddp_steps)
        if clip != "0":
            assert all(s.grad_norm > float(clip) for s in ddp_steps), ddp_steps  # every step clipped

    def no_view_warning():
        views = runs["0", "fsdp2"][2] + runs["1.0", "fsdp2"][2]
        assert not views, views

    checks.run("without clipping, FSDP2 and DDP give the same parameters, losses and norms, bit for bit",
               bit_equal, "0")
    checks.run("clipped to 1.0 (every step), the same, bit for bit", bit_equal, "1.0")
    checks.run("no FSDP2-wrapped block returns a view", no_view_warning)
    checks.raise_if_failed()


def test_fsdp2_matches_ddp_at_tp1(tmp_path):
    """dp2 at TP=1, FP8 delayed, fp32. Without gradient clipping, after a few steps FSDP2 (each rank keeps
    half of every parameter, gradients reduce-scattered) and DDP (whole replicas, gradients all-reduced)
    hold the same parameters bit for bit: both average two fp32 gradients, a sum of two that is exact in
    either order and a halving that is exact. Clipped, too: te.clip_grad_norm_ sums in fp64, so the norm of
    FSDP2's shards rounds to the same fp32 number as the norm of DDP's whole gradients, and both scale by the
    same factor. No block hands FSDP2 a view as its output."""
    spawn(_engines_agree, 2)


# --- a worker leaves no backend threads behind ------------------------------------------------------

def _backend_threads() -> list:
    """This process's threads of torch.distributed's backends: gloo's workers and loops, the TCPStore's."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that has ended since the listing
            pass
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore")))


def _worker_then_threads(args):
    worker(args)
    left = _backend_threads()
    assert not left, f"threads left running into interpreter shutdown: {left}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux's /proc")
def test_worker_ends_its_process_groups(tmp_path):
    """FSDP2 (DTensor's caches hold the mesh, the mesh its groups) and a checkpoint: when the worker
    returns, its groups are destroyed and their threads joined, so none of them is still releasing a
    collective's tensors (which takes the GIL) while the interpreter finalizes: a thread that asks for
    the GIL then is ended inside a noexcept destructor, and the process aborts after a finished run."""
    args = build_parser("").parse_args(
        MODEL + ["--nproc", "2", "--tp", "1", "--steps", "2", "--warmup", "1", "--eval-every", "2", "--eval-batches",
                 "1", "--no-plot", "--fp8", "off", "--out", str(tmp_path / "out"), "--save", str(tmp_path / "ckpt")])
    prepare(args, Launch.from_env())
    run_world(_worker_then_threads, args, args.nproc, args.device)
    assert (tmp_path / "ckpt" / "config.json").exists()


# --- a checkpoint round-trips every rank's state ----------------------------------------------------

def _state(trainer) -> dict:
    """Every rank-local tensor of a trainer: model and optimizer (FSDP2 DTensors as this rank's shard),
    random streams, as {name: copy}."""
    out = {}
    for name, t in trainer.model.state_dict().items():
        out[f"model.{name}"] = (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
    names = {p: n for n, p in trainer.model.named_parameters()}
    for p, entries in trainer.opt.state.items():
        for key, t in entries.items():
            out[f"optim.{names[p]}.{key}"] = (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
    out["rng.cpu"], out["rng.data"] = torch.get_rng_state(), trainer.gen.get_state()
    out.update({f"rng.tracker.{k}": v for k, v in trainer.tracker.get_states().items()})
    return out


def _round_trip(rank, world, device, directory):
    from te_parallel.examples.world import make_world

    argv = ["--tp", "2", "--layers", "1", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--micro-batch", "4",
            "--steps", "8", "--corpus-bytes", str(1 << 18), "--eval-batches", "1", "--fp8", "delayed",
            "--dropout", "0.1"]
    args = build_parser("").parse_args(argv)
    args.ffn = 4 * args.hidden
    w = make_world(2, device)
    checks = Checks(rank)
    t = Trainer(args, w)
    for _ in range(2):
        t.train_step()
    t.evaluate()
    t.save(str(directory))
    saved = _state(t)
    before = [t.train_step() for _ in range(2)] + [t.evaluate()]
    args.seed = 4321  # another model, other streams: everything must come from the checkpoint
    u = Trainer(args, w)
    u.load(str(directory))
    loaded = _state(u)
    after = [u.train_step() for _ in range(2)] + [u.evaluate()]

    def same_state():
        assert set(saved) == set(loaded), sorted(set(saved) ^ set(loaded))
        bad = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        assert not bad, f"rank {rank} (dp {w.dp_rank}, tp {w.tp_rank}): {bad[:6]} differ after the load"

    def same_losses():
        assert after == before and u.step == t.step == 4, (before, after)

    checks.run("every rank's model, optimizer and random state round-trip", same_state)
    checks.run("the loaded trainer continues as the saved one", same_losses)
    checks.raise_if_failed()


def test_checkpoint_round_trips_every_rank(tmp_path):
    """dp2 x tp2 under FSDP2, FP8 delayed, dropout: after a save and a load into a trainer built with
    another seed, every rank holds what it saved (its TP shard's FSDP2 shard, its Adam moments, its
    random streams), and the next steps' losses and the next validation loss are the saved trainer's."""
    spawn(_round_trip, 4, tmp_path / "ckpt", cpu=True)  # (the CPU suite at any GPU count)
