"""TE's clients on a CUDA GPU through the compat package (`import transformer_engine` backed by te_parallel):
accelerate, Lightning (Fabric and Trainer) and Megatron-core train small models in FP8, unchanged.

What every case shows, besides a finite, falling loss over STEPS steps on one fixed random batch:
- the client's layers became te_parallel modules, on the GPU;
- FP8 ran in every GEMM module: each one's forward GEMMs went through te_parallel's FP8 GEMM
  (`te_parallel.ops.gemm.fp8_mm`, which every FP8 GEMM calls; counted by a pass-through spy, attributed to
  a module by forward hooks), on CUDA, in every step, tiny layers (8 tokens x 16 features) included;
- with delayed scaling, each module's scales were updated (`fp8_state.updates()` counts forward and
  backward updates) and its forward and backward scales all differ from their values before training;
- Megatron's bf16 case (no fp8) ran no FP8 GEMM at all.
The run_* functions take the device; the tests pass "cuda". (Run on the CPU with device="cpu", the same
checks passed when this module was written: a check of the test logic, not a test here.)

The CPU suite (tests/compat) runs the same clients on the CPU; this module is the GPU run of them. Every
test skips with its reason where there is no FP8-capable CUDA GPU, or the compat package or the client
library is not importable. Megatron's TP=2 case needs two GPUs and skips on fewer.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

STEPS = 20
MEGATRON_CASES = ["bf16", "fp8-delayed", "fp8-tensorwise",  # keys of tests/compat/megatron_cases.py: CASES
                  "moe-bf16", "moe-fp8-delayed", "moe-fp8-tensorwise"]  # and MOE_CASES


# --- skips ----------------------------------------------------------------------------------------------
def _fp8_gpu_or_skip() -> None:
    """tests/gpu/conftest.py's `device` check, for the module-scoped Megatron fixture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip(f"needs compute capability >= 8.9 for FP8, this GPU has {major}.{minor}")


def _compat_or_skip():
    try:
        import transformer_engine
    except ImportError as e:
        pytest.skip(f"transformer_engine is not importable ({e}); install the stand-in: "
                    f"pip install --no-build-isolation --no-deps ./compat")
    version = getattr(transformer_engine, "__version__", "")
    if "teparallel" not in version:
        pytest.skip(f"transformer_engine {version} is NVIDIA's TE, not te_parallel's stand-in")
    return transformer_engine


def _client_or_skip(module: str, dist: str):
    return pytest.importorskip(module, reason=f"{dist} is not installed")


@pytest.fixture
def compat():
    return _compat_or_skip()


