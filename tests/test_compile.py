"""te_parallel modules under torch.compile: one graph, no graph break, no recompilation after the first
training step, and the numerics of eager mode, in fp32 and under FP8 delayed and current scaling.

Training here is several steps of forward, backward and an optimizer step, under fp8_autocast as in eager
use. "The same numerics" is checked on everything a step produces: outputs, every parameter gradient, and
the FP8 scaling state (scales, amax histories, update counts) after the last step. With the aot_eager
backend (dynamo's graph and AOT autograd's forward/backward split, run by eager kernels) that is bit for
bit on the CPU; inductor's generated kernels round some fp32 intermediates differently (fused norms and
reductions), so those runs compare within the FP8 chain tolerance. Graphs and recompilations are counted
with torch._dynamo.utils.counters, reset per test. docs/compile.md is the guide.
"""
import contextlib

import pytest
import torch
from torch._dynamo.utils import counters

import te_parallel as te
from te_parallel import recipe as R
from tests.reference import fp8_chain_tol, rel_err

STEPS = 3
MODULES = {
    "linear": lambda d: te.Linear(64, 32, device=d),
    "layernorm_linear": lambda d: te.LayerNormLinear(64, 32, device=d),
    "layernorm_mlp_swiglu": lambda d: te.LayerNormMLP(64, 128, activation="swiglu", device=d),
    "layernorm_mlp_gelu": lambda d: te.LayerNormMLP(64, 128, activation="gelu", device=d),
    # eager mode makes the backward's [tokens, ffn] gradient in two row chunks; a graph in one piece
    "layernorm_mlp_swiglu_chunked": lambda d: te.LayerNormMLP(64, 128, activation="swiglu", bwd_chunk_bytes=8192,
                                                              device=d),
    "gpt_layer": lambda d: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device=d),
    "llama_layer": lambda d: te.TransformerLayer(64, 128, 4, num_gqa_groups=2, normalization="RMSNorm",
                                                 activation="swiglu", bias=False, hidden_dropout=0.0,
                                                 attention_dropout=0.0, device=d),
}
# amax_history_len other than the state's initial 1024: the first exit update resizes the history, which a
# graph must not see (it would recompile on the next step)
RECIPES = {"fp32": None, "delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling(),
           "block": R.Float8BlockScaling()}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Counters and compiled code of this test only (dynamo keeps one cache per code object)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled_so_far():
    """(graphs dynamo made, graph-break reasons) since the counters were cleared: a recompilation is one
    more graph."""
    breaks = [reason.splitlines()[0] for reason in counters["graph_break"]]
    return counters["stats"]["unique_graphs"], breaks


