"""The main job on CPU (gloo): TP=2 + SP + FP8 training lowers the loss, and a resumed run is exact."""
import json

import pytest

from te_parallel.examples.train_gpt import main

TINY = ["--nproc", "2", "--tp", "2", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64",
        "--micro-batch", "8", "--steps", "40", "--warmup", "5", "--eval-every", "20", "--eval-batches", "2",
        "--corpus-bytes", str(1 << 20), "--device", "cpu", "--quiet"]


def _log(path):
    return json.loads((path / "log.json").read_text())["log"]


@pytest.mark.parametrize("fp8", ["delayed", "current"])
def test_training_lowers_loss_and_resumes_exactly(tmp_path, fp8):
    full, first, second = tmp_path / "full", tmp_path / "first", tmp_path / "second"
    main(TINY + ["--fp8", fp8, "--out", str(full)])
    log = _log(full)
    assert len(log) == 40 and (full / "loss.png").stat().st_size > 1000
    early = sum(r["loss"] for r in log[:5]) / 5
    late = sum(r["loss"] for r in log[-5:]) / 5
    assert late < early - 1.0, (early, late)  # 5.5 nats/byte at init; learns byte statistics fast
    assert log[-1]["val_loss"] < log[19]["val_loss"]
    ckpt = tmp_path / "ckpt"
    main(TINY + ["--fp8", fp8, "--out", str(first), "--save", str(ckpt), "--stop-after", "25", "--no-plot"])
    main(TINY + ["--fp8", fp8, "--out", str(second), "--resume", str(ckpt), "--no-plot"])
    resumed = _log(second)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in log]  # bit-identical, steps 1..40
    assert resumed[-1]["val_loss"] == log[-1]["val_loss"]


def test_overlap_needs_tp_and_sp():
    with pytest.raises(SystemExit):
        main(["--overlap", "--tp", "1"])


def test_overlap_gives_the_same_losses(tmp_path):
    """--overlap (on CPU: the P2P fallback of the overlapped schedules) vs the plain collectives, FP8."""
    args = TINY[:TINY.index("--steps")] + ["--steps", "12", "--warmup", "4", "--eval-every", "12", "--eval-batches", "2",
                                           "--corpus-bytes", str(1 << 20), "--device", "cpu", "--quiet", "--no-plot"]
    main(args + ["--fp8", "delayed", "--out", str(tmp_path / "plain")])
    main(args + ["--fp8", "delayed", "--overlap", "--out", str(tmp_path / "overlap")])  # (ranks warn: P2P fallback)
    a, b = _log(tmp_path / "plain"), _log(tmp_path / "overlap")
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) < 1e-4, [(x["loss"], y["loss"]) for x, y in zip(a, b)]


def test_tp2_sp_matches_tp1_same_seed(tmp_path, monkeypatch):
    """Parity across layouts: the same seed gives the same losses with TP=1 and TP=2 + SP (fp32, no FP8)."""
    args = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64", "--micro-batch", "8", "--steps", "12",
            "--warmup", "4", "--eval-every", "12", "--eval-batches", "2", "--corpus-bytes", str(1 << 20),
            "--device", "cpu", "--quiet", "--no-plot", "--fp8", "off"]
    main(args + ["--nproc", "1", "--tp", "1", "--out", str(tmp_path / "tp1")])
    main(args + ["--nproc", "2", "--tp", "2", "--out", str(tmp_path / "tp2")])
    a, b = _log(tmp_path / "tp1"), _log(tmp_path / "tp2")
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) < 1e-5
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) < 1e-5