# --- FP8 evidence -----------------------------------------------------------------------------------------
class FP8GemmSpy:
    """Counts te_parallel's FP8 GEMMs as they run, without changing them. Every FP8 GEMM (fprop, dgrad,
    wgrad; native cuBLASLt call or torch._scaled_mm) goes through `te_parallel.ops.gemm.fp8_mm`, looked up
    in that module at each call; the spy replaces it (monkeypatch) by a pass-through that records
    (what, device type, module, (m, k, n)). `watch` attributes the GEMMs run inside a module's forward to
    it (forward hooks); backward GEMMs are attributed to no module. A zero-padded GEMM (a dimension not a
    multiple of 16) calls fp8_mm again on the padded operands: only the outer call is recorded."""

    def __init__(self, monkeypatch) -> None:
        from te_parallel.ops import gemm

        real = gemm.fp8_mm
        sig = inspect.signature(real)
        self.calls = []
        self._stack = []
        self._depth = 0

        def fp8_mm(*args, **kwargs):
            if self._depth == 0:
                bound = sig.bind(*args, **kwargs).arguments
                a, b = bound["a"], bound["b"]
                self.calls.append((bound.get("what", ""), a.device.type, self._stack[-1] if self._stack else None,
                                   (a.shape[0], a.shape[1], b.shape[1])))
            self._depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        monkeypatch.setattr(gemm, "fp8_mm", fp8_mm)
        self._watch_grouped(monkeypatch)

    def _watch_grouped(self, monkeypatch) -> None:
        """GroupedLinear's GEMMs (one grouped GEMM per pass, te_parallel.ops.grouped_gemm) do not go through
        fp8_mm: its grouped_fprop / grouped_dgrad / grouped_wgrad are recorded alike when their first operand is
        FP8 (a Float8Tensor, or a BlockwiseTensor under block scaling)."""
        from te_parallel.fp8.blockwise import BlockwiseTensor
        from te_parallel.fp8.tensor import Float8Tensor
        from te_parallel.ops import grouped_gemm

        def spied(what, real):
            def call(a, b, *args, **kwargs):
                if isinstance(a, (Float8Tensor, BlockwiseTensor)):
                    data = a.data if a.data is not None else a.data_t
                    self.calls.append((what, data.device.type, self._stack[-1] if self._stack else None,
                                       tuple(a.shape)))
                return real(a, b, *args, **kwargs)
            return call

        for what in ("fprop", "dgrad", "wgrad"):
            name = f"grouped_{what}"
            monkeypatch.setattr(grouped_gemm, name, spied(what, getattr(grouped_gemm, name)))

    def watch(self, mods) -> None:
        def leave(_module, _args, _out) -> None:  # (a forward hook's return value would replace the output)
            self._stack.pop()

        for name, m in mods:
            m.register_forward_pre_hook(lambda _module, _args, n=name: self._stack.append(n))
            m.register_forward_hook(leave)

    def count(self, what: str, module=None) -> int:
        return sum(1 for w, _, mod, _ in self.calls if w == what and (module is None or mod == module))

    def devices(self) -> set:
        return {dev for _, dev, _, _ in self.calls}


def gemm_modules(model):
    """(name, module) of te_parallel's GEMM modules (those with an FP8 scaling state) in `model`."""
    from te_parallel.fp8.state import FP8ScalingState

    return [(n, m) for n, m in model.named_modules() if isinstance(m._modules.get("fp8_state"), FP8ScalingState)]


def snapshot(mods) -> dict:
    return {n: {"fwd_scale": m.fp8_state.fwd_scale.detach().cpu().clone(),
                "bwd_scale": m.fp8_state.bwd_scale.detach().cpu().clone(),
                "updates": m.fp8_state.updates()} for n, m in mods}


def _used_slots(m):
    """The delayed-scaling slots a GroupedLinear uses: it casts all the experts' rows of x and dy at once, with GEMM
    0's input (forward slot 0) and gradient (backward slot 0) slots, and each expert's weight with its own (2g + 1);
    the other experts' input and gradient slots stay unused. None for the other modules: every slot."""
    import te_parallel

    if not isinstance(m, te_parallel.GroupedLinear):
        return None
    return {"fwd_scale": {0, *range(1, 2 * m.num_gemms, 2)}, "bwd_scale": {0}}


def assert_fp8_ran(mods, before: dict, steps: int, spy: FP8GemmSpy, device: str, delayed: bool) -> None:
    """FP8 GEMMs ran in every module every step on `device`; with delayed scaling each module's forward and
    backward scales were updated every step and all moved from their initial values."""
    assert mods, "no te_parallel GEMM modules in the model"
    problems = []
    if spy.devices() != {device}:
        problems.append(f"FP8 GEMMs ran on {spy.devices() or 'no device'}, expected {device}")
    wgrads = spy.count("wgrad")
    if wgrads < len(mods) * steps:
        problems.append(f"{wgrads} FP8 wgrad GEMMs for {len(mods)} modules x {steps} steps")
    for name, m in mods:
        fprops = spy.count("fprop", name)
        if fprops < steps:
            problems.append(f"{name}: {fprops} FP8 forward GEMMs in {steps} steps")
        if not delayed:
            continue
        (f0, b0), (f1, b1) = before[name]["updates"], m.fp8_state.updates()
        if f1 - f0 < steps or b1 - b0 < steps:
            problems.append(f"{name}: {f1 - f0} forward / {b1 - b0} backward scale updates in {steps} steps")
        used = _used_slots(m)
        for key in ("fwd_scale", "bwd_scale"):
            old, new = before[name][key], getattr(m.fp8_state, key).detach().cpu()
            kept = [i for i in (new == old).nonzero().flatten().tolist() if used is None or i in used[key]]
            if kept:
                problems.append(f"{name}: fp8_state.{key} slot(s) {kept} kept their initial value(s) "
                                f"{old[kept].tolist()}")
    assert not problems, "FP8 did not run as expected:\n  " + "\n  ".join(problems)


