"""The trainer's command line (examples/train_gpt.py) as a user meets it.

Every mistake: exit status 2, one error line on stderr naming the flag (at most 3 lines in all), no
traceback, and no process started (nothing printed on stdout, no output directory). The mistakes run as subprocesses, all at
once. Tiny real runs check that a second run never overwrites the first, that the last line names
every file written, that --resume refuses other sizes before starting anything, that a run shows no
validation loss before its first evaluation, and that FP8 takes a token count that is not a multiple
of 16.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from te_parallel.examples.cli import CliError, build_parser
from te_parallel.examples.layout import Launch, plan_layout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                 "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
TINY = ["--steps", "3", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "2",
        "--eval-every", "1", "--eval-batches", "1", "--warmup", "1", "--corpus-bytes", "65536", "--device", "cpu",
        "--quiet", "--no-plot"]

# name -> (arguments, text the one line must hold)
MISTAKES = {
    "tp does not divide the processes": (["--nproc", "2", "--tp", "3"], "--tp 3 does not divide the 2 processes"),
    "heads do not divide hidden": (["--hidden", "128", "--heads", "3"], "--heads 3"),
    "hidden 100 heads 3": (["--hidden", "100", "--heads", "3"], "--hidden 100"),
    "hidden 120 under FP8": (["--hidden", "120"], "--hidden 120: FP8"),
    "ffn under FP8": (["--ffn", "72"], "--ffn 72"),
    "overlap pieces under FP8": (["--nproc", "2", "--tp", "2", "--overlap", "--seq-len", "8", "--micro-batch", "3"],
                                 "--overlap cuts"),
    "sequence parallel length": (["--seq-len", "9"], "--seq-len 9"),
    "overlap without TP": (["--overlap", "--tp", "1"], "--overlap"),
    "missing resume directory": (["--resume", "no/such/checkpoint"], "--resume no/such/checkpoint"),
    "negative steps": (["--steps", "-5"], "--steps -5"),
    "zero learning rate": (["--lr", "0"], "--lr"),
    "too little text": (["--corpus-bytes", "20000"], "--corpus-bytes 20000"),
    "not a number": (["--tp", "two"], "--tp"),
    "unknown flag": (["--hiden", "64"], "--hiden"),
    "unknown data-parallel engine": (["--dp-engine", "fsdp"], "--dp-engine"),
    "warmup beyond the steps": (["--warmup", "500", "--steps", "5"],
                                "--warmup 500 is not less than --steps 5: the learning rate would still be warming up "
                                "at the last step; use --warmup 4 or less, or --steps 501 or more"),

    "stop after the end": (["--stop-after", "500", "--steps", "5"],
                           "--stop-after 500 is more than --steps 5; use --stop-after 5 or less, or drop --stop-after"),
    "negative gradient clipping": (["--clip-grad", "-1"], "--clip-grad -1.0 must be a positive number"),
    "gradient clipping not a number": (["--clip-grad", "nan"], "--clip-grad nan must be a positive number"),
    "kv heads not dividing heads": (["--arch", "llama", "--heads", "4", "--kv-heads", "3"],
                                    "--kv-heads 3 must divide --heads 4 and be a multiple of --tp"),
    "kv heads without llama": (["--kv-heads", "2"], "--kv-heads 2 is for --arch llama"),
    "tp x cp does not divide the processes": (["--nproc", "2", "--tp", "2", "--cp", "2"],
                                              "--tp 2 x --cp 2 = 4 does not divide the 2 processes"),
    "sequence not in 2 x cp chunks": (["--tp", "1", "--cp", "2", "--seq-len", "62"],
                                      "--seq-len 62 is not divisible by 2 x --cp 2 = 4"),
    "a2a heads over the cp ranks": (["--nproc", "8", "--tp", "2", "--cp", "4", "--cp-comm", "a2a"],
                                    "--cp-comm a2a spreads each TP rank's --heads 4 / --tp 2 = 2 attention heads"),
    "cp comm without cp": (["--cp-comm", "all_gather"], "--cp-comm all_gather is for context parallelism"),
    "fp8 format without fp8": (["--fp8", "off", "--fp8-format", "e4m3"], "--fp8-format e4m3 needs an FP8 recipe"),
    "block scales without block": (["--fp8", "current", "--fp8-block-scales", "fp32"],
                                   "--fp8-block-scales fp32 applies to --fp8 block only, got --fp8 current"),
}
if not torch.cuda.is_available():
    MISTAKES["cuda without a GPU"] = (["--device", "cuda"], "--device cuda")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _start(args, cwd):
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _run(args, cwd, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    """Every mistake's (returncode, stdout, stderr, out directory), run side by side."""
    root = tmp_path_factory.mktemp("mistakes")
    procs = {}
    for i, (name, (args, _)) in enumerate(MISTAKES.items()):
        out = root / f"out{i}"
        procs[name] = (_start(args + ["--out", str(out)], root), out)
    results = {}
    for name, (proc, out) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = (proc.returncode, stdout, stderr, out)
    return results


