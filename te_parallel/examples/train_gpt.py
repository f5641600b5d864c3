"""Train a byte-level GPT on Python's standard library with tensor (+sequence), context and data parallelism,
in FP8.

    python examples/train_gpt.py                      # the GPUs (one process each), else 2 CPU processes
    torchrun --nproc-per-node=8 examples/train_gpt.py --tp 4 --layers 6 --hidden 512 --steps 2000
    NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC=8 launch/torchrun.sh examples/train_gpt.py
    sbatch launch/slurm.sbatch examples/train_gpt.py --tp 8
    NP=2 launch/mpirun.sh examples/train_gpt.py --tp 2
    python examples/train_gpt.py --device cpu --tp 1 --cp 2 --seq-len 256   # each sequence split over 2 ranks

Without a launcher it starts the processes itself: one per GPU, or 2 on the CPU (--nproc). The
processes form a mesh ("dp", "cp", "tp") of dp = world / (tp·cp) replicas: te_parallel's TP (+SP) inside
each TP group, each sequence split over the cp ranks of a replica (context parallelism, --cp), PyTorch's
FSDP2 (or DDP, --dp-engine) across the dp x cp ranks, which all see different tokens. It prints one
line with the layout it chose, trains with a progress bar, prints tokens/s and MFU, and ends with a line
naming every file it wrote: <out>/log.json (config, per-step loss, tokens/s, MFU, validation loss), <out>/loss.png,
and with --save DIR a torch.distributed.checkpoint that --resume DIR continues exactly.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import te_parallel as te
from te_parallel import recipe
from te_parallel.examples.checks import check_numbers, check_schedule, check_sizes
from te_parallel.examples.cli import CliError, build_parser, fail, warmup_steps
from te_parallel.examples.checkpoint import load_checkpoint, save_checkpoint
from te_parallel.examples.data import VOCAB, ByteData
from te_parallel.examples.data_parallel import apply_data_parallel
from te_parallel.examples.gpt import GPT, GPTConfig
from te_parallel.examples.layout import Launch, describe, plan_layout
from te_parallel.examples.runs import check_resume, checkpoint_config, choose_out, choose_save, written_files
from te_parallel.examples.throughput import flops_per_token, gemm_precision, mfu, peak_flops, steady, summary
from te_parallel.examples.world import World, destroy, init_world, run_world
from te_parallel.parallel.random import CudaRNGStatesTracker, model_parallel_seed

RECIPES = {"off": None, "delayed": lambda **kw: recipe.DelayedScaling(amax_history_len=16, **kw),
           "current": lambda **kw: recipe.Float8CurrentScaling(**kw), "block": lambda **kw: recipe.Float8BlockScaling(**kw)}


def make_recipe(args):
    """The recipe of --fp8, with --fp8-format and --fp8-block-scales applied (None for --fp8 off)."""
    make = RECIPES[args.fp8]
    if make is None:
        return None
    kw = {}
    if getattr(args, "fp8_format", None):
        kw["fp8_format"] = recipe.Format.E4M3 if args.fp8_format == "e4m3" else recipe.Format.HYBRID
    if getattr(args, "fp8_block_scales", None):
        qp = recipe.QParams(power_2_scale=args.fp8_block_scales == "pow2")
        kw.update(fp8_quant_fwd_inp=qp, fp8_quant_fwd_weight=qp, fp8_quant_bwd_grad=qp)
    return make(**kw)


def check_fp8_options(args) -> None:
    """--fp8-format and --fp8-block-scales against the recipe --fp8 settled on."""
    if getattr(args, "fp8_format", None) and args.fp8 == "off":
        raise CliError(f"--fp8-format {args.fp8_format} needs an FP8 recipe, got --fp8 off; drop --fp8-format or "
                       f"choose --fp8 delayed, current or block")
    if getattr(args, "fp8_block_scales", None) and args.fp8 != "block":
        raise CliError(f"--fp8-block-scales {args.fp8_block_scales} applies to --fp8 block only, got --fp8 {args.fp8}; "
                       f"drop it or use --fp8 block")


def prepare(args, launch: Launch):
    """Checks every argument and settles the layout, --out and --save, starting nothing; returns
    (layout, notes) or raises CliError."""
    check_numbers(args)
    check_schedule(args)
    layout = plan_layout(args, launch)
    args.tp, args.nproc, args.device = layout.tp, layout.nproc, layout.device
    check_fp8_options(args)
    args.ffn = args.ffn or 4 * args.hidden
    check_sizes(args, layout.tp, layout.nproc, layout.world_fixed, layout.what, layout.can_add)
    moe_note = check_moe(args, layout.nproc // layout.tp)
    notes = check_resume(args, layout.nproc, launch.launched) + ([moe_note] if moe_note else [])
    out_note = choose_out(args)
    choose_save(args)
    return layout, notes + ([out_note] if out_note else [])


def check_moe(args, dp: int) -> Optional[str]:
    """(MoE) --experts, --topk, --aux-loss-coeff and --ep against each other and the dp replicas; settles --topk;
    returns the line that describes the MoE layers (None for dense ones)."""
    if args.experts == 0:
        for flag, value, default in (("--topk", args.topk, None), ("--ep", args.ep, 1)):
            if value != default:
                raise CliError(f"{flag} {value} is for MoE layers; add --experts N (e.g. --experts 8)")
        return None
    if args.experts < 2:
        raise CliError(f"--experts {args.experts} must be at least 2 (or 0 for dense MLPs)")
    args.topk = 2 if args.topk is None else args.topk
    if not 1 <= args.topk <= args.experts:
        raise CliError(f"--topk {args.topk} must be between 1 and --experts {args.experts}")
    if not (math.isfinite(args.aux_loss_coeff) and args.aux_loss_coeff >= 0):
        raise CliError(f"--aux-loss-coeff {args.aux_loss_coeff} must be a number >= 0 (0: no load-balancing loss)")
    if args.ep < 1 or dp % args.ep or args.experts % args.ep:
        raise CliError(f"--ep {args.ep} must divide the {dp} data-parallel replica(s) (processes / --tp) and "
                       f"--experts {args.experts}; use --ep 1")
    if args.ep > 1 and args.dp_engine != "fsdp2":
        raise CliError(f"--ep {args.ep} needs --dp-engine fsdp2 (the experts are sharded over the replicas that "
                       f"hold them); drop --dp-engine {args.dp_engine} or use --ep 1")
    where = f", split over ep={args.ep} replicas" if args.ep > 1 else ""
    return (f"MoE: experts={args.experts} topk={args.topk} per layer{where}, load-balancing loss x "
            f"{args.aux_loss_coeff:g}")


def lr_at(step: int, args) -> float:
    warmup = warmup_steps(args)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def make_optimizer(params, args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: the loss (mean over the data-parallel replicas) and the global gradient norm
    before clipping (over every parameter's shards on every rank; the same on every rank)."""

    loss: float
    grad_norm: float
    aux_loss: Optional[float] = None  # (MoE) the load-balancing loss added to the loss for the gradients


