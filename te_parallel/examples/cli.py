"""Command line of the GPT trainer: the flags, their help, and one-line errors.

Every mistake on the command line ends in exactly one line on stderr and exit status 2, before any
process is started: argparse's own errors (an unknown flag, a value that is not a number) and the
checks of checks.py / layout.py / runs.py alike, which raise CliError.
"""
from __future__ import annotations

import argparse
import sys

DEFAULT_OUT = "runs/gpt"
RECIPE_NAMES = ("off", "delayed", "current", "block")
DP_ENGINES = ("fsdp2", "ddp")  # data_parallel.py builds them
CP_COMMS = ("p2p", "all_gather", "a2a")  # the attention modules' cp_comm_type
WARMUP_DEFAULT = 30  # the most warmup steps by default: a tenth of --steps, at most this


def warmup_steps(args) -> int:
    """--warmup, or by default a tenth of --steps, at most WARMUP_DEFAULT."""
    return min(WARMUP_DEFAULT, args.steps // 10) if args.warmup is None else args.warmup


class CliError(ValueError):
    """A mistake in the arguments: the message is the whole line the user sees (flag, value, fix)."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends "(default: …)" to every flag whose help does
    not already state its default."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def _parallel_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("parallelism and precision")
    g.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size: processes that split every layer; must divide the number of processes "
                        "and --heads (default: 2; 1 when the run has a single GPU)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: processes that split every sequence (each holds 2 of its 2 x cp "
                        "chunks; only the attention exchanges keys and values); --tp x --cp must divide the "
                        "processes and 2 x --cp the --seq-len")
    g.add_argument("--cp-comm", choices=CP_COMMS, default="p2p",
                   help="--cp: how the attention exchanges keys and values: p2p (a ring), all_gather, or a2a "
                        "(all-to-all trading heads for sequence; needs --heads / --tp divisible by --cp)")
    g.add_argument("--dp-engine", choices=DP_ENGINES, default="fsdp2",
                   help="how the data-parallel replicas (processes / --tp of them, with --cp: their cp ranks "
                        "counted, each seeing other tokens) share the work: fsdp2 shards "
                        "parameters, gradients and optimizer state over them (PyTorch's fully_shard on every "
                        "transformer block), ddp keeps whole replicas and all-reduces the gradients "
                        "(DistributedDataParallel); no effect with one replica")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="between the layers, keep 1/tp of the sequence on each TP rank (needs --seq-len divisible "
                        "by --tp; no effect with --tp 1)")
    g.add_argument("--fp8", choices=RECIPE_NAMES, default=None,
                   help="FP8 scaling recipe of the GEMMs: delayed (scales from an amax history), current (scales "
                        "from each tensor), block (a scale per 1x128 tile of activations and gradients and per "
                        "128x128 block of weights; Hopper GPUs with CUDA >= 12.9, or the CPU) or off (bf16/fp32 GEMMs). FP8 GEMMs need in and out features that are "
                        "multiples of 16: --hidden/--tp, --ffn/--tp and 256/--tp. Any token count runs (one that is "
                        "not a multiple of 16 is zero-padded inside the GEMM), except under --overlap, whose pieces "
                        "of --seq-len x --micro-batch / --tp tokens must be multiples of 16 (default: delayed; off "
                        "on a GPU without FP8, compute capability below 8.9)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 formats of the recipe: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients) "
                        "(default: the recipe's own, hybrid for delayed and current, e4m3 for block)")
    g.add_argument("--fp8-block-scales", choices=["pow2", "fp32"], default=None,
                   help="--fp8 block only: round each tile's scale down to a power of two (pow2, the default, as "
                        "TE and DeepSeek-V3) or keep it in fp32")
    g.add_argument("--overlap", action="store_true",
                   help="overlap the TP all-gathers/reduce-scatters with the GEMMs (needs --tp > 1 and sequence "
                        "parallelism; on the CPU it runs a point-to-point fallback)")
    g.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="dtype of the non-FP8 math (default: bf16 on CUDA, fp32 on the CPU)")


def _model_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model (byte-level GPT, vocabulary 256)")
    g.add_argument("--layers", type=int, default=2, help="transformer layers")
    g.add_argument("--hidden", type=int, default=128, help="hidden size; divisible by --heads")
    g.add_argument("--heads", type=int, default=4,
                   help="attention heads; --hidden/--heads must be even (rotary embedding)")
    g.add_argument("--ffn", type=int, default=None, help="FFN inner size (default: 4 x --hidden)")
    g.add_argument("--arch", choices=["gpt", "llama"], default="gpt",
                   help="layer kind: gpt (LayerNorm, GELU, biases, multi-head attention) or llama (RMSNorm, SwiGLU, "
                        "no biases, grouped-query attention with --kv-heads)")
    g.add_argument("--kv-heads", type=int, default=None,
                   help="--arch llama: key/value heads, a divisor of --heads (default: --heads)")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability of attention and hidden states")
    # (MoE)
    g.add_argument("--experts", type=int, default=0,
                   help="Mixture of Experts: each layer's MLP becomes a router and this many SwiGLU experts of --ffn "
                        "units (no biases), --topk of them per token; 0: dense MLPs")
    g.add_argument("--topk", type=int, default=None, help="--experts: experts per token (default: 2)")
    g.add_argument("--aux-loss-coeff", type=float, default=1e-2,
                   help="--experts: coefficient of the load-balancing loss added to the training loss")
    g.add_argument("--ep", type=int, default=1,
                   help="--experts: expert-parallel size, consecutive data-parallel replicas that split the experts "
                        "and exchange tokens by all-to-all; must divide the replicas (processes / --tp) and --experts; "
                        "needs --dp-engine fsdp2. Checkpoints hold every expert once and resume at any --ep")


def _training_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("training and data")
    g.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    g.add_argument("--micro-batch", type=int, default=16, help="sequences per step on each data-parallel replica")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    g.add_argument("--lr", type=float, default=2e-3,
                   help="peak AdamW learning rate (linear warmup, cosine decay to 10%%)")
    g.add_argument("--warmup", type=int, default=None,
                   help=f"warmup steps, fewer than --steps (default: a tenth of --steps, at most {WARMUP_DEFAULT})")
    g.add_argument("--clip-grad", type=float, default=1.0, metavar="MAX_NORM",
                   help="before each optimizer step, scale the gradients down to this global norm (over every "
                        "rank's shards) where it is larger; 0 turns clipping off. The norm is logged either way")
    g.add_argument("--eval-every", type=int, default=50,
                   help="steps between validation losses (also after the last step)")
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    g.add_argument("--corpus-bytes", type=int, default=4 << 20,
                   help="bytes of Python's standard-library sources used as text (at least 65536); the last 5%% "
                        "is held out for validation")
    g.add_argument("--seed", type=int, default=1234, help="seed of the weights, batches and dropout")


def _run_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("devices and processes")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPUs when there are any (one process per GPU), else the CPU (gloo)")
    g.add_argument("--nproc", type=int, default=None,
                   help="processes to start when not under a launcher (torchrun/mpirun), one per GPU on CUDA "
                        "(default: every GPU, rounded down to a multiple of --tp; on the CPU 2, or --tp if larger)")
    g = ap.add_argument_group("output and checkpoints")
    g.add_argument("--out", default=None,
                   help=f"directory for log.json and loss.png (default: {DEFAULT_OUT}; when that already holds a "
                        f"run, the first free {DEFAULT_OUT}-2, {DEFAULT_OUT}-3, ... is used instead). An --out "
                        f"given explicitly that already holds a run is refused unless --overwrite is given")
    g.add_argument("--overwrite", action="store_true",
                   help="allow writing over the run in --out and the checkpoint in --save")
    g.add_argument("--save", default=None,
                   help="checkpoint directory (a torch.distributed.checkpoint of model, optimizer, step, random "
                        "streams and data position, plus config.json), written every --save-every steps and at "
                        "the end (default: none; <out>/checkpoint with --stop-after)")
    g.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    g.add_argument("--resume", default=None,
                   help="continue from this --save directory, exactly, with the same sizes, --tp and processes "
                        "(default: start from scratch)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps of this run, at most the steps left to --steps, and save a "
                        "checkpoint (default: run to --steps)")
    g.add_argument("--no-plot", action="store_true", help="do not write loss.png")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser(description: str) -> argparse.ArgumentParser:
    ap = _Parser(description=description, formatter_class=_HelpFormatter,
                 epilog="Every mistake in the flags is reported in one line before any process starts.")
    _parallel_flags(ap)
    _model_flags(ap)
    _training_flags(ap)
    _run_flags(ap)
    for action in ap._actions:  # "--steps N", "--out DIR" rather than "--steps STEPS"
        if action.type is int:
            action.metavar = "N"
        elif action.dest in ("out", "save", "resume"):
            action.metavar = "DIR"
    return ap


def fail(parser: argparse.ArgumentParser, error: CliError, speak: bool = True):
    """Exit with status 2; the message is printed by one process per machine (`speak`)."""
    if speak:
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)
