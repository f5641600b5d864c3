"""The trainer's checkpoints: one torch.distributed.checkpoint (DCP) directory for the whole world.

What a checkpoint holds, and why each part is there:
- "train": model and optimizer state from `te.dcp_state_dict`: torch's `get_state_dict` (FSDP2's
  DTensors, DDP's unwrapped names), with every TP shard placed at its offset in the full (TP=1)
  tensor. DCP then stores each piece of each tensor once, whichever rank holds it: the TP shards of
  all TP ranks, the FSDP2 shards of all DP ranks, (MoE) each expert from the ep rank that holds it,
  under its name in the one-rank model, one copy of what is replicated (the FP8 scaling
  state is identical everywhere: its amaxes are reduced over the whole mesh). Plain local TP tensors
  would not do: DCP takes a plain tensor for a whole one held by every rank and keeps one rank's.
- "step" and, from rank 0, "log": where the run stands and its curve so far (JSON text).
- "rank<r>": rank r's random streams: the CPU and CUDA generators (dropout), the TP tracker's
  states, and the data generator, whose state is the position in the training data (batches are
  random windows drawn from it). They are what makes a resume exact, and they belong to one layout:
  the trainer resumes at the same TP size and process count (the command line checks config.json).
config.json, written by rank 0 after the data, holds the sizes and settings the command line checks
before starting any process; its presence marks a complete checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import te_parallel as te
from te_parallel.examples.runs import CONFIG


def _rng_state(trainer) -> Dict[str, object]:
    world = trainer.world
    state = {"cpu": torch.get_rng_state(), "data": trainer.gen.get_state(),
             "tracker": dict(trainer.tracker.get_states())}
    if world.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(world.device)
    return state


def save_checkpoint(directory: str, trainer, config: dict) -> None:
    """Writes the DCP directory (collective: every rank calls it), then rank 0 writes `config`."""
    world = trainer.world
    state = {"train": te.dcp_state_dict(trainer.model, trainer.opt), "step": trainer.step,
             f"rank{world.rank}": _rng_state(trainer)}
    if world.rank == 0:
        state["log"] = json.dumps(trainer.log)
    Path(directory).mkdir(parents=True, exist_ok=True)
    if world.rank == 0:  # an earlier save's config.json would vouch for a half-written one
        (Path(directory) / CONFIG).unlink(missing_ok=True)
    dcp.save(state, checkpoint_id=directory)
    if world.rank == 0:
        (Path(directory) / CONFIG).write_text(json.dumps(config, indent=1))
    dist.barrier()


def load_checkpoint(directory: str, trainer) -> Tuple[int, List[dict]]:
    """Loads model, optimizer and this rank's random streams in place (collective); returns (step, log),
    the log only on rank 0 (the others get [])."""
    world = trainer.world
    state = {"train": te.dcp_state_dict(trainer.model, trainer.opt), "step": 0,
             f"rank{world.rank}": _rng_state(trainer)}  # templates: DCP loads into their tensors
    if world.rank == 0:
        state["log"] = ""
    dcp.load(state, checkpoint_id=directory)
    te.load_dcp_state_dict(trainer.model, state["train"], trainer.opt)
    rng = state[f"rank{world.rank}"]
    torch.set_rng_state(rng["cpu"])
    trainer.gen.set_state(rng["data"])
    trainer.tracker.set_states(rng["tracker"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], world.device)
    return state["step"], json.loads(state["log"]) if world.rank == 0 else []
