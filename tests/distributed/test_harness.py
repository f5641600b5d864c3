"""The distributed test harness itself: a check that fails on one rank fails on every rank instead of
hanging the others, a hung collective becomes a failure with stacks, and TP sizes are picked per machine;
plus the group-size fast path the TP modules use."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from te_parallel.parallel.groups import group_size
from tests.distributed.harness import agree, spawn, worlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_rank_fails(rank, world, device):
    group = dist.new_group(list(range(world)))
    outcomes = []
    for step in range(2):  # the second step's collectives would hang if rank 1 had left after step 0

        def local():
            assert not (rank == 1 and step == 0), "rank 1's own failure"
        try:
            agree(group, device, local)
            outcomes.append("ok")
        except AssertionError as e:
            outcomes.append(str(e))
        dist.all_reduce(torch.ones(1, device=device), group=group)  # the next step's collective
    want_first = "rank 1's own failure" if rank == 1 else "a check failed on another rank"
    assert outcomes[0].startswith(want_first), outcomes
    assert outcomes[1] == "ok", outcomes


def test_agree_fails_every_rank_and_keeps_them_in_step():
    spawn(_one_rank_fails, 2)


def _sizes(rank, world, device):
    sub = dist.new_group([0, 1])
    everyone = dist.new_group(list(range(world)))
    assert group_size(None) == 1
    assert group_size(everyone) == world == dist.get_world_size(everyone)
    assert group_size(sub) == dist.get_world_size(sub) == (2 if rank < 2 else -1)  # -1: not a member


def test_group_size_matches_torch():
    spawn(_sizes, 3)


def test_a_hung_rank_fails_with_stacks(tmp_path):
    """A worker that blocks in a collective forever is ended by the watchdog, and the launch fails."""
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent("""
        import sys
        import time
        import torch.distributed as dist
        sys.path.insert(0, {root!r})
        from tests.distributed.harness import spawn

        def hang(rank, world, device):
            if rank == 0:
                dist.barrier()  # rank 1 is alive but never joins (a rank stuck elsewhere)
            else:
                time.sleep(600)

        if __name__ == "__main__":
            spawn(hang, 2)
    """).format(root=ROOT))
    env = dict(os.environ, TE_PARALLEL_TEST_HANG_S="5", TE_PARALLEL_TEST_DEVICE="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Timeout (0:00:05)!" in proc.stderr and "in hang" in proc.stderr, proc.stderr[-2000:]


def test_worlds_skip_reasons(monkeypatch):
    monkeypatch.setenv("TE_PARALLEL_TEST_DEVICE", "cpu")
    cpu = {p.values[0]: [m.kwargs.get("reason") for m in p.marks] for p in worlds(2, 4, 8)}
    assert cpu == {2: [], 4: [], 8: []}  # gloo runs every size
    monkeypatch.delenv("TE_PARALLEL_TEST_DEVICE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpus = {p.values[0]: [m.kwargs.get("reason") for m in p.marks] for p in worlds(2, 4, 8)}
    assert gpus[2] == [] and gpus[4] == [] and gpus[8] == ["TP=8 needs 8 GPUs for NCCL; this machine has 4"]


if __name__ == "__main__":
    pytest.main([__file__])


def _sees_no_gpu(rank, world, device, out_dir):
    """What a CPU suite's worker sees: no GPU, gloo, the CPU device."""
    seen = (os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), dist.get_backend(), device.type)
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))


def test_cpu_suites_see_no_gpu_and_the_caller_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # (what a GPU host's caller may have; restored after)
    spawn(_sees_no_gpu, 2, str(tmp_path), cpu=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == ("", 0, "gloo", "cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
