"""The trainer's files: an --out that never silently replaces an earlier run, the checkpoint's
config.json (read before any process starts, to check --resume), and the line naming what was written.

A checkpoint directory is a torch.distributed.checkpoint (its index `.metadata` and one data file
per writing process; checkpoint.py says what it holds) plus config.json: the sizes and settings of
the run that saved it, and its step. config.json is written last, so a directory without it holds an
unfinished save.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from te_parallel.examples.cli import DEFAULT_OUT, CliError

CONFIG = "config.json"
METADATA = ".metadata"  # DCP's index of the saved tensors
LEGACY = "rank0.pt"  # the one-file-per-process format of earlier versions of this trainer
# sizes a checkpoint can only be loaded with (the heads would load but mean other weights)
SIZE_FLAGS = {"layers": "--layers", "hidden": "--hidden", "heads": "--heads", "ffn": "--ffn", "tp": "--tp",
              "world": "--nproc", "arch": "--arch", "kv_heads": "--kv-heads", "experts": "--experts", "topk": "--topk",
              "cp": "--cp"}
# what a checkpoint written before a size flag existed was made with
SIZE_DEFAULTS = {"arch": "gpt", "kv_heads": None, "experts": 0, "topk": None, "cp": 1}
# settings that load under any value, but the run then differs from the uninterrupted one
SETTING_FLAGS = {"fp8": "--fp8", "sequence_parallel": "--sequence-parallel", "seq_len": "--seq-len",
                 "micro_batch": "--micro-batch", "corpus_bytes": "--corpus-bytes", "seed": "--seed", "lr": "--lr",
                 "warmup": "--warmup", "steps": "--steps", "dropout": "--dropout", "clip_grad": "--clip-grad",
                 "aux_loss_coeff": "--aux-loss-coeff", "cp_comm": "--cp-comm", "ep": "--ep"}


def holds_run(path) -> bool:
    return (Path(path) / "log.json").is_file()


def holds_checkpoint(path) -> bool:
    """Any checkpoint, finished or not, of this trainer's format or the earlier one."""
    return any((Path(path) / name).is_file() for name in (CONFIG, METADATA, LEGACY))


def choose_out(args) -> Optional[str]:
    """Sets args.out; returns a note when it is not what was asked, raises when it would replace a run."""
    base = Path(args.out or DEFAULT_OUT)
    if base.exists() and not base.is_dir():
        raise CliError(f"--out {base} is a file; give a directory (it will hold log.json and loss.png)")
    if not holds_run(base):
        args.out = str(base)
        return None
    if args.overwrite:
        args.out = str(base)
        return f"--overwrite: replacing the run in {base}"
    if args.out is not None:
        raise CliError(f"--out {base} already holds a run (log.json); use another --out, or add --overwrite to "
                       f"replace it")
    n = 2
    while holds_run(f"{base}-{n}"):
        n += 1
    args.out = f"{base}-{n}"
    return f"{base} holds an earlier run; writing this one to {args.out} (--out to choose, --overwrite to replace)"


def choose_save(args) -> None:
    """--stop-after saves to <out>/checkpoint unless --save is given; an earlier checkpoint is kept."""
    if args.save is None and args.stop_after is not None:
        args.save = str(Path(args.out) / "checkpoint")
    if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
        raise CliError(f"--save {args.save} is a file; give a directory (it will hold the checkpoint's files)")
    if not args.save or not holds_checkpoint(args.save) or args.overwrite:
        return
    if args.resume and Path(args.resume).resolve() == Path(args.save).resolve():
        return  # continuing a checkpoint in place
    raise CliError(f"--save {args.save} already holds a checkpoint; use another --save, --resume {args.save} to "
                   f"continue it, or add --overwrite to replace it")


def checkpoint_config(args, world: int, step: int) -> dict:
    """config.json: the sizes, the settings, the step; and the data-parallel engine, for information
    only (a checkpoint loads under either: DCP moves between FSDP2's shards and DDP's whole tensors)."""
    cfg = {k: getattr(args, k) for k in SIZE_FLAGS if k != "world"}
    cfg.update({k: getattr(args, k) for k in SETTING_FLAGS}, world=world, step=step, dp_engine=args.dp_engine)
    return cfg


