"""LayerNormMLP runs fc1 → activation → fc2 as one Function (te_parallel/ops/mlp.py): under delayed
scaling its activation kernels emit fc2's FP8 input and fc1's FP8 output gradient themselves; under
every recipe its backward makes fc2's dgrad output in row chunks.

It must compute what the unfused path computes (LinearFunction, activation, LinearFunction), step after
step while the amax history and the scales move: the same output, the same gradients, the same FP8
scaling state, bit for bit. The one exception is fc1's bias gradient under the FP8 activation, summed
by the activation kernel in another fp32 order than the gradient cast's (close, not equal, on CUDA).
"""
import copy

import pytest
import torch

import te_parallel as te
from te_parallel import recipe
from te_parallel.module import layernorm_mlp
from te_parallel.native import activation as native_act
from te_parallel.ops import mlp as mlp_ops

STEPS = 3


def _steps(module, x, dy, rec, fuse: bool, monkeypatch):
    """STEPS training steps (SGD on the weights, so the FP8 weight cache recasts); what each produced.
    (The patches live in a nested context: the conftest's own patches stay in place.)"""
    with monkeypatch.context() as mp:
        # the norm's own FP8 pass (CUDA) is the same in both or neither: tests/gpu/test_norm_fp8_modules.py
        mp.setattr(layernorm_mlp, "norm_to_fp8", lambda *args: None)
        if not fuse:
            mp.setattr(layernorm_mlp, "can_fuse", lambda *args: False)
        calls = []
        real = mlp_ops.FusedMLPFunction.forward
        mp.setattr(mlp_ops.FusedMLPFunction, "forward", staticmethod(lambda *a: calls.append(1) or real(*a)))
        seen = []
        for _ in range(STEPS):
            xi = x.clone().requires_grad_(True)
            with te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):  # rec None: high precision
                out = module(xi)
            y = out[0] if isinstance(out, tuple) else out
            y.backward(dy)
            grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
            mains = {n: p.main_grad.clone() for n, p in module.named_parameters() if hasattr(p, "main_grad")}
            state = {k: v.clone() for k, v in module.fp8_state.state_dict().items()}
            seen.append(dict(y=y.detach().clone(), dx=xi.grad.clone(), grads=grads, mains=mains, state=state))
            with torch.no_grad():
                for p in module.parameters():
                    if p.grad is not None:
                        p.sub_(0.05 * p.grad.to(p.dtype))
                    p.grad = None
    return seen, len(calls)


def _assert_same(fused, unfused, exact_fc1_bias=False):
    for step, (a, b) in enumerate(zip(fused, unfused)):
        for key in ("y", "dx"):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=lambda m: f"step {step} {key}: {m}")
        for group in ("grads", "mains", "state"):
            assert a[group].keys() == b[group].keys()
            for name in a[group]:
                if name == "fc1_bias" and not exact_fc1_bias:  # another fp32 summation order (module doc)
                    torch.testing.assert_close(a[group][name], b[group][name], msg=lambda m: f"step {step} {name}: {m}")
                else:
                    torch.testing.assert_close(a[group][name], b[group][name], rtol=0, atol=0,
                                               msg=lambda m: f"step {step} {group} {name}: {m}")


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu", "srelu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_equals_unfused(activation, bias, dtype, device, monkeypatch):
    mlp = te.LayerNormMLP(64, 96, bias=bias, activation=activation, params_dtype=dtype, device=device)
    x = torch.randn(16, 3, 64, device=device, dtype=dtype)  # 48 tokens (FP8 GEMMs need multiples of 16)
    dy = torch.randn(16, 3, 64, device=device, dtype=dtype)
    twin = copy.deepcopy(mlp)
    fused, n_fused = _steps(mlp, x, dy, recipe.DelayedScaling(), True, monkeypatch)
    unfused, n_unfused = _steps(twin, x, dy, recipe.DelayedScaling(), False, monkeypatch)
    assert (n_fused, n_unfused) == (STEPS, 0)
    _assert_same(fused, unfused)