def _assert_one_line_error(result, needle):
    code, stdout, stderr, out = result
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    # (at most 3 lines: the error, after a warning of two lines where te_parallel's import warns that
    # its compiled kernels are absent)
    assert len(lines) <= 3 and lines[-1].startswith("train_gpt.py: error: "), stderr
    assert needle in lines[-1], lines[-1]
    assert "Traceback" not in stderr
    assert stdout == "", stdout  # not even the layout line: no process was started
    assert not out.exists()


@pytest.mark.parametrize("name", list(MISTAKES))
def test_mistake_is_one_line_before_any_process(mistakes, name):
    _assert_one_line_error(mistakes[name], MISTAKES[name][1])


def test_tp_message_names_the_fix(mistakes):
    line = mistakes["tp does not divide the processes"][2].splitlines()[-1]
    assert line.endswith("use --tp 1 or --tp 2")
    line = mistakes["hidden 120 under FP8"][2].splitlines()[-1]
    assert "hidden/tp = 60" in line and "--hidden 128" in line and "--fp8 off" in line


def test_help_gives_every_flag_a_description_and_default(tmp_path):
    result = _run(["--help"], tmp_path, timeout=60)
    assert result.returncode == 0 and "usage:" in result.stdout
    entries = re.split(r"\n(?=  -)", result.stdout.split("options:", 1)[1])
    flags = [e for e in entries if e.lstrip().startswith("--")]
    assert len(flags) >= 25
    missing = [e.split()[0] for e in flags if "(default:" not in " ".join(e.split())]
    assert not missing, missing
    for action in build_parser("")._actions:
        assert action.help, action.option_strings


def _last_line(result):
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A tiny run with the default --out, stopped after 2 of 3 steps (so it saves a checkpoint)."""
    cwd = tmp_path_factory.mktemp("runs")
    result = _run(TINY + ["--stop-after", "2"], cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, result


def test_first_run_names_its_files_and_checkpoint(first_run):
    cwd, result = first_run
    out = Path("runs/gpt")
    assert result.stdout.splitlines()[0].startswith("train_gpt: 2 processes on the CPU (gloo): tp=2 dp=1")
    assert f"saved the checkpoint to {out / 'checkpoint'}" in result.stdout
    assert _last_line(result) == (f"train_gpt: wrote {out / 'log.json'}, checkpoint {out / 'checkpoint'}/ "
                                  f"(config.json and a torch.distributed.checkpoint of 2 processes)")
    for name in ("log.json", "checkpoint/config.json", "checkpoint/.metadata"):
        assert (cwd / out / name).is_file(), name
    assert "tokens/s, MFU n/a" in result.stdout
    assert json.loads((cwd / out / "checkpoint" / "config.json").read_text())["step"] == 2


def test_second_run_does_not_overwrite_the_first(first_run):
    cwd, _ = first_run
    before = (cwd / "runs/gpt/log.json").read_text()
    result = _run(TINY + ["--resume", "runs/gpt/checkpoint"], cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "writing this one to runs/gpt-2" in result.stdout
    assert _last_line(result) == f"train_gpt: wrote {Path('runs/gpt-2/log.json')}"
    assert (cwd / "runs/gpt/log.json").read_text() == before
    assert len(json.loads((cwd / "runs/gpt-2/log.json").read_text())["log"]) == 3  # resumed at 2, ran to 3
    refused = _run(TINY + ["--out", "runs/gpt"], cwd, timeout=60)  # an explicit --out is never replaced
    _assert_one_line_error((refused.returncode, refused.stdout, refused.stderr, cwd / "nothing"), "--overwrite")
    refused = _run(TINY + ["--out", "runs/other", "--save", "runs/gpt/checkpoint"], cwd, timeout=60)
    _assert_one_line_error((refused.returncode, refused.stdout, refused.stderr, cwd / "runs/other"),
                           "--save runs/gpt/checkpoint already holds a checkpoint")


def test_resume_with_other_sizes_is_refused(first_run, tmp_path):
    cwd, _ = first_run
    ckpt = cwd / "runs/gpt/checkpoint"
    result = _run(TINY + ["--resume", str(ckpt), "--hidden", "64", "--out", str(tmp_path / "o")], cwd, timeout=60)
    _assert_one_line_error((result.returncode, result.stdout, result.stderr, tmp_path / "o"), "--hidden 32")
    result = _run(TINY + ["--resume", str(ckpt), "--nproc", "1", "--tp", "1", "--out", str(tmp_path / "o")], cwd,
                  timeout=60)
    _assert_one_line_error((result.returncode, result.stdout, result.stderr, tmp_path / "o"), "--tp 2")
    # a save that did not finish (no config.json), and a checkpoint of the earlier one-file-per-process format
    unfinished, legacy = tmp_path / "unfinished", tmp_path / "legacy"
    unfinished.mkdir()
    (unfinished / ".metadata").write_bytes((ckpt / ".metadata").read_bytes())
    legacy.mkdir()
    (legacy / "rank0.pt").write_bytes(b"")
    result = _run(TINY + ["--resume", str(ckpt), "--stop-after", "2", "--out", str(tmp_path / "o")], cwd, timeout=60)
    _assert_one_line_error((result.returncode, result.stdout, result.stderr, tmp_path / "o"),
                           f"--stop-after 2 is more than the steps left from step 2 of --resume {ckpt} to --steps 3 "
                           f"(1); use --stop-after 1 or less")
    for directory, needle in ((unfinished, "has no config.json: its save did not finish"),
                              (legacy, "earlier version of this trainer")):
        result = _run(TINY + ["--resume", str(directory), "--out", str(tmp_path / "o")], cwd, timeout=60)
        _assert_one_line_error((result.returncode, result.stdout, result.stderr, tmp_path / "o"), needle)


def _layout(monkeypatch, argv, gpus=0, capability=(9, 0), env=None):
    """plan_layout on a pretend machine with `gpus` GPUs."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Test GPU")
    args = build_parser("").parse_args(argv)
    return args, plan_layout(args, Launch.from_env(env or {}))