def _train(module, fn, recipe, device, steps=STEPS, lr=0.1, **call):
    """Outputs and gradients of `steps` training steps of fn (module or its compiled self), the FP8 state after
    them, and _compiled_so_far() after each step. The inputs depend only on the step."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(5)
    results, compiled = [], []
    for step in range(steps):
        x = torch.randn(16, 2, 64, generator=gen).to(device)
        with contextlib.nullcontext() if recipe is None else te.fp8_autocast(fp8_recipe=recipe):
            y = fn(x, **call)
        y.backward(torch.randn(y.shape, generator=gen).to(device))
        results.append((f"step {step} output", y.detach().clone()))
        results += [(f"step {step} grad {n}", p.grad.clone()) for n, p in module.named_parameters()]
        opt.step()
        opt.zero_grad()
        compiled.append(_compiled_so_far())
    results += [(f"state {k}", v.clone()) for k, v in module.state_dict().items() if "fp8_state" in k]
    return results, compiled


def _twins(name, device):
    torch.manual_seed(0)
    eager, twin = MODULES[name](device), MODULES[name](device)
    twin.load_state_dict(eager.state_dict())
    return eager, twin


def _assert_one_graph_from_the_first_step(compiled, graphs=1):
    made, breaks = compiled[0]
    assert not breaks, f"graph breaks (TORCH_LOGS=graph_breaks shows where): {breaks}"
    assert made == graphs, f"the first step made {made} graphs, want {graphs}"
    assert all(c == compiled[0] for c in compiled), f"(graphs, graph breaks) after each step: {compiled}"


def _assert_same(want, got, tol=None):
    """Bit for bit (tol None), else relative error below tol; a near-zero gradient (TransformerLayer's
    key bias: softmax is invariant to it, so its gradient is rounding noise) within 1e-6 absolute."""
    assert [n for n, _ in want] == [n for n, _ in got]
    for (name, a), (_, b) in zip(want, got):
        if tol is None:
            assert torch.equal(a, b), f"{name}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}"
        elif name.endswith("key_bias"):
            assert (a - b).abs().max() < 1e-6, name
        elif a.dtype == torch.int64:
            assert torch.equal(a, b), name
        else:
            assert rel_err(b, a) < tol, f"{name}: relative error {rel_err(b, a):.3g} (tolerance {tol:.3g})"


def _eager_tol(recipe, device):
    """aot_eager runs the eager kernels on the CPU; on CUDA eager mode takes native kernels (norms, casts)
    where a graph takes their torch paths, which round the high-precision intermediates differently."""
    if device == "cpu":
        return None
    return 1e-5 if recipe is None else fp8_chain_tol(device)


# block scaling: the GEMM modules' shapes (the MLP variants run the same Functions as llama_layer's MLP)
EAGER_CASES = [(n, r) for n in MODULES for r in RECIPES
               if r != "block" or n in ("linear", "layernorm_linear", "llama_layer")]


@pytest.mark.parametrize("name, recipe", EAGER_CASES, ids=[f"{n}-{r}" for n, r in EAGER_CASES])
def test_compiled_training_matches_eager(name, recipe, device):
    """Every module and recipe: one graph (fullgraph: a graph break is an error that says where) made by the
    first step, none after it, and the eager results (bit for bit on the CPU: the graph computes what eager
    mode computes)."""
    eager, twin = _twins(name, device)
    want, _ = _train(eager, eager, RECIPES[recipe], device)
    counters.clear()
    got, compiled = _train(twin, torch.compile(twin, backend="aot_eager", fullgraph=True), RECIPES[recipe], device)
    _assert_one_graph_from_the_first_step(compiled)
    _assert_same(want, got, _eager_tol(RECIPES[recipe], device))


INDUCTOR_CASES = [("linear", "delayed"), ("linear", "current"), ("layernorm_mlp_swiglu", "current"),
                  ("layernorm_mlp_swiglu_chunked", "delayed"), ("llama_layer", "delayed")]


@pytest.mark.parametrize("name, recipe", INDUCTOR_CASES, ids=[f"{n}-{r}" for n, r in INDUCTOR_CASES])
def test_inductor_training_matches_eager(name, recipe, device):
    """The default backend (inductor's generated kernels): the same graph counts, the eager results within
    the FP8 chain tolerance, the FP8 state within fp32 rounding."""
    eager, twin = _twins(name, device)
    want, _ = _train(eager, eager, RECIPES[recipe], device)
    counters.clear()
    got, compiled = _train(twin, torch.compile(twin, dynamic=False), RECIPES[recipe], device)
    _assert_one_graph_from_the_first_step(compiled)
    steps = sum(not n.startswith("state ") for n, _ in want)  # (the FP8 state's entries come last)
    _assert_same(want[:steps], got[:steps], fp8_chain_tol(device))
    _assert_same(want[steps:], got[steps:], 1e-5 if device == "cpu" else fp8_chain_tol(device))


def test_layers_compiled_one_by_one_share_their_graph(device):
    """A model compiled layer by layer (torch.compile per block, as FSDP2 recipes do): the layers share one
    graph (nothing in it is particular to a layer), the first layer has a second one only because its input
    does not require grad; FP8 delayed state as eager mode's."""
    recipe = R.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    eager = torch.nn.Sequential(*[MODULES["gpt_layer"](device) for _ in range(3)])
    twin = torch.nn.Sequential(*[MODULES["gpt_layer"](device) for _ in range(3)])
    twin.load_state_dict(eager.state_dict())
    compiled = torch.nn.Sequential(*[torch.compile(layer, backend="aot_eager") for layer in twin])
    want, _ = _train(eager, eager, recipe, device)
    counters.clear()
    got, made = _train(twin, compiled, recipe, device)
    _assert_one_graph_from_the_first_step(made, graphs=2)
    _assert_same(want, got, _eager_tol(recipe, device))


def test_fp8_autocast_inside_a_compiled_function(device):
    """fp8_autocast entered inside the compiled function still runs its region (its entry and exit run
    eagerly, at a graph break each), so the module inside compiles as its own graph with eager numerics."""
    recipe = R.DelayedScaling(amax_history_len=4)
    eager, twin = _twins("layernorm_mlp_gelu", device)

    def step(module, x):
        with te.fp8_autocast(fp8_recipe=recipe):
            y = module(x)
        return y * 2

    want, _ = _train(eager, lambda x: step(eager, x), None, device)
    counters.clear()
    compiled_step = torch.compile(step, backend="aot_eager")
    got, compiled = _train(twin, lambda x: compiled_step(twin, x), None, device)
    assert all(c == compiled[0] for c in compiled), f"(graphs, graph breaks) after each step: {compiled}"
    _assert_same(want, got, _eager_tol(recipe, device))


def test_first_microbatch_flag(device):
    """TE's is_first_microbatch: True casts the weights and keeps them, False reuses them (the key holds no
    version counters, so no guard changes per step): one graph per flag value, one more the first time a
    kept weight exists; eager numerics, delayed and current scaling."""
    for recipe in (RECIPES["delayed"], RECIPES["current"]):
        torch._dynamo.reset()
        counters.clear()
        eager, twin = _twins("layernorm_mlp_gelu", device)
        compiled = torch.compile(twin, backend="aot_eager")
        want, got, made = [], [], []
        for step in range(STEPS):
            for first in (True, False):
                x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(step)).to(device)
                for module, fn, out in ((eager, eager, want), (twin, compiled, got)):
                    with te.fp8_autocast(fp8_recipe=recipe):
                        y = fn(x, is_first_microbatch=first)
                    y.sum().backward()
                    out.append((f"step {step} first={first}", y.detach().clone()))
            for module, out in ((eager, want), (twin, got)):
                out += [(f"step {step} grad {n}", p.grad.clone()) for n, p in module.named_parameters()]
                module.zero_grad()
            made.append(_compiled_so_far())
        assert not made[-1][1], f"graph breaks: {made[-1][1]}"
        assert made[1] == made[-1] and made[-1][0] <= 3, f"(graphs, graph breaks) after each step: {made}"
        want += [(k, v) for k, v in eager.state_dict().items() if "fp8_state" in k]
        got += [(k, v) for k, v in twin.state_dict().items() if "fp8_state" in k]
        _assert_same(want, got, _eager_tol(recipe, device))


