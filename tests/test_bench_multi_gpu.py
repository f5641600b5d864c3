"""The multi-GPU benchmarks (benchmarks/bench_cp_ring.py, bench_ep.py, bench_block_gather.py) end to end on the CPU:
each under torchrun with 2 processes and --cpu (gloo, its tiny --cpu sizes; bench_block_gather started as
`python <bench> --nproc-per-node 2 --cpu`, which starts torchrun itself); its JSON holds every rank's rows, with
the floors, ratios, bytes and bandwidths computed from them.
Then the command-line mistakes: one line on stderr, exit status 2, before any process starts."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_block_gather  # noqa: E402
import bench_cp_ring  # noqa: E402
import bench_ep  # noqa: E402

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(script: str, tmp_path: Path, via_torchrun: bool = True) -> dict:
    """Run a benchmark on 2 CPU processes: started by torchrun, or (via_torchrun=False) as a plain script given
    --nproc-per-node, which checks its arguments and then starts torchrun itself."""
    out = tmp_path / f"{script}.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    path = str(ROOT / "benchmarks" / f"{script}.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", path]
    launch = torchrun if via_torchrun else [sys.executable, path, "--nproc-per-node", "2"]
    proc = subprocess.run([*launch, "--cpu", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["env"]["world"] == 2 and data["env"]["backend"].startswith("gloo")
    return data


def test_cp_ring_rows(tmp_path):
    data = _run("bench_cp_ring", tmp_path)
    assert data["target"] == bench_cp_ring.TARGET
    rows = data["rows"]
    time_rows = [r for r in rows if r["part"] == "time"]
    for rank in (0, 1):
        mine = {r["case"]: r for r in time_rows if r["rank"] == rank}
        assert set(mine) == {"floor (no communication)", "p2p", "all_gather", "a2a"}, sorted(mine)
        floor = mine["floor (no communication)"]["ms"]
        assert floor > 0
        for comm in bench_cp_ring.COMMS:
            r = mine[comm]
            assert r["tokens_per_gpu"] == 64 and r["total_tokens"] == 128 and r["cp"] == 2
            assert r["floor_ms"] == floor and r["ms"] > 0 and math.isclose(r["ratio"], r["ms"] / floor)
    mem = [r for r in rows if r["part"] == "memory"]
    assert {(r["rank"], r["case"]) for r in mem} == {(k, c) for k in (0, 1)
                                                     for c in ("cp 1 (no cp_group)", *bench_cp_ring.COMMS)}
    # q, k, v, dout of 64 tokens: 4 + 2 + 2 + 4 heads of 16 in bf16
    assert all(math.isclose(r["inputs_MiB"], 64 * 16 * 12 * 2 / 2 ** 20) for r in mem)


def test_ep_rows(tmp_path):
    data = _run("bench_ep", tmp_path)
    shape = data["shape"]
    rows = data["rows"]
    comm = [r for r in rows if r["part"] == "comm"]
    assert len(comm) == 8
    row_mib = shape["hidden"] * 4 / 2 ** 20  # fp32 rows on the CPU
    sent = {op: sum(r["MiB_sent"] for r in comm if r["case"] == f"te_parallel {op}") for op in ("dispatch", "combine")}
    for rank in (0, 1):  # each rank sends every one of its tokens · topk rows (its own share to itself)
        d = next(r for r in comm if r["rank"] == rank and r["case"] == "te_parallel dispatch")
        assert math.isclose(d["MiB_sent"], shape["tokens"] * shape["topk"] * row_mib)
    assert math.isclose(sent["combine"], sent["dispatch"])  # what comes back is what went out
    for r in comm:
        assert r["ms"] > 0 and math.isclose(r["algbw_GBps"], r["MiB_sent"] * 2 ** 20 / (r["ms"] * 1e-3) / 1e9)
        assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] / 2)
        a2a = next(x for x in comm if x["rank"] == r["rank"] and x["case"] == f"all_to_all_single, {r['op']}'s bytes")
        assert math.isclose(r["vs_a2a"], a2a["ms"] / r["ms"]) and a2a["MiB_sent"] == r["MiB_sent"]
    layer = [r for r in rows if r["part"] == "layer"]
    assert {(r["rank"], r["case"], r["experts_per_gpu"]) for r in layer} == {(k, c, e) for k in (0, 1)
                                                                           for c, e in (("EP=2", 4), ("EP=1", 8))}
    for r in layer:
        base = next(x for x in layer if x["rank"] == r["rank"] and x["case"] == "EP=1")
        assert math.isclose(r["vs_ep1"], r["ms"] / base["ms"])
        assert math.isclose(r["us_per_token"], r["ms"] * 1e3 / shape["tokens"])


def test_block_gather_rows(tmp_path):
    data = _run("bench_block_gather", tmp_path, via_torchrun=False)
    rows = data["rows"]
    cases = ("bf16", "FP8 rowwise (forward)", "FP8 columnwise (backward)", "FP8 bytes alone", "cast (local)")
    assert {(r["rank"], r["case"]) for r in rows} == {(k, c) for k in (0, 1) for c in cases}
    by = {(r["rank"], r["case"]): r for r in rows}
    for rank in (0, 1):
        assert math.isclose(by[(rank, "bf16")]["MiB_per_rank"], 128 * 256 * 2 / 2 ** 20)
        # FP8 bytes plus one fp32 scale per 128 values: 1/2 + 4/(2·128) of bf16's bytes, either direction
        for case in ("FP8 rowwise (forward)", "FP8 columnwise (backward)"):
            assert math.isclose(by[(rank, case)]["bytes_vs_bf16"], 0.5 + 2 / 128)
        assert math.isclose(by[(rank, "FP8 bytes alone")]["bytes_vs_bf16"], 0.5)
        for case in cases:
            r = by[(rank, case)]
            assert r["ms"] > 0 and math.isclose(r["time_vs_bf16"], r["ms"] / by[(rank, "bf16")]["ms"])
    (s,) = data["summary"]
    assert math.isclose(s["bytes_vs_bf16"], 0.5 + 2 / 128)
    assert math.isclose(s["time_vs_bf16"], s["fp8_row_col_ms"] / s["bf16_2_gathers_ms"])


MISTAKES = {
    "cp: not under torchrun and no process count": (bench_cp_ring, ["--cpu"], "under torchrun"),
    "cp: one process": (bench_cp_ring, ["--cpu", "--nproc-per-node", "1"], "1 process: needs at least 2"),
    "cp: NCCL without GPUs": (bench_cp_ring, ["--nproc-per-node", "2"], "needs 2 GPUs, this machine has 0"),
    "cp: odd tokens": (bench_cp_ring, ["--cpu", "--nproc-per-node", "2", "--seq", "63"], "--seq 63"),
    "cp: heads vs kv heads": (bench_cp_ring, ["--cpu", "--nproc-per-node", "2", "--heads", "6", "--kv-heads", "4"],
                              "--heads 6 is not a multiple of --kv-heads 4"),
    "cp: a2a heads": (bench_cp_ring, ["--cpu", "--nproc-per-node", "4", "--heads", "6", "--kv-heads", "2"],
                      "spreads the heads over the 4 ranks"),
    "cp: unknown comm": (bench_cp_ring, ["--cpu", "--nproc-per-node", "2", "--comm", "ring"], "--comm"),
    "ep: NCCL without GPUs": (bench_ep, ["--nproc-per-node", "4"], "needs 4 GPUs, this machine has 0"),
    "ep: experts not divisible": (bench_ep, ["--cpu", "--nproc-per-node", "3"],
                                  "--experts 8 is not divisible by the 3"),
    "ep: topk above experts": (bench_ep, ["--cpu", "--nproc-per-node", "2", "--topk", "9"], "--topk 9"),
    "ep: zero tokens": (bench_ep, ["--cpu", "--nproc-per-node", "2", "--tokens", "0"], "--tokens 0"),
    "gather: NCCL without GPUs": (bench_block_gather, ["--nproc-per-node", "8"], "needs 8 GPUs, this machine has 0"),
    "gather: rows not tiles": (bench_block_gather, ["--cpu", "--nproc-per-node", "2", "--rows", "96"], "--rows 96"),
    "gather: hidden not tiles": (bench_block_gather, ["--cpu", "--nproc-per-node", "2", "--hidden", "200"],
                                 "--hidden 200"),
    "gather: zero rounds": (bench_block_gather, ["--cpu", "--nproc-per-node", "2", "--rounds", "0"], "--rounds 0"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_mistake_is_one_line(name, capsys, monkeypatch):
    module, argv, text = MISTAKES[name]
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(SystemExit) as e:
        module.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and err.endswith("; see --help\n") and text in err, err
