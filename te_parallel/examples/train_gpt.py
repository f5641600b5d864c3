"""Train a byte-level GPT on Python's standard library with tensor (+sequence) and data parallelism, in FP8.

    python examples/train_gpt.py                      # the GPUs (one process each), else 2 CPU processes
    torchrun --nproc-per-node=8 examples/train_gpt.py --tp 4 --layers 6 --hidden 512 --steps 2000
    NP=2 launch/mpirun.sh examples/train_gpt.py --tp 2

Without a launcher it starts the processes itself: one per GPU, or 2 on the CPU (--nproc). world =
tp x dp; ranks [k*tp, (k+1)*tp) form a TP group. It prints one line with the layout it chose, trains
with a progress bar, and ends with a line naming every file it wrote: <out>/log.json (config, per-step
loss, tokens/s, validation loss), <out>/loss.png, and with --save DIR a checkpoint that --resume DIR
continues exactly.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe
from te_parallel.examples.checks import check_numbers, check_sizes
from te_parallel.examples.cli import CliError, build_parser, fail
from te_parallel.examples.data import VOCAB, ByteData
from te_parallel.examples.gpt import GPT, GPTConfig
from te_parallel.examples.layout import Launch, describe, plan_layout
from te_parallel.examples.runs import CONFIG, check_resume, checkpoint_config, choose_out, choose_save, written_files
from te_parallel.examples.world import World, destroy, init_world, run_world
from te_parallel.parallel.random import CudaRNGStatesTracker, model_parallel_seed

RECIPES = {"off": None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=16),
           "current": lambda: recipe.Float8CurrentScaling()}


def prepare(args, launch: Launch):
    """Checks every argument and settles the layout, --out and --save, starting nothing; returns
    (layout, notes) or raises CliError."""
    check_numbers(args)
    layout = plan_layout(args, launch)
    args.tp, args.nproc, args.device = layout.tp, layout.nproc, layout.device
    args.ffn = args.ffn or 4 * args.hidden
    check_sizes(args, layout.tp, layout.nproc, layout.world_fixed, layout.what, layout.can_add)
    notes = check_resume(args, layout.nproc, launch.launched)
    out_note = choose_out(args)
    choose_save(args)
    return layout, notes + ([out_note] if out_note else [])


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class Trainer:
    def __init__(self, args, world: World) -> None:
        self.args, self.world = args, world
        torch.manual_seed(args.seed)  # same weights for replicated parameters on every rank
        self.tracker = CudaRNGStatesTracker(device=world.device.type)
        model_parallel_seed(self.tracker, args.seed, tp_rank=world.tp_rank)
        cfg = GPTConfig(VOCAB, args.layers, args.hidden, args.heads, args.ffn, args.seq_len, args.dropout)
        self.ub = None
        if args.overlap:  # buffers for the largest exchange: [s·b tokens, hidden]
            dtype = torch.bfloat16 if world.device.type == "cuda" and (args.precision or "bf16") == "bf16" else torch.float32
            self.ub = te.initialize_ub([args.seq_len * args.micro_batch, args.hidden], world.tp_group,
                                       use_fp8=RECIPES[args.fp8] is not None, dtype=dtype)
        self.model = GPT(cfg, world.tp_group, args.sequence_parallel, self.tracker, device=world.device,
                         ub_comm=self.ub)
        self.model.init_like_single_rank(args.seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
        self.data = ByteData(args.corpus_bytes, args.seq_len)
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + world.dp_rank)  # same batch within a TP group
        self.val = self.data.val_batches(args.eval_batches, args.micro_batch, world.device)
        self.recipe = RECIPES[args.fp8]() if RECIPES[args.fp8] else None
        self.step, self.log = 0, []
        precision = args.precision or ("bf16" if world.device.type == "cuda" else "fp32")
        self.autocast = dict(device_type=world.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def loss(self, ids, targets):
        with te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe, fp8_group=self.world.fp8_group):
            with torch.autocast(**self.autocast):
                return self.model(ids, targets)

    def train_step(self) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.args)
        ids, targets = self.data.batch(self.gen, self.args.micro_batch, self.world.device)
        loss = self.loss(ids, targets)
        loss.backward()
        self.world.average_grads(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return self.world.dp_mean(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = sum(self.loss(ids, t).item() for ids, t in self.val) / len(self.val)
        self.model.train()
        return self.world.dp_mean(torch.tensor(total, device=self.world.device))

    def state(self) -> dict:
        cuda = torch.cuda.get_rng_state(self.world.device) if self.world.device.type == "cuda" else None
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step, "log": self.log,
                "gen": self.gen.get_state(), "cpu_rng": torch.get_rng_state(), "cuda_rng": cuda,
                "tracker": self.tracker.get_states()}

    def save(self, directory: str) -> None:
        """rank<r>.pt per process, and config.json (sizes, settings, step) that --resume checks first."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(self.state(), Path(directory) / f"rank{self.world.rank}.pt")
        if self.world.rank == 0:
            cfg = checkpoint_config(self.args, self.world.size, self.step)
            (Path(directory) / CONFIG).write_text(json.dumps(cfg, indent=1))
        dist.barrier()

    def load(self, directory: str) -> None:
        st = torch.load(Path(directory) / f"rank{self.world.rank}.pt", map_location=self.world.device, weights_only=False)
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.step, self.log = st["step"], st["log"]
        self.gen.set_state(st["gen"])
        torch.set_rng_state(st["cpu_rng"])
        if st["cuda_rng"] is not None:
            torch.cuda.set_rng_state(st["cuda_rng"], self.world.device)
        self.tracker.set_states(st["tracker"])