class Trainer:
    def __init__(self, args, world: World) -> None:
        self.args, self.world = args, world
        torch.manual_seed(args.seed)  # same weights for replicated parameters on every rank
        self.tracker = CudaRNGStatesTracker(device=world.device.type)
        model_parallel_seed(self.tracker, args.seed, tp_rank=world.tp_rank)
        cfg = GPTConfig(VOCAB, args.layers, args.hidden, args.heads, args.ffn, args.seq_len, args.dropout,
                        getattr(args, "arch", "gpt"), getattr(args, "kv_heads", None) or 0,
                        args.experts, args.topk or 2, args.aux_loss_coeff)
        self.ep_mesh = expert_mesh(world, args.ep)
        self.ub = None
        if args.overlap:  # buffers for the largest exchange: [s/cp·b tokens, hidden]
            dtype = torch.bfloat16 if world.device.type == "cuda" and (args.precision or "bf16") == "bf16" else torch.float32
            self.ub = te.initialize_ub([args.seq_len // world.cp * args.micro_batch, args.hidden], world.tp_group,
                                       use_fp8=RECIPES[args.fp8] is not None, dtype=dtype)
        gpt = GPT(cfg, world.tp_mesh, args.sequence_parallel, self.tracker, device=world.device, ub_comm=self.ub,
                  ep_group=None if self.ep_mesh is None else self.ep_mesh["ep"], cp_group=world.cp_group,
                  cp_comm_type=args.cp_comm)
        gpt.init_like_single_rank(args.seed)
        if self.ep_mesh is not None:  # (MoE) before the data-parallel engine sees the layers
            shard_experts(gpt, self.ep_mesh["edp"], world.dp)
        self.recipe = make_recipe(args)
        self.flops_per_step = (flops_per_token(gpt.matmul_params(), args.layers, args.hidden, args.seq_len)
                               * args.seq_len * args.micro_batch * world.dp)
        self.model = apply_data_parallel(gpt, world, args.dp_engine)  # before the optimizer sees the parameters
        self.opt = make_optimizer(self.model.parameters(), args)
        self.data = ByteData(args.corpus_bytes, args.seq_len, cp_rank=world.cp_rank, cp_size=world.cp)
        # the same batch within a TP and a CP group (a CP rank keeps its chunks of it)
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + world.dp_rank)
        self.val = self.data.val_batches(args.eval_batches, args.micro_batch, world.device)
        self.step, self.log = 0, []
        self.precision = args.precision or ("bf16" if world.device.type == "cuda" else "fp32")
        self.autocast = dict(device_type=world.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        self.peak = peak_flops(world.device, gemm_precision(args.fp8, self.precision))

    def loss(self, ids, targets):
        with te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe, fp8_group=self.world.fp8_group):
            with torch.autocast(**self.autocast):
                return self.model(ids, targets)

    def train_step(self) -> StepResult:
        """One optimizer step; the data-parallel engine averages the gradients during backward, which
        are then clipped before the update."""
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.args)
        ids, targets = self.data.batch(self.gen, self.args.micro_batch, self.world.device)
        loss = self.loss(ids, targets)
        aux = te.moe_aux_loss(self.model)  # (MoE) the layers' load-balancing losses; None for dense layers
        (loss if aux is None else loss + aux).backward()
        grad_norm = self.clip_gradients()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        aux = None if aux is None else self.world.dp_mean(aux.detach())
        return StepResult(self.world.dp_mean(loss.detach()), grad_norm, aux)

    def clip_gradients(self) -> float:
        """Scales the averaged gradients down to the global norm --clip-grad where theirs is larger
        (--clip-grad 0: leaves them as they are); returns their norm before that. The norm is the whole
        model's, the same on every rank: every TP shard and FSDP2 shard once, every whole parameter once,
        (MoE) every expert once whichever ep rank holds it."""
        if self.args.clip_grad == 0:
            return te.get_total_norm(self.model).item()
        return te.clip_grad_norm_(self.model, self.args.clip_grad).item()

    def timed_step(self) -> dict:
        """train_step, with its tokens/s and MFU (None without a known peak, e.g. on the CPU)."""
        start = time.perf_counter()
        result = self.train_step()
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = self.args.seq_len * self.args.micro_batch * self.world.dp
        rec = {"step": self.step, "loss": result.loss, "grad_norm": result.grad_norm,
               "tokens_per_s": tokens / seconds, "mfu": mfu(self.flops_per_step, seconds, self.peak, self.world.size)}
        if result.aux_loss is not None:
            rec["aux_loss"] = result.aux_loss
        return rec

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        for ids, targets in self.val:
            self.drop_fp8_weights()
            total += self.loss(ids, targets).item()
        self.drop_fp8_weights()
        self.model.train()
        return self.world.dp_mean(torch.tensor(total / len(self.val), device=self.world.device))

    def drop_fp8_weights(self) -> None:
        """A forward without grad keeps its FP8 weights for the next one while the parameters' version
        counters and addresses stand still. FSDP2 re-gathers the unsharded parameters into fresh
        memory without bumping their version counters: whether the next forward reuses the weights
        (cast at the previous pass's scale) would depend on the allocator, and a training forward
        after the evaluation could reuse weights that the optimizer has changed since. So each
        evaluation forward casts its own weights, as TE does, and none are left behind."""
        for m in self.model.modules():
            if hasattr(m, "drop_fp8_weight_cache"):
                m.drop_fp8_weight_cache()

    def save(self, directory: str) -> None:
        save_checkpoint(directory, self, checkpoint_config(self.args, self.world.size, self.step))

    def load(self, directory: str) -> None:
        self.step, self.log = load_checkpoint(directory, self)