def read_checkpoint(path: str) -> dict:
    """The checkpoint's config.json, or a CliError."""
    directory = Path(path)
    if not directory.exists():
        raise CliError(f"--resume {path}: no such directory; give the --save directory of an earlier run")
    if (directory / LEGACY).is_file() and not (directory / METADATA).is_file():
        raise CliError(f"--resume {path} holds a checkpoint of an earlier version of this trainer (one rank<r>.pt "
                       f"per process), which this one does not read; start from scratch, or resume it with that "
                       f"version")
    if not directory.is_dir() or not (directory / METADATA).is_file():
        raise CliError(f"--resume {path} holds no checkpoint (no {METADATA}); give the --save directory of an "
                       f"earlier run")
    if not (directory / CONFIG).is_file():
        raise CliError(f"--resume {path} has no {CONFIG}: its save did not finish; resume from a complete "
                       f"checkpoint")
    try:
        cfg = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"--resume {path}: cannot read {CONFIG} ({e})") from None
    if isinstance(cfg, dict):
        cfg = {**SIZE_DEFAULTS, **cfg}
    if not isinstance(cfg, dict) or not all(k in cfg for k in SIZE_FLAGS):
        raise CliError(f"--resume {path}: {CONFIG} does not hold the sizes {', '.join(SIZE_FLAGS)}; give the --save "
                       f"directory of an earlier run")
    return cfg


def check_resume(args, nproc: int, launched: bool) -> List[str]:
    """--resume: the checkpoint exists, matches this run's sizes and has steps left; returns notes."""
    if not args.resume:
        return []
    cfg = read_checkpoint(args.resume)
    mine = {k: getattr(args, k) for k in SIZE_FLAGS if k != "world"} | {"world": nproc}

    def flags(values: Dict[str, object], keys) -> str:
        return " ".join(f"{values[k]} processes" if k == "world" and launched else f"{SIZE_FLAGS[k]} {values[k]}"
                        for k in keys)

    diff = [k for k in SIZE_FLAGS if cfg.get(k) is not None and cfg[k] != mine[k]]
    if diff:
        raise CliError(f"--resume {args.resume} was saved with {flags(cfg, diff)}, and this run has "
                       f"{flags(mine, diff)}; rerun with {flags(cfg, diff)}")
    step = cfg.get("step")
    if isinstance(step, int) and step >= args.steps:
        raise CliError(f"--resume {args.resume} is at step {step}, and --steps {args.steps} leaves nothing to train; "
                       f"use a larger --steps")
    if isinstance(step, int) and args.stop_after is not None and args.stop_after > args.steps - step:
        left = args.steps - step
        raise CliError(f"--stop-after {args.stop_after} is more than the steps left from step {step} of --resume "
                       f"{args.resume} to --steps {args.steps} ({left}); use --stop-after {left} or less, or drop "
                       f"--stop-after to run to the end")
    changed = [f"{_setting(k, getattr(args, k))} (saved: {_setting(k, cfg[k])})" for k in SETTING_FLAGS
               if k in cfg and cfg[k] != getattr(args, k)]
    if changed:
        return [f"resuming {args.resume} with {', '.join(changed)}: this run will differ from the uninterrupted one"]
    return []


def _setting(key: str, value) -> str:
    if isinstance(value, bool):
        return SETTING_FLAGS[key] if value else SETTING_FLAGS[key].replace("--", "--no-", 1)
    return f"{SETTING_FLAGS[key]} {value}"


def written_files(args, nproc: int) -> str:
    """The closing line: every file this run wrote."""
    out = Path(args.out)
    parts = [str(p) for p in (out / "log.json", out / "loss.png") if p.is_file() and
             (p.name != "loss.png" or not args.no_plot)]
    if args.save and (Path(args.save) / CONFIG).is_file():
        parts.append(f"checkpoint {Path(args.save)}/ ({CONFIG} and a torch.distributed.checkpoint of {nproc} "
                     f"process{'es' if nproc > 1 else ''})")
    return "train_gpt: wrote " + ", ".join(parts) if parts else "train_gpt: wrote no files"