def assert_on(model, device: str) -> None:
    off = [n for n, p in model.named_parameters() if p.device.type != device]
    off += [f"{n}.fp8_state" for n, m in gemm_modules(model) if m.fp8_state.fwd_scale.device.type != device]
    assert not off, f"not on {device}: {off}"


def assert_falls(losses, factor: float) -> None:
    assert all(math.isfinite(x) for x in losses), f"non-finite loss: {losses}"
    assert losses[-1] < factor * losses[0], f"loss did not fall to {factor} x its first value: {losses}"


# --- accelerate -------------------------------------------------------------------------------------------
ACCELERATE_HANDLERS = {
    "TERecipeKwargs": dict(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max"),
    "FP8RecipeKwargs": dict(backend="TE", fp8_format="E4M3", margin=1),
}


def _accelerate_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def _train_loop(model, backward, opt, x, y) -> list:
    """STEPS optimizer steps on one fixed batch (the client's own backward); the losses."""
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_accelerate(device: str, handler: str, tokens: int, monkeypatch) -> None:
    """Accelerator(mixed_precision="fp8") with a TE recipe handler prepares (converts nn.Linear /
    nn.LayerNorm to TE modules, wraps forward in torch.autocast(bf16) and fp8_autocast) and trains."""
    accelerate = _client_or_skip("accelerate", "accelerate")
    import accelerate.utils as au
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import te_parallel

    cls = getattr(au, handler, None)
    if cls is None:
        pytest.skip(f"accelerate {accelerate.__version__} has no {handler}")
    # accelerate finds TE by importlib.metadata of the distribution "transformer-engine" (compat's name)
    assert au.is_transformer_engine_available(), "accelerate does not see transformer_engine (metadata of " \
                                                 "'transformer-engine' missing: is compat pip-installed?)"
    AcceleratorState._reset_state(True)
    try:
        torch.manual_seed(0)
        handlers = [cls(**ACCELERATE_HANDLERS[handler])]
        acc = Accelerator(mixed_precision="fp8", cpu=device == "cpu", kwargs_handlers=handlers)
        assert acc.device.type == device, acc.device
        model = _accelerate_model()
        model, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))  # accelerate re-points opt
        assert au.has_transformer_engine_layers(model)
        assert all(isinstance(model[i], te_parallel.Linear) for i in (0, 3, 5)), [type(m) for m in model]
        assert isinstance(model[2], te_parallel.LayerNorm), type(model[2])
        mods = gemm_modules(model)
        assert [n for n, _ in mods] == ["0", "3", "5"], [n for n, _ in mods]
        assert_on(model, device)
        before, spy = snapshot(mods), FP8GemmSpy(monkeypatch)
        spy.watch(mods)
        x, y = torch.randn(tokens, 32, device=acc.device), torch.randn(tokens, 16, device=acc.device)
        losses = _train_loop(model, acc.backward, opt, x, y)
        assert_falls(losses, 0.5)
        assert_fp8_ran(mods, before, STEPS, spy, device, delayed=True)
        assert model[0].fp8  # TE's attribute: the last forward ran in FP8
        if "amax_history_len" in ACCELERATE_HANDLERS[handler]:
            assert model[0].fp8_meta["recipe"].amax_history_len == 16  # the handler's recipe reached the module
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.filterwarnings("ignore:FP8RecipeKwargs is deprecated:FutureWarning")
@pytest.mark.parametrize("handler", list(ACCELERATE_HANDLERS))
@pytest.mark.parametrize("tokens", [8, 16])
def test_accelerate_fp8_trains_on_cuda(device, compat, monkeypatch, handler, tokens):
    run_accelerate(device, handler, tokens, monkeypatch)