# --- (MoE) expert parallelism over the data-parallel replicas -------------------------------------------------
def expert_mesh(world: World, ep: int):
    """The ("edp", "ep", "tp") mesh of the world: the dp replicas in groups of ep consecutive ones ("ep": they
    split the experts), "edp": the replicas holding the same experts. None without expert parallelism."""
    if ep == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(world.device.type, (world.dp // ep, ep, world.tp), mesh_dim_names=("edp", "ep", "tp"))


def shard_experts(model, edp_mesh, dp: int) -> None:
    """fully_shard each MoE layer's experts over the replicas that hold them, the gradient divided by all dp
    replicas: the all-to-all's backward already summed the tokens of the ep replicas into it (MoELayer's doc)."""
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, te.MoELayer):
            fully_shard(m.experts, mesh=edp_mesh)
            m.experts.set_gradient_divide_factor(float(dp))
            if edp_mesh.size() > 1:  # a sum, then the division (gloo has no pre-multiplied sum); on one rank torch
                m.experts.set_force_sum_reduction_for_comms(True)  # 2.13 would divide twice, and needs no sum


def train(args, world: World) -> list:
    t = Trainer(args, world)
    if args.resume:
        t.load(args.resume)
    bar = None
    if world.rank == 0 and not args.quiet:
        from tqdm import tqdm
        dp = f" ({args.dp_engine})" if world.dp * world.cp > 1 else ""
        cp = f" cp={world.cp}" if world.cp > 1 else ""
        bar = tqdm(total=args.steps, initial=t.step, desc=f"GPT tp={world.tp}{cp} dp={world.dp}{dp} fp8={args.fp8}")
    stop = args.steps if args.stop_after is None else min(args.steps, t.step + args.stop_after)
    last_val = last_val_loss(t.log)  # (a resumed run's, from its checkpoint)
    while t.step < stop:
        rec = t.timed_step()
        evaluate = t.step % args.eval_every == 0 or t.step == args.steps
        if evaluate:
            rec["val_loss"] = last_val = t.evaluate()
        t.log.append(rec)
        if evaluate and world.rank == 0:
            write_log(args, world, t)  # a killed run still leaves its curve so far
        if bar is not None:
            bar.update(1)
            bar.set_postfix(bar_postfix(rec, last_val))
        if args.save and (t.step % args.save_every == 0 or t.step == stop):
            t.save(args.save)
    if bar is not None:
        bar.close()
    if world.rank == 0:
        write_outputs(args, world, t)
        if t.step < args.steps:
            print(f"train_gpt: stopped at step {t.step} of {args.steps} (--stop-after {args.stop_after}); saved the "
                  f"checkpoint to {args.save}: continue with --resume {args.save}", flush=True)
    return t.log


def last_val_loss(log: list) -> Optional[float]:
    """The latest validation loss of the log, None before the first evaluation."""
    return next((r["val_loss"] for r in reversed(log) if "val_loss" in r), None)


def bar_postfix(rec: dict, last_val: Optional[float]) -> dict:
    """The progress bar's numbers after a step: loss, the latest validation loss (once there is one),
    gradient norm, tokens/s and MFU (where the peak is known)."""
    postfix = {"loss": f"{rec['loss']:.3f}"}
    if last_val is not None:
        postfix["val"] = f"{last_val:.3f}"
    postfix.update(gnorm=f"{rec['grad_norm']:.3g}", tok_s=f"{rec['tokens_per_s']:.0f}")
    if rec["mfu"] is not None:
        postfix["mfu"] = f"{100 * rec['mfu']:.1f}%"
    return postfix


def write_log(args, world: World, t: Trainer) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(vars(args)) | {"world": world.size, "tp": world.tp, "cp": world.cp, "dp": world.dp,
                                 "device": str(world.device),
                                 "flops_per_step": t.flops_per_step, "peak_flops_per_device": t.peak,
                                 "mfu_precision": gemm_precision(args.fp8, t.precision)}
    if world.device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(world.device)
    steady_mfu = steady([r["mfu"] for r in t.log if r.get("mfu") is not None])
    speed = {"tokens_per_s": steady([r["tokens_per_s"] for r in t.log]), "mfu": steady_mfu}
    record = {"config": config, "validation_files": t.data.val_files, "throughput": speed, "log": t.log}
    (out / "log.json").write_text(json.dumps(record, indent=1))
    return out


def val_note(args, data: ByteData) -> str:
    """Why the validation curve can sit below the training one (on the plot, and after the summary)."""
    dropout = f" with dropout {args.dropout}," if args.dropout else ""
    return (f"validation is the held-out last 5% of the text ({data.describe_val()}), not a random sample: it sits "
            f"below train when those files are easier to predict than the training mix (train: each step's "
            f"batch,{dropout} before its update)")


def write_outputs(args, world: World, t: Trainer) -> None:
    out = write_log(args, world, t)
    log, note = t.log, val_note(args, t.data)
    if not args.no_plot:
        from te_parallel.examples.plot import plot_runs
        cp = f" cp={world.cp}" if world.cp > 1 else ""
        plot_runs({f"fp8 {args.fp8}, tp={world.tp}{cp} dp={world.dp}": log}, out / "loss.png", note=note)
    vals = [r["val_loss"] for r in log if "val_loss" in r]  # none before the first evaluation
    recent = [r["loss"] for r in log[-max(1, min(20, len(log) // 10)):]]  # the end of the run, not its start
    train_end = sum(recent) / len(recent)
    validation = f", validation {vals[0]:.3f} -> {vals[-1]:.3f}" if vals else ""
    print(f"train_gpt: {len(log)} steps; train loss {log[0]['loss']:.3f} -> {train_end:.3f} (mean of the last "
          f"{len(recent)} steps){validation}", flush=True)
    print(f"train_gpt: {summary(log, t.peak, world.size, gemm_precision(args.fp8, t.precision), world.device)}",
          flush=True)
    if vals and vals[-1] < train_end:
        print(f"train_gpt: {note}", flush=True)


def worker(args) -> None:
    world = init_world(args.tp, args.device, args.cp)
    try:
        train(args, world)
    finally:
        destroy(world)


def main(argv=None) -> None:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    launch = Launch.from_env()
    try:
        layout, notes = prepare(args, launch)
    except CliError as error:
        fail(parser, error, launch.speaks)
    if launch.leader:
        print(describe(args, layout), flush=True)
        for note in notes:
            print(f"train_gpt: {note}", flush=True)
    run_world(worker, args, args.nproc, args.device)
    if launch.leader:
        print(written_files(args, layout.nproc), flush=True)


if __name__ == "__main__":
    main()