def test_fused_return_bias_and_wgrad_accumulation(device, monkeypatch):
    mlp = te.LayerNormMLP(64, 128, return_bias=True, fuse_wgrad_accumulation=True, device=device)
    twin = copy.deepcopy(mlp)
    for module in (mlp, twin):
        for name in ("fc1_weight", "fc2_weight"):
            p = getattr(module, name)
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    x, dy = torch.randn(16, 2, 64, device=device), torch.randn(16, 2, 64, device=device)
    fused, n = _steps(mlp, x, dy, recipe.DelayedScaling(), True, monkeypatch)
    unfused, _ = _steps(twin, x, dy, recipe.DelayedScaling(), False, monkeypatch)
    assert n == STEPS and fused[0]["mains"]["fc1_weight"].abs().sum() > 0
    _assert_same(fused, unfused)


def test_frozen_fc1_and_input(device, monkeypatch):
    """Only fc2 trains: the fused backward skips fc1's GEMMs and casts entirely."""
    mlp = te.LayerNormMLP(64, 96, device=device)
    for name in ("fc1_weight", "fc1_bias", "layer_norm_weight", "layer_norm_bias"):
        getattr(mlp, name).requires_grad_(False)
    x = torch.randn(16, 64, device=device)
    with te.fp8_autocast():
        y = mlp(x)
    y.sum().backward()
    assert mlp.fc2_weight.grad is not None and mlp.fc1_weight.grad is None


@pytest.mark.parametrize("rec", [recipe.Float8CurrentScaling(), recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID),
                                 None], ids=["current", "hybrid", "bf16"])
def test_which_recipes_cast_in_the_activation(rec, device, monkeypatch):
    """Every recipe runs the one Function. Under delayed scaling (scales known before the pass) the
    activation kernels cast to FP8 in their one pass; current scaling needs the amax first: two passes
    of the kernel (amax, then FP8) where it runs, else fc2 casts act(h) itself."""
    mlp = te.LayerNormMLP(64, 96, device=device)
    x = torch.randn(16, 64, device=device)
    dy = torch.randn(16, 64, device=device)
    casts, two_pass = [], []
    real, real_current = mlp_ops.GemmFP8.cast_activation, mlp_ops.GemmFP8.cast_activation_current
    with monkeypatch.context() as mp:
        mp.setattr(mlp_ops.GemmFP8, "cast_activation", lambda self, *a, **k: casts.append(1) or real(self, *a, **k))
        mp.setattr(mlp_ops.GemmFP8, "cast_activation_current",
                   lambda self, *a, **k: two_pass.append(1) or real_current(self, *a, **k))
        _, n = _steps(mlp, x, dy, rec, True, monkeypatch)
    assert n == STEPS and len(casts) == (STEPS if rec is not None and rec.delayed() else 0)
    # current scaling with the kernels (CUDA): the activation's amax pass, then its FP8 pass
    current_with_kernels = rec is not None and not rec.delayed() and native_act.usable("gelu", x)
    assert len(two_pass) == (STEPS if current_with_kernels else 0)


@pytest.mark.parametrize("rec", [recipe.Float8CurrentScaling(), None], ids=["current", "bf16"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_one_function_equals_unfused_without_fp8_activation(rec, activation, bias, device, monkeypatch):
    """Without the FP8 activation the one Function computes exactly what the separate Functions do,
    fc1's bias gradient included."""
    mlp = te.LayerNormMLP(64, 96, bias=bias, activation=activation, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 3, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn(16, 3, 64, device=device, dtype=torch.bfloat16)
    twin = copy.deepcopy(mlp)
    fused, n_fused = _steps(mlp, x, dy, rec, True, monkeypatch)
    unfused, n_unfused = _steps(twin, x, dy, rec, False, monkeypatch)
    assert (n_fused, n_unfused) == (STEPS, 0)
    _assert_same(fused, unfused, exact_fc1_bias=True)


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling(), None],
                         ids=["delayed", "current", "bf16"])
def test_backward_twice_with_retain_graph(rec, device):
    """Saved operands are freed (or overwritten: h becomes the activation's gradient) only when the graph
    is not kept: retain_graph=True still allows a second backward (under delayed scaling its gradient
    cast uses the scales the first backward updated: close, not equal)."""
    mlp = te.LayerNormMLP(64, 96, device=device)
    x = torch.randn(16, 2, 64, device=device, requires_grad=True)
    dy = torch.randn(16, 2, 64, device=device)
    with te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
        y = mlp(x)
    y.backward(dy, retain_graph=True)
    first = [t.grad.clone() for t in (x, mlp.fc1_weight, mlp.fc2_weight)]
    for t in (x, mlp.fc1_weight, mlp.fc2_weight):
        t.grad = None
    y.backward(dy)
    for a, b in zip(first, (x.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad)):
        if rec is None or not rec.delayed():  # nothing moved between the two backwards
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        else:
            torch.testing.assert_close(b, a, rtol=0.15, atol=0.15 * a.abs().max().item())


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling(), None],
                         ids=["delayed", "current", "bf16"])