# --- Lightning --------------------------------------------------------------------------------------------
def _tiny_net():
    """Every layer tiny: with 8 tokens the GEMMs are 8x16x64, 8x64x16 and 8x16x16 (all FP8, as in TE)."""
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))


def _check_tiny_net(net, device: str, dtype: torch.dtype) -> None:
    import te_parallel

    assert all(isinstance(net[i], te_parallel.Linear) for i in (0, 3, 5)), [type(m) for m in net]
    assert isinstance(net[2], te_parallel.LayerNorm), type(net[2])
    assert "transformer_engine.pytorch" in net[0].__module__  # Lightning's "already converted" test
    assert net[5].weight.dtype == dtype, net[5].weight.dtype
    assert_on(net, device)


def run_fabric(device: str, precision: str, monkeypatch) -> None:
    """Fabric(precision="transformer-engine" / "transformer-engine-float16"): setup_module replaces the
    layers (bf16 / fp16 weights) and forward runs under fp8_autocast; 8-token steps."""
    _client_or_skip("lightning", "lightning")
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cuda" if device == "cuda" else "cpu", devices=1, precision=precision)
    model = fabric.setup_module(_tiny_net())  # replaces the layers: make the optimizer afterwards (as with TE)
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4))  # eps: fp16 weights
    net = model.module
    _check_tiny_net(net, device, torch.float16 if precision.endswith("float16") else torch.bfloat16)
    mods = gemm_modules(net)
    before, spy = snapshot(mods), FP8GemmSpy(monkeypatch)
    spy.watch(mods)
    x, y = torch.randn(8, 16, device=fabric.device), torch.randn(8, 16, device=fabric.device)
    losses = _train_loop(model, fabric.backward, opt, x, y)
    assert_falls(losses, 0.5)
    assert_fp8_ran(mods, before, STEPS, spy, device, delayed=True)
    assert (8, 16, 16) in {shape for what, _, _, shape in spy.calls if what == "fprop"}  # the 8x16x16 GEMM in FP8


@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16"])
def test_lightning_fabric_fp8_trains_on_cuda(device, compat, monkeypatch, precision):
    run_fabric(device, precision, monkeypatch)


