"""The command lines of benchmarks/bench_host.py, bench_linear.py, bench_transformer.py, bench_moe.py and
profile_step.py, and the parts of them that run on the CPU.

A mistake on either command line: exit status 2 and one line on stderr naming the flag, before any work.
The steps the GPU runs time are built from the same functions here, on small CPU layers: bench_host's
layer steps (torch, te_parallel bf16 / FP8 delayed / FP8 current) and bench_transformer's compiled rows
with their recompilation counts (dynamo's "eager" backend: the CPU has no time for inductor here).
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_host  # noqa: E402
import bench_linear  # noqa: E402
import bench_moe  # noqa: E402
import bench_transformer  # noqa: E402
import profile_step  # noqa: E402

# (parser, arguments, text the one line must hold)
MISTAKES = {
    "host: --tokens without --layer": (bench_host, ["--tokens", "512"], "--tokens goes with --layer"),
    "host: --recipe without --layer": (bench_host, ["--recipe", "current"], "--recipe goes with --layer"),
    "host: tokens not numbers": (bench_host, ["--layer", "llama", "--tokens", "512,abc"], "--tokens 512,abc"),
    "host: FP8 tokens not a multiple of 8": (bench_host, ["--layer", "gpt", "--tokens", "100"], "--tokens 100"),
    "host: unknown layer": (bench_host, ["--layer", "bert"], "--layer"),
    "host: unknown recipe": (bench_host, ["--layer", "llama", "--recipe", "mxfp8"], "--recipe"),
    "host: --shape with --layer": (bench_host, ["--layer", "llama", "--shape", "1x2x3"], "--shape"),
    "host: --floor with --layer": (bench_host, ["--layer", "llama", "--floor"], "--floor"),
    "host: --compile-mode without --layer": (bench_host, ["--compile-mode", "reduce-overhead"],
                                             "--compile-mode goes with --layer"),
    "host: unknown compile mode": (bench_host, ["--layer", "llama", "--compile-mode", "fast"], "--compile-mode"),
    "host: shape of two numbers": (bench_host, ["--shape", "128x1024"], "--shape 128x1024"),
    "host: zero calls": (bench_host, ["--calls", "0"], "--calls 0"),
    "host: rounds not a number": (bench_host, ["--rounds", "many"], "--rounds"),
    "transformer: --packed gpt": (bench_transformer, ["--packed"], "--packed takes --model llama"),
    "transformer: --packed --compile": (bench_transformer, ["--model", "llama", "--packed", "--compile"], "--packed"),
    "transformer: heads do not divide hidden": (bench_transformer, ["--heads", "5"], "--heads 5"),
    "transformer: groups do not divide heads": (bench_transformer, ["--model", "llama", "--gqa", "3"], "--gqa 3"),
    "transformer: --gqa with gpt": (bench_transformer, ["--gqa", "8"], "--gqa 8"),
    "transformer: zero sequence": (bench_transformer, ["--seq", "0"], "--seq 0"),
    "transformer: no warm-up": (bench_transformer, ["--compile", "--compile-warmup", "0"], "--compile-warmup 0"),
    "transformer: unknown flag": (bench_transformer, ["--graphs"], "--graphs"),
    "transformer: --compile-mode alone": (bench_transformer, ["--compile-mode", "reduce-overhead"],
                                          "--compile-mode reduce-overhead: goes with --compile"),
    "transformer: unknown compile mode": (bench_transformer, ["--compile", "--compile-mode", "fast"], "--compile-mode"),
    "transformer: energy window too short": (bench_transformer, ["--energy", "0.1"], "--energy 0.1"),
    "transformer: energy window not a number": (bench_transformer, ["--energy", "long"], "--energy"),
    "linear: shape of two numbers": (bench_linear, ["--shapes", "8192x4096"], "--shapes 8192x4096"),
    "linear: zero in a shape": (bench_linear, ["--shapes", "8192x0x4096"], "--shapes 8192x0x4096"),
    "linear: no shape": (bench_linear, ["--shapes"], "no shape given"),
    "linear: negative settle": (bench_linear, ["--settle", "-1"], "--settle -1"),
    "linear: energy window too long": (bench_linear, ["--energy", "100"], "--energy 100"),
    "linear: energy with the sweep": (bench_linear, ["--sweep", "--energy", "2"], "not --sweep"),
    "profile: --memory with gemm": (profile_step, ["gemm", "--memory"], "not gemm"),
    "profile: --memory with --host": (profile_step, ["layer", "--memory", "--host"], "--memory goes alone"),
    "profile: --memory with --gaps": (profile_step, ["linear", "--memory", "--gaps"], "--memory goes alone"),
    "profile: unknown recipe": (profile_step, ["layer", "--recipe", "mxfp8"], "--recipe"),
    "moe: unknown case": (bench_moe, ["--cases", "llama4"], "--cases"),
    "moe: unknown part": (bench_moe, ["--part", "router"], "--part"),
    "moe: energy window not positive": (bench_moe, ["--energy", "0"], "--energy 0"),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_mistake_is_one_line(name, capsys):
    script, args, text = MISTAKES[name]
    with pytest.raises(SystemExit) as stop:
        script.parse_args(args)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and text in err, err


def test_defaults():
    host = bench_host.parse_args(["--layer", "llama"])
    assert (host.tokens, host.recipe, host.calls, host.shape) == ([512, 1024, 2048, 4096], "delayed", 1, None)
    linear = bench_host.parse_args([])
    assert (linear.shape, linear.calls, linear.layer) == ("128x1024x1024", 20, None)
    assert bench_host.parse_args(["--layer", "gpt", "--tokens", "100,200", "--recipe", "bf16"]).tokens == [100, 200]
    llama = bench_transformer.parse_args(["--model", "llama", "--compile", "--graph"])
    assert (llama.hidden, llama.ffn, llama.heads, llama.gqa, llama.seq, llama.batch) == (4096, 14336, 32, 8, 4096, 1)
    assert (llama.compile, llama.graph, llama.compile_warmup) == (True, True, 5)
    assert bench_linear.parse_args(["--shapes", "64x128x256", "8x16x32"]).sizes == [(64, 128, 256), (8, 16, 32)]
    assert bench_linear.parse_args([]).sizes == [(8192, 4096, 16384)]
    gpt = bench_transformer.parse_args(["--heads", "16"])
    assert (gpt.heads, gpt.gqa, gpt.ffn) == (16, 16, 16384)


def test_scripts_answer_help():
    procs = {script: subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for script in ("bench_host.py", "bench_linear.py", "bench_transformer.py", "bench_moe.py")}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.startswith(f"usage: {script}"), err


def _tiny(model):
    return bench_transformer.model_config(model, hidden=64, ffn=128, heads=4, gqa=2 if model == "llama" else None,
                                          seq=32, batch=1)


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_layer_steps_run(model):
    cfg = _tiny(model)
    layers = bench_transformer.build_layers(cfg, device="cpu", peer=False)
    for kind in (None, "delayed", "current"):
        steps = bench_host.layer_steps(cfg, layers, 32, kind, device="cpu")
        assert list(steps) == ["torch bf16 + SDPA", f"te {'bf16' if kind is None else 'FP8 ' + kind}"]
        for step in steps.values():
            step()
            assert all(p.grad is not None for p in step.params)
            step.clear_grads()


@pytest.fixture
def fresh_dynamo():
    """No compiled code kept from before or left for later tests (dynamo's caches are per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_recompiles_are_counted(fresh_dynamo):
    lin = torch.compile(torch.nn.Linear(4, 4), dynamic=False, backend="eager")
    x = [torch.randn(2, 4)]

    def step():
        lin(x[0]).sum().backward()
    step.clear_grads, step.params = (lambda: None), list(lin.parameters())
    record = {"recompiles_after_warmup": 0, "recompile_limit_hits": 0}
    run = bench_transformer.counting_recompiles(step, record)
    run()
    run()
    assert record["recompiles_after_warmup"] == 1  # the first compilation; the same shape again reuses it
    x[0] = torch.randn(3, 4)
    run()
    assert record == {"recompiles_after_warmup": 2, "recompile_limit_hits": 0}
    assert run.params == step.params


def test_layer_steps_compiled_rows(fresh_dynamo):
    cfg = _tiny("llama")
    layers = bench_transformer.build_layers(cfg, device="cpu", peer=False)
    steps = bench_host.layer_steps(cfg, layers, 32, "delayed", device="cpu", compile_mode="default", backend="eager")
    assert list(steps) == ["torch bf16 + SDPA", "te FP8 delayed", "torch bf16 + SDPA, torch.compile",
                           "te FP8 delayed, torch.compile"]
    for step in list(steps.values())[2:]:
        step()
        assert all(p.grad is not None for p in step.params)


def test_compiled_rows(fresh_dynamo):
    cfg = _tiny("gpt")
    layers = bench_transformer.build_layers(cfg, device="cpu", peer=False)
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    steps, records = bench_transformer.compiled_steps(cfg, layers, x, dy, {}, {}, warmup=2, device="cpu",
                                                      backend="eager")
    names = ["torch bf16 + SDPA, torch.compile", "te FP8 delayed, torch.compile", "te FP8 current, torch.compile"]
    assert list(steps) == list(records) == names
    for name, step in steps.items():
        step()
        assert all(p.grad is not None for p in step.params)
        record = records[name]
        assert record["warmup_steps"] == 2 and record["graphs"] >= 1 and record["compile_s"] > 0
        assert {"graph_breaks", "recompiles_after_warmup", "recompile_limit_hits"} <= set(record)
    torch_row = records["torch bf16 + SDPA, torch.compile"]
    assert (torch_row["graphs"], torch_row["graph_breaks"], torch_row["recompiles_after_warmup"]) == (1, 0, 0)


def test_graphed_rows_without_cuda_are_left_out_with_the_reason(capsys):
    if torch.cuda.is_available():
        pytest.skip("the rows are captured where CUDA is available")
    cfg = _tiny("gpt")
    layers = bench_transformer.build_layers(cfg, device="cpu", peer=False)
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)
    assert bench_transformer.graphed_steps(cfg, layers, x, torch.randn_like(x), {}, device="cpu") == {}
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"skipping row 'te FP8 {kind}, CUDA graph'"
                                                       for kind in ("delayed", "current")]
    assert all("needs CUDA" in line for line in lines)


