"""Checks of the trainer's sizes, run before any process starts; each failure is one CliError line.

The GEMMs of the model (gpt.py: te.TransformerLayer + a column-parallel output layer), per TP rank,
with T = --tp, H = --hidden, F = --ffn and M = --seq-len x --micro-batch tokens (under sequence
parallelism the column-parallel layers gather the sequence and the row-parallel ones reduce-scatter
their full-sequence output, so every GEMM still sees all M tokens):

    QKV     (column)  M x H  ->  3H/T        attention out (row)  M x H/T -> H
    FFN fc1 (column)  M x H  ->  F/T         FFN fc2       (row)  M x F/T -> H
    output  (column)  M x H  ->  256/T  (the byte vocabulary)

Forward, dgrad and wgrad use the same three numbers. FP8 GEMMs need in and out features that are
multiples of 16: H/T, F/T and 256/T (H and 3H/T follow from H/T). Any M runs (the GEMM zero-pads a
token count that is not a multiple of 16), except with --overlap, which cuts each GEMM into the TP
ranks' pieces of M/T tokens, each a GEMM of its own: M/T must be a multiple of 16. Without FP8 only the
divisibility rules hold. Under context parallelism (--cp C) a rank holds --seq-len / C positions of each
sequence (2 of its 2·C chunks), and M is --seq-len / C x --micro-batch.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, List, Optional

from te_parallel.examples.cli import CliError, warmup_steps
from te_parallel.examples.data import MIN_CORPUS_BYTES, VAL_FRACTION, VOCAB

FP8_MULTIPLE = 16


def _or_list(flag: str, values: Iterable) -> str:
    """'--tp 1 or --tp 2', '--tp 1, --tp 2 or --tp 4'."""
    items = [f"{flag} {v}" for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _options(*fixes: str) -> str:
    """'A, or B, or C' of the fixes that are not empty."""
    return ", or ".join(f for f in fixes if f)


def nearby(value: int, ok: Callable[[int], bool], limit: int = 1 << 16) -> List[int]:
    """The nearest valid values below and above `value` (each if it exists)."""
    below = next((v for v in range(value - 1, 0, -1) if ok(v)), None)
    above = next((v for v in range(max(value + 1, 1), value + limit) if ok(v)), None)
    return [v for v in (below, above) if v is not None]


def check_numbers(args) -> None:
    """Counts and rates that must be positive (or in range)."""
    positive = ["layers", "hidden", "heads", "seq_len", "micro_batch", "steps", "eval_every", "eval_batches",
                "save_every"]
    positive += [n for n in ("ffn", "tp", "cp", "nproc", "stop_after") if getattr(args, n, None) is not None]
    for name in positive:
        value = getattr(args, name)
        if value < 1:
            raise CliError(f"--{name.replace('_', '-')} {value} must be a positive integer")
    if args.warmup is not None and args.warmup < 0:
        raise CliError(f"--warmup {args.warmup} must be 0 or more (steps of linear warmup)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise CliError(f"--lr {args.lr} must be a positive number; e.g. --lr 2e-3")
    if not 0 <= args.dropout < 1:
        raise CliError(f"--dropout {args.dropout} must be in [0, 1); e.g. --dropout 0.1")
    if not 0 <= args.seed < 2 ** 31:
        raise CliError(f"--seed {args.seed} must be in [0, 2^31)")
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        raise CliError(f"--corpus-bytes {args.corpus_bytes} is too little text; use --corpus-bytes {MIN_CORPUS_BYTES} "
                       f"or more")
    if not (math.isfinite(args.clip_grad) and args.clip_grad >= 0):
        raise CliError(f"--clip-grad {args.clip_grad} must be a positive number, the largest global gradient norm, "
                       f"or 0 for no clipping; e.g. --clip-grad 1.0")


def check_schedule(args) -> None:
    """--warmup and --stop-after against --steps (the steps left of a resumed run: runs.check_resume)."""
    if args.stop_after is not None and args.stop_after > args.steps:
        raise CliError(f"--stop-after {args.stop_after} is more than --steps {args.steps}; use --stop-after "
                       f"{args.steps} or less, or drop --stop-after to run to the end")
    args.warmup = warmup_steps(args)  # (the default settled here: logs and resumes see the number)
    if args.warmup >= args.steps:
        raise CliError(f"--warmup {args.warmup} is not less than --steps {args.steps}: the learning rate "
                       f"would still be warming up at the last step; use --warmup {args.steps - 1} or less, or "
                       f"--steps {args.warmup + 1} or more")


def _hidden_ok(args, tp: int, hidden: int, heads: int) -> bool:
    """Every rule on --hidden/--heads: whole heads of an even size on each rank, and with FP8 a
    multiple-of-16 share hidden/tp."""
    if hidden % heads or (hidden // heads) % 2 or heads % tp:
        return False
    return args.fp8 == "off" or (hidden // tp) % FP8_MULTIPLE == 0


def valid_tps(args, world: Optional[int], most: int = 3) -> List[int]:
    """Up to `most` of the largest TP sizes that split this model (and `world` processes, when fixed)."""
    limit = VOCAB // FP8_MULTIPLE if args.fp8 != "off" else VOCAB
    fits = [t for t in range(1, limit + 1) if VOCAB % t == 0 and (world is None or world % t == 0)]
    model = [t for t in fits if _hidden_ok(args, t, args.hidden, args.heads)]
    return (model or fits)[-most:]


def check_tp(args, tp: int, world: int, world_fixed: bool, what: str, can_add: bool) -> None:
    """TP divides the processes and the byte vocabulary. `what`: where the process count comes from
    ("--nproc 2", "WORLD_SIZE=8"); world_fixed: False when --nproc follows --tp; can_add: whether
    more processes can be asked for with --nproc."""
    fixed = world if world_fixed else None
    if world % tp:
        more = f", or --nproc {tp * (world // tp + 1)}" if can_add and tp in valid_tps(args, None, VOCAB) else ""
        raise CliError(f"--tp {tp} does not divide the {world} processes ({what}); "
                       f"use {_or_list('--tp', valid_tps(args, world))}{more}")
    if VOCAB % tp:
        raise CliError(f"--tp {tp} does not divide the vocabulary of {VOCAB} bytes that the embedding and the output "
                       f"layer split; use {_or_list('--tp', valid_tps(args, fixed))}")
    if args.fp8 != "off" and (VOCAB // tp) % FP8_MULTIPLE:
        raise CliError(f"--tp {tp}: FP8 GEMMs need in and out features that are multiples of 16, and the output "
                       f"layer's share of the vocabulary is {VOCAB}/tp = {VOCAB // tp}; use "
                       f"--tp {VOCAB // FP8_MULTIPLE} or less (or --fp8 off)")


def _model_fix(args, tp: int, world: Optional[int], tp_reason: bool) -> str:
    """How to fix --hidden/--heads for this TP size: another hidden, other heads, another TP size
    (when TP is what fails), or else the nearest working pair."""
    h, heads = args.hidden, args.heads
    hiddens = [] if tp_reason or heads % tp else nearby(h, lambda v: _hidden_ok(args, tp, v, heads))
    if hiddens:
        return _or_list("--hidden", hiddens)
    fixes = []
    head_opts = nearby(heads, lambda d: _hidden_ok(args, tp, h, d), limit=256)
    if head_opts:
        fixes.append(_or_list("--heads", head_opts))
    tps = [t for t in valid_tps(args, world, VOCAB) if _hidden_ok(args, t, h, heads)][-2:] if tp_reason else []
    if tps:
        fixes.append(_or_list("--tp", tps))
    if fixes:
        return ", or ".join(fixes)
    pairs = [(abs(v - h), abs(d - heads), -d, v) for d in range(max(1, heads - 8), heads + 9) if d % tp == 0
             for v in nearby(h, lambda v, d=d: _hidden_ok(args, tp, v, d))]
    _, _, d, v = min(pairs)
    why = f" (with --tp {tp} the heads must be a multiple of {tp})" if heads % tp else ""
    return f"e.g. --hidden {v} --heads {-d}{why}"


def check_model(args, tp: int, world: Optional[int] = None) -> None:
    """--hidden, --heads, --ffn against each other, the TP size and the FP8 rules."""
    h, heads = args.hidden, args.heads
    if h % heads:
        raise CliError(f"--hidden {h} is not divisible by --heads {heads}; use {_model_fix(args, tp, world, False)}")
    if (h // heads) % 2:
        raise CliError(f"--hidden {h} / --heads {heads} = {h // heads} channels per head, and the rotary position "
                       f"embedding needs an even number; use {_model_fix(args, tp, world, False)}")
    if heads % tp:
        raise CliError(f"--tp {tp} does not divide --heads {heads} (each rank computes whole heads); "
                       f"use {_model_fix(args, tp, world, True)}")
    kv = getattr(args, "kv_heads", None)
    if kv is not None and getattr(args, "arch", "gpt") != "llama":
        raise CliError(f"--kv-heads {kv} is for --arch llama (grouped-query attention); add --arch llama or drop it")
    if kv is not None and (kv < 1 or heads % kv or kv % tp):
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d % tp == 0]
        raise CliError(f"--kv-heads {kv} must divide --heads {heads} and be a multiple of --tp {tp}; use one of "
                       f"{divisors}")
    if args.fp8 != "off" and (h // tp) % FP8_MULTIPLE:
        share = f"with --tp {tp} each rank's share hidden/tp = {h // tp} is one" if tp > 1 else "hidden is one"
        raise CliError(f"--hidden {h}: FP8 GEMMs need in and out features that are multiples of 16, and {share}; "
                       f"use {_options(_model_fix(args, tp, world, False), '--fp8 off')}")
    ffns = _or_list("--ffn", nearby(args.ffn, lambda f: f % tp == 0 and _ffn_fp8_ok(args, tp, f)))
    if args.ffn % tp:
        raise CliError(f"--ffn {args.ffn} is not divisible by --tp {tp}; use {ffns}")
    if not _ffn_fp8_ok(args, tp, args.ffn):
        share = f"with --tp {tp} each rank's share ffn/tp = {args.ffn // tp} is one" if tp > 1 else "ffn is one"
        raise CliError(f"--ffn {args.ffn}: FP8 GEMMs need in and out features that are multiples of 16, and {share}; "
                       f"use {_options(ffns, '--fp8 off')}")


def _ffn_fp8_ok(args, tp: int, ffn: int) -> bool:
    return args.fp8 == "off" or (ffn % tp == 0 and (ffn // tp) % FP8_MULTIPLE == 0)


def _tokens_ok(args, tp: int, seq_len: int, micro_batch: int) -> bool:
    cp = getattr(args, "cp", 1)
    if cp > 1 and seq_len % (2 * cp):  # (context parallelism: 2·cp equal chunks of every sequence)
        return False
    local = seq_len // cp  # positions of a sequence on each CP rank
    sp = args.sequence_parallel and tp > 1
    if sp and local % tp:
        return False
    if args.fp8 == "off":
        return True
    tokens = local * micro_batch  # (a plain FP8 GEMM takes any token count; overlap's pieces do not)
    return not args.overlap or (tokens // tp) % FP8_MULTIPLE == 0


def check_tokens(args, tp: int) -> None:
    """--seq-len and --micro-batch: sequence parallelism splits the sequence; FP8 GEMMs see the tokens."""
    s, b, cp = args.seq_len, args.micro_batch, getattr(args, "cp", 1)
    seqs = _or_list("--seq-len", nearby(s, lambda v: _tokens_ok(args, tp, v, b)))
    batches = nearby(b, lambda v: _tokens_ok(args, tp, s, v))
    either = _options(_or_list("--micro-batch", batches) if batches else "", seqs)
    if cp > 1 and s % (2 * cp):
        raise CliError(f"--seq-len {s} is not divisible by 2 x --cp {cp} = {2 * cp}: context parallelism cuts every "
                       f"sequence into 2 x cp equal chunks, two per rank; use {seqs}")
    per_cp = f" / --cp {cp}" if cp > 1 else ""
    if args.sequence_parallel and tp > 1 and (s // cp) % tp:
        raise CliError(f"--seq-len {s}{per_cp} is not divisible by --tp {tp}, which sequence parallelism needs (each "
                       f"rank keeps seq-len{'/cp' if cp > 1 else ''}/tp positions between the layers); "
                       f"use {_options(seqs, '--no-sequence-parallel')}")
    if args.fp8 == "off":
        return
    tokens = s // cp * b
    if args.overlap and (tokens // tp) % FP8_MULTIPLE:
        raise CliError(f"--overlap cuts each FP8 GEMM into the TP ranks' pieces of --seq-len {s}{per_cp} x "
                       f"--micro-batch {b} / --tp {tp} = {tokens // tp} tokens, which must be a multiple of 16; use "
                       f"{_options(either, 'drop --overlap')}")


def check_overlap(args, tp: int) -> None:
    if not args.overlap:
        return
    if tp < 2:
        raise CliError(f"--overlap overlaps the tensor-parallel communication, and this run has --tp {tp}; "
                       f"use --tp 2 or more, or drop --overlap")
    if not args.sequence_parallel:
        raise CliError("--overlap needs sequence parallelism; drop --no-sequence-parallel (or --overlap)")


def check_cp(args, tp: int, world: int, what: str, can_add: bool) -> None:
    """--cp and --cp-comm against the processes, the heads and the other flags (the sequence length:
    check_tokens)."""
    cp, comm = getattr(args, "cp", 1), getattr(args, "cp_comm", "p2p")
    if cp == 1:
        if comm != "p2p":
            raise CliError(f"--cp-comm {comm} is for context parallelism; add --cp N (e.g. --cp 2) or drop --cp-comm")
        return
    if world % (tp * cp):
        more = f", or --nproc {tp * cp * (world // (tp * cp) + 1)}" if can_add else ""
        # (check_tp has seen tp divide world) the cp sizes that split the processes and the sequence
        fits = [c for c in range(1, world // tp + 1) if (world // tp) % c == 0
                and (c == 1 or args.seq_len % (2 * c) == 0 and (args.seq_len // c) % tp == 0)]
        raise CliError(f"--tp {tp} x --cp {cp} = {tp * cp} does not divide the {world} processes ({what}); use "
                       f"{_or_list('--cp', fits[-3:])}{more}")
    heads = args.heads // tp
    if comm == "a2a" and heads % cp:
        raise CliError(f"--cp-comm a2a spreads each TP rank's --heads {args.heads} / --tp {tp} = {heads} attention "
                       f"heads over the --cp {cp} ranks, which must divide them; use --cp-comm p2p or all_gather")
    if comm == "p2p" and args.dropout > 0:
        raise CliError(f"--dropout {args.dropout} under --cp {cp}: the p2p ring has no attention dropout; use "
                       f"--cp-comm all_gather or a2a, or --dropout 0")
    if getattr(args, "ep", 1) > 1:
        raise CliError(f"--ep {args.ep} and --cp {cp} together are not supported; use --ep 1 or --cp 1")


def check_data(args) -> None:
    """The validation split (the last 5% of the text) must hold one sequence and its next byte."""
    def val_bytes(total: int) -> int:
        return total - int(total * (1 - VAL_FRACTION))

    if args.seq_len > val_bytes(args.corpus_bytes) - 1:
        need = next(c for c in range(args.corpus_bytes, 1 << 62, max(1, args.seq_len // 64))
                    if val_bytes(c) - 1 >= args.seq_len)
        raise CliError(f"--seq-len {args.seq_len} is longer than the validation text ({val_bytes(args.corpus_bytes)} "
                       f"bytes, the last {VAL_FRACTION:.0%} of --corpus-bytes {args.corpus_bytes}); use --seq-len "
                       f"{val_bytes(args.corpus_bytes) - 1} or less, or --corpus-bytes {need} or more")


def check_tools(args) -> None:
    """The optional packages of the plot and the progress bar (pip install te_parallel[train])."""
    import importlib.util

    for module, flag in (("matplotlib", "--no-plot"), ("tqdm", "--quiet")):
        needed = not (args.no_plot if module == "matplotlib" else args.quiet)
        if needed and importlib.util.find_spec(module) is None:
            raise CliError(f"{module} is not installed; pip install {module} (or te_parallel[train]), or add {flag}")


def check_sizes(args, tp: int, world: int, world_fixed: bool, what: str, can_add: bool) -> None:
    """All size checks, in the order a user most likely wants to hear about them."""
    check_tp(args, tp, world, world_fixed, what, can_add)
    check_cp(args, tp, world, what, can_add)
    check_model(args, tp, world if world_fixed else None)
    check_overlap(args, tp)
    check_tokens(args, tp)
    check_data(args)
    check_tools(args)