def run_trainer(device: str, monkeypatch) -> None:
    """Trainer(precision="transformer-engine", max_steps=STEPS): the precision plugin converts the layers
    during fit; 8-token batches, all the same."""
    L = _client_or_skip("lightning", "lightning")
    spy = FP8GemmSpy(monkeypatch)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _tiny_net()
            self.losses, self.mods, self.before = [], None, None

        def on_train_start(self):  # after the precision plugin has converted the layers and moved them
            # (checked here: at the end of fit, Lightning's teardown moves the model back to the CPU)
            _check_tiny_net(self.net, device, torch.bfloat16)
            self.mods = gemm_modules(self.net)
            self.before = snapshot(self.mods)
            spy.watch(self.mods)

        def training_step(self, batch, _):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(STEPS, 1), y.repeat(STEPS, 1)),
                                       batch_size=8)
    module = Module()
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision="transformer-engine",
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert len(module.losses) == STEPS, module.losses
    assert_falls(module.losses, 0.5)
    assert_fp8_ran(module.mods, module.before, STEPS, spy, device, delayed=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_trainer_fp8_trains_on_cuda(device, compat, monkeypatch):
    run_trainer(device, monkeypatch)


# --- Megatron-core ----------------------------------------------------------------------------------------
def check_megatron_run(name: str, r: dict, steps: int) -> None:
    """What tests/compat/test_megatron.py checks of a run (tests/compat/megatron_cases.py: train)."""
    from tests.compat.megatron_cases import CASES, MOE_CASES

    losses = r["losses"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.3, f"loss is not falling: {losses}"
    assert r["checkpoint"] == "", r["checkpoint"]  # TE's state-dict layout, strict load with the FP8 state
    assert r["split"] == "", r["split"]  # split_te_layernorm_column_parallel_linear
    assert r["fp8_modules"] == 8, r  # linear_qkv, linear_proj, linear_fc1, linear_fc2 of each of 2 layers
    if {**CASES, **MOE_CASES}[name].get("fp8_recipe") == "delayed":
        assert all(n >= steps for n in r["fwd_updates"]), f"FP8 scale updates: {r['fwd_updates']}"


def run_megatron(name: str, device: str, monkeypatch) -> None:
    """One case of tests/compat/megatron_cases.py at TP=1 on `device` (torch.distributed and Megatron's
    parallel_state initialised by the caller), STEPS steps, spying on the model it builds."""
    from tests.compat import megatron_cases as mc

    monkeypatch.setattr(mc, "STEPS", STEPS)
    spy = FP8GemmSpy(monkeypatch)
    built = []
    real_model = mc._model

    def model_spy(*args, **kwargs):  # the first model train() builds is the one it trains
        model = real_model(*args, **kwargs)
        if not built:
            mods = gemm_modules(model)
            built.append((model, mods, snapshot(mods)))
            spy.watch(mods)
        return model

    monkeypatch.setattr(mc, "_model", model_spy)
    r = mc.train(name, 1, device=device)
    check_megatron_run(name, r, STEPS)
    model, mods, before = built[0]
    assert_on(model, device)
    case = mc._case(name)
    if "fp8" in case:
        assert_fp8_ran(mods, before, STEPS, spy, device, delayed=case["fp8_recipe"] == "delayed")
    else:
        assert not spy.calls, f"FP8 GEMMs ran without fp8: {spy.calls[:4]}"
        assert all(p.dtype == torch.bfloat16 for _, m in mods for p in m.parameters()), "TE modules not bf16"


def _tp_worker(rank: int, world: int, device, out_path: str, names, steps: int) -> None:
    """tests/distributed/harness.spawn worker: the cases at TP=world on one GPU per rank (NCCL)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.compat import megatron_cases as mc

    mc.STEPS = steps
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234, te_rng_tracker=True)
    try:
        results = {name: mc.train(name, world, device=device) for name in names}
    finally:
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out_path)


def test_megatron_gpt_tp2_sp_trains_on_cuda(tmp_path):
    """TP=2 with sequence parallelism, one GPU per rank (spawned, NCCL): losses fall, FP8 scales update."""
    _fp8_gpu_or_skip()
    from tests.distributed import harness

    if not harness.use_cuda(2):
        pytest.skip(f"TP=2 needs 2 GPUs (one per rank, NCCL); this machine has {torch.cuda.device_count()}")
    _compat_or_skip()
    _client_or_skip("megatron.core", "megatron-core")
    path = str(tmp_path / "tp2.pt")
    harness.spawn(_tp_worker, 2, path, MEGATRON_CASES, STEPS)
    runs = torch.load(path)
    for name in MEGATRON_CASES:
        check_megatron_run(name, runs[name], STEPS)


@pytest.fixture(scope="module")
def megatron_tp1():
    """torch.distributed (NCCL, world size 1, a free port) and Megatron's parallel_state at TP=1 in this
    process, for the module's Megatron tests; torn down at the end of the module."""
    _fp8_gpu_or_skip()
    _compat_or_skip()
    _client_or_skip("megatron.core", "megatron-core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.distributed.harness import free_port

    if dist.is_initialized():
        pytest.fail("torch.distributed is already initialised in this process; run this module on its own")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234, te_rng_tracker=True)  # TE's tracker: te_parallel's
        yield "cuda"
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_megatron_gpt_tp1_trains_on_cuda(megatron_tp1, monkeypatch, name):
    """GPTModel with get_gpt_layer_with_transformer_engine_spec(), built as Megatron builds it on a GPU,
    trained through Megatron's DistributedDataParallel: RMSNorm+SwiGLU in bf16; fp8="hybrid" with the
    delayed (RMSNorm+SwiGLU) and tensorwise (LayerNorm+GELU) recipes."""
    run_megatron(name, megatron_tp1, monkeypatch)
