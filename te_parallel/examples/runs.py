"""The trainer's files: an --out that never silently replaces an earlier run, the checkpoint's
config.json (read before any process starts, to check --resume), and the line naming what was written.

A checkpoint directory holds rank<r>.pt for every process and config.json (the sizes and settings
of the run that saved it, and its step). A directory without config.json (written by an older
trainer) is still checked: its sizes are read from rank0.pt's tensor shapes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

from te_parallel.examples.cli import DEFAULT_OUT, CliError

CONFIG = "config.json"
# sizes a checkpoint can only be loaded with (the heads would load but mean other weights)
SIZE_FLAGS = {"layers": "--layers", "hidden": "--hidden", "heads": "--heads", "ffn": "--ffn", "tp": "--tp",
              "world": "--nproc"}
# settings that load under any value, but the run then differs from the uninterrupted one
SETTING_FLAGS = {"fp8": "--fp8", "sequence_parallel": "--sequence-parallel", "seq_len": "--seq-len",
                 "micro_batch": "--micro-batch", "corpus_bytes": "--corpus-bytes", "seed": "--seed", "lr": "--lr",
                 "warmup": "--warmup", "steps": "--steps", "dropout": "--dropout"}


def holds_run(path) -> bool:
    return (Path(path) / "log.json").is_file()


def holds_checkpoint(path) -> bool:
    return (Path(path) / "rank0.pt").is_file()


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
        raise CliError(f"--save {args.save} is a file; give a directory (it will hold one file per process)")
    if not args.save or not holds_checkpoint(args.save) or args.overwrite:
        return
    if args.resume and Path(args.resume).resolve() == Path(args.save).resolve():
        return  # continuing a checkpoint in place
    raise CliError(f"--save {args.save} already holds a checkpoint; use another --save, --resume {args.save} to "
                   f"continue it, or add --overwrite to replace it")


def checkpoint_config(args, world: int, step: int) -> dict:
    cfg = {k: getattr(args, k) for k in SIZE_FLAGS if k != "world"}
    cfg.update({k: getattr(args, k) for k in SETTING_FLAGS}, world=world, step=step)
    return cfg


def _infer_config(directory: Path) -> dict:
    """Sizes of a checkpoint without config.json, from rank0.pt's shapes (not the heads)."""
    import torch

    try:
        state = torch.load(directory / "rank0.pt", map_location="cpu", mmap=True, weights_only=True)
        model = state["model"]
        vocab_local, hidden = model["embed.weight"].shape
        tp = 256 // vocab_local
        layers = 1 + max(int(m.group(1)) for k in model if (m := re.match(r"layers\.(\d+)\.", k)))
        fc1 = next(v for k, v in model.items() if k.endswith("fc1_weight"))
    except Exception as e:  # noqa: BLE001 (any unreadable file gets the same one-line answer)
        raise CliError(f"--resume {directory}: rank0.pt is not a checkpoint of this trainer ({type(e).__name__}); "
                       f"give the --save directory of an earlier run") from None
    return {"layers": layers, "hidden": hidden, "tp": tp, "ffn": fc1.shape[0] * tp, "step": state.get("step")}


def read_checkpoint(path: str) -> dict:
    """The checkpoint's config (with 'files': its rank files' count), or a CliError."""
    directory = Path(path)
    if not directory.exists():
        raise CliError(f"--resume {path}: no such directory; give the --save directory of an earlier run")
    if not directory.is_dir() or not holds_checkpoint(directory):
        raise CliError(f"--resume {path} holds no checkpoint (no rank0.pt); give the --save directory of an "
                       f"earlier run")
    ranks = len(list(directory.glob("rank*.pt")))
    try:
        cfg = json.loads((directory / CONFIG).read_text()) if (directory / CONFIG).is_file() else None
    except (OSError, ValueError) as e:
        raise CliError(f"--resume {path}: cannot read {CONFIG} ({e})") from None
    cfg = cfg if isinstance(cfg, dict) else _infer_config(directory)
    cfg.setdefault("world", ranks)
    return cfg | {"files": ranks}


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
    if cfg["files"] < nproc:
        raise CliError(f"--resume {args.resume} holds {cfg['files']} of the {nproc} rank files (rank0.pt ... "
                       f"rank{nproc - 1}.pt); give a complete checkpoint directory")
    step = cfg.get("step")
    if isinstance(step, int) and step >= args.steps:
        raise CliError(f"--resume {args.resume} is at step {step}, and --steps {args.steps} leaves nothing to train; "
                       f"use a larger --steps")
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
    if args.save and holds_checkpoint(args.save):
        ranks = [f"rank{r}.pt" for r in range(nproc)]
        names = ", ".join(ranks) if nproc <= 4 else f"{ranks[0]} ... {ranks[-1]}"
        parts.append(f"checkpoint {Path(args.save)}/ ({CONFIG}, {names})")
    return "train_gpt: wrote " + ", ".join(parts) if parts else "train_gpt: wrote no files"