@pytest.mark.parametrize("chunk_rows", [16, 32], ids=["even", "ragged"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_backward_in_row_chunks_equals_unfused(chunk_rows, activation, rec, device, monkeypatch):
    """fc2's dgrad output made and consumed a row chunk at a time (48 tokens: 3 chunks of 16, or 32 + 16)
    gives the unfused gradients; the chunks really ran."""
    mlp = te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16, device=device,
                          bwd_chunk_bytes=chunk_rows * 96 * 2)  # fc2's input is 96 wide, bf16
    x = torch.randn(16, 3, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn(16, 3, 64, device=device, dtype=torch.bfloat16)
    twin = copy.deepcopy(mlp)
    chunks = []
    fp8_act = rec is not None and rec.delayed()
    with monkeypatch.context() as mp:
        if fp8_act:
            real = mlp_ops.GemmFP8.cast_dactivation_rows
            mp.setattr(mlp_ops.GemmFP8, "cast_dactivation_rows",
                       lambda self, name, da, h, *a: chunks.append(da.shape[0]) or real(self, name, da, h, *a))
        else:
            real = mlp_ops._dact_into
            mp.setattr(mlp_ops, "_dact_into", lambda name, da, h, out: chunks.append(da.shape[0]) or real(name, da, h, out))
        fused, _ = _steps(mlp, x, dy, rec, True, monkeypatch)
    assert chunks == STEPS * ([16, 16, 16] if chunk_rows == 16 else [32, 16])
    unfused, _ = _steps(twin, x, dy, rec, False, monkeypatch)
    _assert_same(fused, unfused, exact_fc1_bias=not fp8_act)


@pytest.mark.parametrize("microbatch", [None, True], ids=["training", "microbatches"])
def test_fp8_weights_freed_after_forward(microbatch, device, monkeypatch):
    """In a training step the FP8 weights live only through the forward (backward re-encodes Wᵀ);
    with TE's micro-batch flag the module keeps them for the next micro-batch."""
    import weakref

    from te_parallel.ops import fp8_gemm_config

    mlp = te.LayerNormMLP(64, 96, device=device)
    made = []
    real = fp8_gemm_config.GemmFP8.quantize_weight
    monkeypatch.setattr(fp8_gemm_config.GemmFP8, "quantize_weight",
                        lambda self, w, g=None: (lambda q: made.append(weakref.ref(q.data)) or q)(real(self, w, g)))
    x = torch.randn(16, 2, 64, device=device, requires_grad=True)
    with te.fp8_autocast():
        y = mlp(x, is_first_microbatch=microbatch)
    alive = [r() is not None for r in made]
    assert len(made) == 2 and alive == [microbatch is not None] * 2
    y.sum().backward()
    assert mlp.fc1_weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("retain", [False, True], ids=["freed", "retain_graph"])
@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_dgrad_operands_freed_before_wgrad(kind, rec, retain, device, monkeypatch):
    """When wgrad allocates dW, the backward's Wᵀ and the row-major FP8 output gradient of the dgrad
    before it are gone (wgrad reads only the transposed copy); with retain_graph=True nothing is
    dropped. The gradients are those of the same step without the release."""
    import weakref

    from te_parallel.ops import linear as linear_ops

    def make():
        torch.manual_seed(0)
        return (te.Linear(64, 96, device=device) if kind == "Linear"
                else te.LayerNormMLP(64, 96, activation="swiglu", device=device))

    x = torch.randn(16, 2, 64, device=device)
    dy = torch.randn(16, 2, 64 if kind == "LayerNormMLP" else 96, device=device)

    def step(module):
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=rec):
            y = module(xi)
        y.backward(dy, retain_graph=retain)
        return [xi.grad] + [p.grad for p in module.parameters()]

    dgrads, seen = [], []
    real_dgrad, real_wgrad = linear_ops._dgrad, linear_ops._wgrad

    def dgrad(dy_, w, *a):
        dgrads.append((weakref.ref(dy_.data), weakref.ref(w.data_t)))
        return real_dgrad(dy_, w, *a)

    def wgrad(dy_, *a):
        if dgrads:
            seen.append([r() is not None for r in dgrads.pop()])
            assert dy_.data_t is not None and dy_.data.shape == dy_.data_t.shape[::-1]
        return real_wgrad(dy_, *a)

    plain = step(make())
    with monkeypatch.context() as mp:
        mp.setattr(linear_ops, "_dgrad", dgrad)
        mp.setattr(linear_ops, "_wgrad", wgrad)
        released = step(make())
    assert len(seen) == (1 if kind == "Linear" else 2)
    assert seen == [[retain, retain]] * len(seen)
    for a, b in zip(released, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("retain", [False, True], ids=["freed", "retain_graph"])
@pytest.mark.parametrize("chunk_rows", [16, 32], ids=["even", "ragged"])
def test_fp8_gradient_written_over_h(chunk_rows, retain, device, monkeypatch):
    """Under the FP8 activation with row chunks, fc1's FP8 output gradient is written into h's memory (h's
    rows are spent by then) instead of a new allocation while h is live; its transposed copy is made
    after fc1's dgrad, and the row-major bytes (h's memory) are gone when wgrad runs. With
    retain_graph=True h is kept intact and the gradient gets its own memory. Gradients as unfused."""
    from te_parallel.ops import linear as linear_ops

    mlp = te.LayerNormMLP(64, 96, activation="swiglu", params_dtype=torch.bfloat16, device=device,
                          bwd_chunk_bytes=chunk_rows * 96 * 2)
    twin = copy.deepcopy(mlp)
    x = torch.randn(16, 3, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn(16, 3, 64, device=device, dtype=torch.bfloat16)
    h_ptrs, g_ptrs, at_wgrad = [], [], []
    real_init, real_bwd, real_wgrad = mlp_ops._ActivationGradRows.__init__, mlp_ops.linear_bwd, linear_ops._wgrad

    def init(self, ctx, *a, **k):
        h_ptrs.append((ctx.h.data_ptr(), ctx.h.data_ptr() + ctx.h.numel() * ctx.h.element_size()))
        real_init(self, ctx, *a, **k)

    def bwd(s, g, *a, dy_q=None, **k):
        if dy_q is not None:
            g_ptrs.append(dy_q.data.data_ptr())
        return real_bwd(s, g, *a, dy_q=dy_q, **k)

    def wgrad(dy_, *a):
        if g_ptrs and not at_wgrad:  # fc1's wgrad (fc2's ran before the chunks): its operand outside h
            lo, hi = h_ptrs[0]
            at_wgrad.append(all(not lo <= t.data_ptr() < hi for t in (dy_.data, dy_.data_t)))
        return real_wgrad(dy_, *a)

    rec = recipe.DelayedScaling()
    with monkeypatch.context() as mp:
        mp.setattr(mlp_ops._ActivationGradRows, "__init__", init)
        mp.setattr(mlp_ops, "linear_bwd", bwd)
        mp.setattr(linear_ops, "_wgrad", wgrad)
        mp.setattr(layernorm_mlp, "norm_to_fp8", lambda *args: None)
        xi = x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=rec):
            y = mlp(xi)
        y.backward(dy, retain_graph=retain)
    assert (g_ptrs == [h_ptrs[0][0]]) == (not retain) and len(g_ptrs) == 1
    assert at_wgrad == [True]  # wgrad reads no byte of h's memory (its transposed copy has its own)
    xt = x.clone().requires_grad_(True)
    with monkeypatch.context() as mp:
        mp.setattr(layernorm_mlp, "norm_to_fp8", lambda *args: None)
        mp.setattr(layernorm_mlp, "can_fuse", lambda *args: False)
        with te.fp8_autocast(fp8_recipe=rec):
            yt = twin(xt)
        yt.backward(dy)
    torch.testing.assert_close(xi.grad, xt.grad, rtol=0, atol=0)
    for (name, p), q in zip(mlp.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