@pytest.mark.parametrize("name", ["linear", "layernorm_mlp_gelu"])
def test_calibration_in_a_graph(name, device):
    """fp8_autocast(enabled=False, calibrating=True) under delayed scaling: the graph computes in high
    precision and records amaxes, and the exit and end-of-backward updates leave eager mode's FP8 state
    (no cast reads a scale here, so the registration op is kept in the graph by its own mark alone)."""
    recipe = R.DelayedScaling(amax_history_len=4)
    eager, twin = _twins(name, device)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    want, got = [], []
    for step in range(STEPS):
        x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(step)).to(device)
        for module, fn, out in ((eager, eager, want), (twin, compiled, got)):
            with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
                y = fn(x)
            y.sum().backward()
            out.append((f"step {step} output", y.detach().clone()))
            out += [(f"step {step} grad {n}", p.grad.clone()) for n, p in module.named_parameters()]
            module.zero_grad()
    want += [(f"state {k}", v) for k, v in eager.state_dict().items() if "fp8_state" in k]
    got += [(f"state {k}", v) for k, v in twin.state_dict().items() if "fp8_state" in k]
    assert any(v.abs().sum() > 0 for k, v in want if k.endswith("amax_history")), "calibration recorded no amax"
    _assert_same(want, got, _eager_tol(None, device))