def test_energy_needs_nvml(monkeypatch, capsys):
    monkeypatch.setattr(bench_transformer, "nvml_missing", lambda: "needs NVIDIA's NVML bindings: pip install nvidia-ml-py")
    with pytest.raises(SystemExit) as stop:
        bench_transformer.parse_args(["--model", "llama", "--energy", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "nvidia-ml-py" in err, err


def test_energy_per_step_arithmetic(monkeypatch):
    """common.energy_interleaved on CPU steps and a meter whose counter each step advances by its own joules:
    every row gets exactly its joules per step, and ms_at_limit is those joules over the limit."""
    import common

    class Meter:
        limit_w, used = 500.0, 0.0

        def joules(self):
            return self.used

        def sm_mhz(self):
            return 1500

    meter = Meter()

    def step_of(joules):
        def step():
            meter.used += joules
        return step

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    got = common.energy_interleaved({"a": step_of(2.0), "b": step_of(0.25)}, {"a": 100.0, "b": 50.0}, seconds=0.5,
                                    rounds=2, meter=meter)
    assert got["a"]["J_per_step"] == 2.0 and got["b"]["J_per_step"] == 0.25
    assert got["a"]["ms_at_limit"] == pytest.approx(4.0) and got["b"]["ms_at_limit"] == pytest.approx(0.5)
    assert got["a"]["sm_MHz"] == 1500 and got["a"]["limit_W"] == 500.0
    assert got["a"]["watts"] > 0 and got["b"]["ms_in_window"] > 0


def test_moe_splits_are_uneven_aligned_and_whole():
    splits = bench_moe.routed_splits(128, 131072)
    assert sum(splits) == 131072 and len(splits) == 128 and all(s % 128 == 0 for s in splits)
    assert max(splits) > 2 * min(splits)  # routing is uneven
    assert bench_moe.routed_splits(128, 131072) == splits  # every row of a run sees the same splits


def test_torch_moe_layer_matches_a_per_token_loop():
    """The torch baseline layer of bench_moe (grouped GEMMs over sorted tokens) against a loop over each
    token's top-k experts in fp64."""
    torch.manual_seed(0)
    layer = bench_moe.TorchMoE(experts=4, topk=2, hidden=16, ffn=8, device="cpu", dtype=torch.float32)
    x = torch.randn(10, 16)
    got = layer(x)
    w_router = layer.router.weight.detach().double()
    probs, idx = torch.topk(torch.softmax(x.double() @ w_router.t(), -1), 2, dim=-1)
    want = torch.zeros(10, 16, dtype=torch.float64)
    for t in range(10):
        for j in range(2):
            e = idx[t, j]
            a, b = (x[t].double() @ layer.fc1[e].detach().double().t()).chunk(2)
            want[t] += probs[t, j] * (layer.fc2[e].detach().double() @ (torch.nn.functional.silu(a) * b))
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