@pytest.mark.parametrize("gpus, tp, nproc", [(0, 2, 2), (1, 1, 1), (2, 2, 2), (3, 2, 2), (8, 2, 8)])
def test_default_layout_uses_the_gpus(monkeypatch, gpus, tp, nproc):
    args, layout = _layout(monkeypatch, [], gpus)
    assert (layout.device, layout.tp, layout.nproc) == ("cuda" if gpus else "cpu", tp, nproc)
    if gpus == 1:
        assert any("--tp 1" in n for n in layout.notes)
    assert args.fp8 == "delayed"


def test_layout_mistakes_on_gpus(monkeypatch):
    with pytest.raises(CliError, match=r"--tp 4 needs 4 GPUs.*this machine has 2"):
        _layout(monkeypatch, ["--tp", "4"], 2)
    with pytest.raises(CliError, match=r"--nproc 4 needs 4 GPUs"):
        _layout(monkeypatch, ["--nproc", "4"], 2)
    with pytest.raises(CliError, match=r"--fp8 delayed needs a GPU of compute capability 8.9"):
        _layout(monkeypatch, ["--fp8", "delayed"], 1, capability=(8, 0))
    args, layout = _layout(monkeypatch, [], 1, capability=(8, 0))
    assert args.fp8 == "off" and any("no FP8" in n for n in layout.notes)
    with pytest.raises(CliError, match=r"--nproc 2 is for runs without a launcher"):
        _layout(monkeypatch, ["--nproc", "2"], 0, env={"RANK": "0", "WORLD_SIZE": "4"})


def test_launcher_world_is_checked(monkeypatch):
    from te_parallel.examples.checks import check_sizes

    args, layout = _layout(monkeypatch, ["--tp", "4", "--device", "cpu"], 0,
                           env={"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0"})
    args.ffn = 4 * args.hidden
    expected = r"--tp 4 does not divide the 6 processes \(WORLD_SIZE=6\); use --tp 1 or --tp 2"
    with pytest.raises(CliError, match=expected):
        check_sizes(args, layout.tp, layout.nproc, layout.world_fixed, layout.what, layout.can_add)