def test_first_attention_of_the_process_in_a_graph(device, monkeypatch):
    """The first attention a process runs may be a traced one: whether cuDNN's frontend is there (an import
    and an exit handler the first time it is asked) is settled outside the graph, which stays whole."""
    if device == "cpu":
        pytest.skip("the cuDNN frontend is asked about CUDA tensors only")
    from te_parallel.ops import attention_cudnn_fe

    monkeypatch.setattr(attention_cudnn_fe, "_frontend", {})  # as in a process that has run no attention
    eager, twin = _twins("llama_layer", device)
    got, compiled = _train(twin, torch.compile(twin, backend="aot_eager", fullgraph=True), RECIPES["current"],
                           device)
    _assert_one_graph_from_the_first_step(compiled)
    want, _ = _train(eager, eager, RECIPES["current"], device)
    _assert_same(want, got, _eager_tol(RECIPES["current"], device))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_checkpointed_mlp(recipe, device):
    """LayerNormMLP(checkpoint=True) (te.checkpoint): in a graph the recompute is torch's selective checkpoint,
    which keeps the pass's FP8 scales and recomputes the rest; eager results, one graph."""
    torch.manual_seed(0)
    make = lambda: te.LayerNormMLP(64, 128, activation="gelu", checkpoint=True, device=device)  # noqa: E731
    eager, twin = make(), make()
    twin.load_state_dict(eager.state_dict())
    want, _ = _train(eager, eager, RECIPES[recipe], device)
    counters.clear()
    got, compiled = _train(twin, torch.compile(twin, backend="aot_eager", fullgraph=True), RECIPES[recipe], device)
    _assert_one_graph_from_the_first_step(compiled)
    _assert_same(want, got, _eager_tol(RECIPES[recipe], device))


REDUCE_OVERHEAD_CASES = [("linear", "delayed"), ("linear", "current"), ("llama_layer", "delayed"),
                         ("llama_layer", "current"), ("gpt_layer", "delayed"), ("gpt_layer", "current")]


def _cuda_graphs_recorded() -> int:
    """CUDA graphs inductor's CUDA graph trees have recorded on this device so far (nodes of its trees)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    todo = [] if manager is None else [n for nodes in manager.roots.values() for n in nodes]
    count = 0
    while todo:
        node = todo.pop()
        count += 1
        todo += [child for children in node.children.values() for child in children]
    return count


@pytest.mark.parametrize("name, recipe", REDUCE_OVERHEAD_CASES, ids=[f"{n}-{r}" for n, r in REDUCE_OVERHEAD_CASES])
def test_reduce_overhead_training_matches_eager(name, recipe, device):
    """mode="reduce-overhead" (inductor's CUDA graphs): the forward and the backward are recorded as one CUDA
    graph each in the first steps and replayed after; the bookkeeping ops run outside them on every step,
    so five steps give eager mode's outputs, gradients and FP8 state (scales, histories) within the FP8
    chain tolerance, with no CUDA graph skipped and none recorded in the last two steps. (A smaller
    learning rate than the other tests': at 0.1 the attention layers' weights blow up by the fifth step,
    eagerly as compiled.)"""
    if device == "cpu":
        pytest.skip("inductor's CUDA graphs (mode='reduce-overhead') need a GPU")
    eager, twin = _twins(name, device)
    want, _ = _train(eager, eager, RECIPES[recipe], device, steps=5, lr=0.01)
    counters.clear()
    compiled_twin, recorded = torch.compile(twin, dynamic=False, mode="reduce-overhead"), []

    def call(x):
        recorded.append(_cuda_graphs_recorded())  # by the steps before this one
        return compiled_twin(x)

    got, compiled = _train(twin, call, RECIPES[recipe], device, steps=5, lr=0.01)
    recorded.append(_cuda_graphs_recorded())
    _assert_one_graph_from_the_first_step(compiled)
    skips = counters["inductor"].get("cudagraph_skips")
    assert not skips, f"inductor skipped CUDA graphs: {dict(counters['inductor'])}"
    # one CUDA graph for the forward and one for the backward: the bookkeeping ops of delayed scaling run
    # before the forward's and after the backward's, not between pieces of them
    assert recorded[0] == 0 and recorded[3] == recorded[-1] == 2, f"CUDA graphs recorded before each step: {recorded}"
    steps = sum(not n.startswith("state ") for n, _ in want)
    _assert_same(want[:steps], got[:steps], fp8_chain_tol(device))
    _assert_same(want[steps:], got[steps:], fp8_chain_tol(device))
