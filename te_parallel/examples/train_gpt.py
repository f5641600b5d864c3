"""Train a byte-level GPT on Python's standard library with tensor (+sequence) and data parallelism.

    python examples/train_gpt.py                      # 2 ranks on the CPU (gloo): TP=2, SP, FP8 delayed
    torchrun --nproc-per-node=8 examples/train_gpt.py --tp 4 --layers 6 --hidden 512 --steps 2000
    NP=2 launch/mpirun.sh examples/train_gpt.py --tp 2

Without a launcher it starts --nproc processes itself. world = tp × dp; ranks [k·tp, (k+1)·tp) form
a TP group. Writes <out>/log.json (config, per-step loss, tokens/s, validation loss) and
<out>/loss.png; --save DIR checkpoints every --save-every steps, --resume DIR continues exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe
from te_parallel.examples.data import VOCAB, ByteData
from te_parallel.examples.gpt import GPT, GPTConfig
from te_parallel.examples.world import World, destroy, init_world, run_world
from te_parallel.parallel.random import CudaRNGStatesTracker, model_parallel_seed

# min_fp8_gemm=0: every GEMM in FP8 even at this example's small sizes, where the default would run
# them in bf16 on a GPU (Recipe.min_fp8_gemm): the example exists to train with FP8.
RECIPES = {"off": None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=16, min_fp8_gemm=0),
           "current": lambda: recipe.Float8CurrentScaling(min_fp8_gemm=0)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--fp8", choices=list(RECIPES), default="delayed")
    ap.add_argument("--overlap", action="store_true",
                    help="comm-GEMM overlap of the TP all-gathers/reduce-scatters (needs --tp > 1 and sequence parallel)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--corpus-bytes", type=int, default=4 << 20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--nproc", type=int, default=2, help="processes to start when not under a launcher")
    ap.add_argument("--out", default="runs/gpt")
    ap.add_argument("--save", default=None)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this many steps of this run")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.overlap and (args.tp < 2 or not args.sequence_parallel):
        ap.error(f"--overlap needs --tp > 1 and sequence parallelism (got --tp {args.tp}, "
                 f"sequence_parallel={args.sequence_parallel})")
    args.ffn = args.ffn or 4 * args.hidden
    return args


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
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(self.state(), Path(directory) / f"rank{self.world.rank}.pt")
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
            write_log(args, world, t.log)  # a killed run still leaves its curve so far
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{last_val:.3f}",
                            tok_s=f"{rec['tokens_per_s']:.0f}")
        if args.save and (t.step % args.save_every == 0 or t.step == stop):
            t.save(args.save)
    if bar is not None:
        bar.close()
    if world.rank == 0:
        write_outputs(args, world, t.log)
    return t.log


def write_log(args, world: World, log: list) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(vars(args)) | {"world": world.size, "tp": world.tp, "dp": world.dp, "device": str(world.device)}
    if world.device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(world.device)
    (out / "log.json").write_text(json.dumps({"config": config, "log": log}, indent=1))
    return out


def write_outputs(args, world: World, log: list) -> None:
    out = write_log(args, world, log)
    if not args.no_plot:
        from te_parallel.examples.plot import plot_runs
        plot_runs({f"fp8={args.fp8} tp={world.tp}": log}, out / "loss.png")
    vals = [r["val_loss"] for r in log if "val_loss" in r] or [float("nan")]
    print(f"train_gpt: {len(log)} steps, loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}, "
          f"val {vals[0]:.3f} -> {vals[-1]:.3f}; wrote {out / 'log.json'}")


def worker(args) -> None:
    world = init_world(args.tp, args.device)
    try:
        train(args, world)
    finally:
        destroy()


def main(argv=None) -> None:
    args = parse_args(argv)
    run_world(worker, args, args.nproc, args.device)


if __name__ == "__main__":
    main()