def train(args, world: World) -> list:
    t = Trainer(args, world)
    if args.resume:
        t.load(args.resume)
    bar = None
    if world.rank == 0 and not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=t.step, desc=f"GPT tp={world.tp} dp={world.dp} fp8={args.fp8}")
    tokens = args.seq_len * args.micro_batch * world.dp
    stop = args.steps if args.stop_after is None else min(args.steps, t.step + args.stop_after)
    last_val = float("nan")
    while t.step < stop:
        start = time.perf_counter()
        loss = t.train_step()
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        rec = {"step": t.step, "loss": loss, "tokens_per_s": tokens / (time.perf_counter() - start)}
        evaluate = t.step % args.eval_every == 0 or t.step == args.steps
        if evaluate:
            rec["val_loss"] = last_val = t.evaluate()
        t.log.append(rec)
        if evaluate and world.rank == 0:
            write_log(args, world, t.log, t.data)  # a killed run still leaves its curve so far
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{last_val:.3f}",
                            tok_s=f"{rec['tokens_per_s']:.0f}")
        if args.save and (t.step % args.save_every == 0 or t.step == stop):
            t.save(args.save)
    if bar is not None:
        bar.close()
    if world.rank == 0:
        write_outputs(args, world, t.log, t.data)
        if t.step < args.steps:
            print(f"train_gpt: stopped at step {t.step} of {args.steps} (--stop-after {args.stop_after}); saved the "
                  f"checkpoint to {args.save}: continue with --resume {args.save}", flush=True)
    return t.log


def write_log(args, world: World, log: list, data: ByteData) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(vars(args)) | {"world": world.size, "tp": world.tp, "dp": world.dp, "device": str(world.device)}
    if world.device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(world.device)
    record = {"config": config, "validation_files": data.val_files, "log": log}
    (out / "log.json").write_text(json.dumps(record, indent=1))
    return out


def val_note(args, data: ByteData) -> str:
    """Why the validation curve can sit below the training one (on the plot, and after the summary)."""
    dropout = f" with dropout {args.dropout}," if args.dropout else ""
    return (f"validation is the held-out last 5% of the text ({data.describe_val()}), not a random sample: it sits "
            f"below train when those files are easier to predict than the training mix (train: each step's "
            f"batch,{dropout} before its update)")


def write_outputs(args, world: World, log: list, data: ByteData) -> None:
    out = write_log(args, world, log, data)
    note = val_note(args, data)
    if not args.no_plot:
        from te_parallel.examples.plot import plot_runs
        plot_runs({f"fp8 {args.fp8}, tp={world.tp} dp={world.dp}": log}, out / "loss.png", note=note)
    vals = [r["val_loss"] for r in log if "val_loss" in r] or [float("nan")]
    recent = [r["loss"] for r in log[-max(1, min(20, len(log) // 10)):]]  # the end of the run, not its start
    train_end = sum(recent) / len(recent)
    print(f"train_gpt: {len(log)} steps; train loss {log[0]['loss']:.3f} -> {train_end:.3f} (mean of the last "
          f"{len(recent)} steps), validation {vals[0]:.3f} -> {vals[-1]:.3f}", flush=True)
    if vals[-1] < train_end:
        print(f"train_gpt: {note}", flush=True)


def worker(args) -> None:
    world = init_world(args.tp, args.device)
    try:
        train(args, world)
    finally:
        destroy()


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
