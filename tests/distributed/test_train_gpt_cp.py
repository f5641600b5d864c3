"""Context parallelism in the trainer (--cp), on CPU (gloo): the same seed gives the same losses, gradient
norms and validation loss at cp=2 (the p2p ring, FSDP2 sharding over the cp ranks) and at cp=2 x tp=2 with
sequence parallelism (a2a, DDP over the cp ranks) as in one process holding whole sequences; and the world's
("dp", "cp", "tp") mesh puts every rank where the trainer expects it, with dp and cp flattened into the axis
that the gradients and the loss are averaged over."""
import json

import torch
import torch.distributed as dist

from te_parallel.examples.train_gpt import main
from tests.distributed.harness import Checks, spawn

ARGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64", "--micro-batch", "8",
        "--corpus-bytes", str(1 << 20), "--device", "cpu", "--quiet", "--steps", "8", "--warmup", "3",
        "--eval-every", "8", "--eval-batches", "1", "--no-plot", "--fp8", "off"]
# fp32. A cp rank's loss is the mean of its half of every sequence and the engine averages the two halves'
# gradients, which is the whole sequences' mean up to rounding; the attention merges the ring's blocks by their
# log-sum-exp (or, under a2a, sees the heads of the whole sequence) where one process takes one softmax. Those
# reorderings move the loss by an fp32 ulp or two (about 5e-7 at a loss of 4 to 6) after 8 AdamW steps; the
# tolerance leaves 20 ulps.
TOLERANCE = 1e-5


def _log(path):
    return json.loads((path / "log.json").read_text())


def test_cp_matches_one_process_same_seed(tmp_path):
    main(ARGS + ["--nproc", "1", "--tp", "1", "--out", str(tmp_path / "cp1")])
    main(ARGS + ["--nproc", "2", "--tp", "1", "--cp", "2", "--out", str(tmp_path / "cp2")])
    main(ARGS + ["--nproc", "4", "--tp", "2", "--cp", "2", "--cp-comm", "a2a", "--dp-engine", "ddp",
                 "--out", str(tmp_path / "cp2tp2")])
    ref = _log(tmp_path / "cp1")["log"]
    for run in ("cp2", "cp2tp2"):
        record = _log(tmp_path / run)
        log, config = record["log"], record["config"]
        assert (config["cp"], config["dp"]) == (2, 1), config
        assert len(log) == len(ref) == 8
        loss = max(abs(r["loss"] - x["loss"]) for r, x in zip(ref, log))
        assert loss <= TOLERANCE, (run, [r["loss"] for r in ref], [x["loss"] for x in log])
        norm = max(abs(r["grad_norm"] - x["grad_norm"]) / r["grad_norm"] for r, x in zip(ref, log))
        assert norm <= TOLERANCE, (run, [r["grad_norm"] for r in ref], [x["grad_norm"] for x in log])
        assert abs(ref[-1]["val_loss"] - log[-1]["val_loss"]) <= TOLERANCE, (run, ref[-1], log[-1])
        # the same model FLOPs per step (MFU's numerator), and tokens counted once per sequence
        assert config["flops_per_step"] == _log(tmp_path / "cp1")["config"]["flops_per_step"]


def _axes(rank, world, device):
    from te_parallel.examples.world import make_world

    checks = Checks(rank)
    # (the collectives first, on every rank: building the meshes and the mean; then the local assertions)
    dp_cp, cp_tp = make_world(1, device, cp=2), make_world(2, device, cp=2)
    mean = dp_cp.dp_mean(torch.tensor(float(rank)))

    def dp2_cp2():  # rank r at (dp, cp) = (r // 2, r % 2)
        w = dp_cp
        assert (w.dp, w.cp, w.tp, w.dp_rank, w.cp_rank) == (2, 2, 1, rank // 2, rank % 2)
        assert dist.get_process_group_ranks(w.cp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert sorted(w.data_mesh.mesh.flatten().tolist()) == [0, 1, 2, 3]
        assert mean == 1.5  # over dp x cp

    def cp2_tp2():  # rank r at (cp, tp) = (r // 2, r % 2): TP groups of neighbours, CP groups across them
        w = cp_tp
        assert (w.dp, w.cp, w.tp, w.cp_rank, w.tp_rank) == (1, 2, 2, rank // 2, rank % 2)
        assert dist.get_process_group_ranks(w.cp_group) == [rank % 2, rank % 2 + 2]
        assert sorted(w.data_mesh.mesh.flatten().tolist()) == [rank % 2, rank % 2 + 2]

    checks.run("dp2 x cp2: the cp groups, and dp x cp flattened into the data axis", dp2_cp2)
    checks.run("cp2 x tp2: the cp groups span the TP groups", cp2_tp2)
    checks.raise_if_failed()


def test_world_axes():
    spawn(_axes, 4)