def test_mfu_counts_model_flops_against_the_datasheet_peak(monkeypatch):
    """6·N + 12·L·h·s model FLOPs per token (N: every parameter but the embedding table), the dense
    datasheet peak of the GPU by name and precision, n/a where no peak is known."""
    from te_parallel.examples.gpt import GPT, GPTConfig
    from te_parallel.examples.throughput import flops_per_token, mfu, peak_flops, summary

    gpt = GPT(GPTConfig(256, 2, 64, 4, 256, 64))
    n = sum(p.numel() for name, p in gpt.named_parameters() if not name.startswith("embed."))
    assert gpt.matmul_params() == n
    llama = GPT(GPTConfig(256, 2, 64, 4, 256, 64, arch="llama", kv_heads=2))  # RMSNorm, SwiGLU, GQA, no biases
    assert llama.matmul_params() == sum(p.numel() for name, p in llama.named_parameters() if not name.startswith("embed."))
    assert not any(name.endswith("bias") for name, _ in llama.named_parameters())
    assert llama.layers[0].layernorm_mlp.fc1_weight.shape == (512, 64)  # SwiGLU: both halves
    assert llama.layers[0].self_attention.layernorm_qkv.key_weight.shape == (2 * 16, 64)  # 2 kv heads of 16
    assert flops_per_token(n, 2, 64, 64) == 6 * n + 12 * 2 * 64 * 64
    gpu = torch.device("cuda", 0)
    for name, precision, peak in [("NVIDIA H100 80GB HBM3", "bf16", 989.4e12), ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12),
                                  ("NVIDIA H100 PCIe", "fp8", 1513e12), ("NVIDIA H200", "bf16", 989.4e12),
                                  ("NVIDIA H200 NVL", "fp8", 1670.5e12), ("NVIDIA A100-SXM4-80GB", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(gpu, precision) == peak, name
    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert mfu(4e15, 2.0, 1e15, 4) == 0.5 and mfu(4e15, 2.0, None, 4) is None
    log = [{"tokens_per_s": 10.0 * (i + 1), "mfu": None} for i in range(3)]
    assert summary(log, None, 2, "fp32", torch.device("cpu")) == "25 tokens/s, MFU n/a on the CPU"


def test_no_validation_loss_before_the_first_evaluation(tmp_path):
    """A run stopped before its first evaluation shows no validation loss: none in the progress bar
    (which shows the gradient norm), none in the closing summary."""
    shown = [a for a in TINY if a != "--quiet"]
    result = _run(shown + ["--eval-every", "5", "--stop-after", "2", "--out", str(tmp_path / "o")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val=" not in result.stderr, result.stderr[-3000:]  # tqdm writes to stderr
    assert "loss=" in result.stderr and "gnorm=" in result.stderr, result.stderr[-3000:]
    summary = next(line for line in result.stdout.splitlines() if "train loss" in line)
    assert "validation" not in summary and "nan" not in result.stdout, result.stdout
    log = json.loads((tmp_path / "o" / "log.json").read_text())["log"]
    assert [sorted(r) for r in log] == [["grad_norm", "loss", "mfu", "step", "tokens_per_s"]] * 2


def test_plot_has_no_validation_entry_before_an_evaluation(tmp_path, monkeypatch):
    import matplotlib.figure

    from te_parallel.examples.plot import plot_runs

    legends = []  # each saved figure's legend entries

    def save(fig, *args, **kwargs):
        legends.append([text.get_text() for text in fig.axes[0].get_legend().get_texts()])

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", save)
    log = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5}]
    plot_runs({"run": log}, tmp_path / "loss.png")
    plot_runs({"run": log + [{"step": 3, "loss": 4.0, "val_loss": 4.2}]}, tmp_path / "loss.png")
    train, val = "run: train (each step's batch)", "run: validation (held-out text)"
    assert legends == [[train], [train, val]]


def test_fp8_help_states_the_rule_that_is_checked(tmp_path):
    """FP8 needs in and out features that are multiples of 16, not token counts: the --fp8 help says so,
    and an FP8 run of --seq-len 15 x --micro-batch 3 = 45 tokens per GEMM trains."""
    fp8_help = next(action.help for action in build_parser("")._actions if action.dest == "fp8")
    assert "every dimension" not in fp8_help and "Any token count runs" in fp8_help, fp8_help
    out = tmp_path / "o"
    result = _run(TINY + ["--nproc", "1", "--tp", "1", "--fp8", "delayed", "--seq-len", "15", "--micro-batch", "3",
                          "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fp8 delayed" in result.stdout.splitlines()[0]
    assert len(json.loads((out / "log.json").read_text())["log"]) == 3


def test_fp8_options_make_the_recipe():
    """--fp8-format and --fp8-block-scales reach the recipe the trainer builds; without them the recipe's
    defaults stay."""
    from te_parallel import recipe
    from te_parallel.examples.train_gpt import make_recipe

    parse = build_parser("").parse_args
    block = make_recipe(parse(["--fp8", "block", "--fp8-format", "hybrid", "--fp8-block-scales", "fp32"]))
    assert isinstance(block, recipe.Float8BlockScaling) and block.fp8_format is recipe.Format.HYBRID
    assert not any(q.power_2_scale for q in (block.fp8_quant_fwd_inp, block.fp8_quant_fwd_weight,
                                              block.fp8_quant_bwd_grad))
    default = make_recipe(parse(["--fp8", "block"]))
    assert default.fp8_format is recipe.Format.E4M3 and default.fp8_quant_fwd_inp.power_2_scale
    current = make_recipe(parse(["--fp8", "current", "--fp8-format", "e4m3"]))
    assert isinstance(current, recipe.Float8CurrentScaling) and current.fp8_format is recipe.Format.E4M3
    assert make_recipe(parse(["--fp8", "off"])) is None
