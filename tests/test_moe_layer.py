"""te_parallel.MoELayer on one process against an fp64 reference built from the same weights: a loop over the
tokens, each through its top-k experts (outputs, and the gradients of the input, the router and every expert
weight), softmax / sigmoid / group-limited routing, the load-balancing loss's value and gradient, experts that
get no tokens, the per-expert padding under FP8 recipes, TransformerLayer(moe=...), bad arguments, and the
trainer's --experts / --topk (a tiny CPU run, and its one-line mistakes)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.moe import ExpertRows, LayerNormMoE, MoEConfig, MoELayer, moe_aux_loss, pad_rows, unpad_rows

ROOT = Path(__file__).resolve().parents[1]
H, FFN = 32, 48


# --- the fp64 reference ---------------------------------------------------------------------------------
def full_weights(m: MoELayer):
    """(router [E, h], fc1 [E, 2F, h], fc2 [E, h, F]) of a one-process layer, as fp64 leaves; with a shared
    expert, its fc1 and fc2 appended to fc1 and fc2 as expert E."""
    experts = [m.experts] * m.num_local_experts + ([m.shared_experts] if m.shared_experts is not None else [])
    index = list(range(m.num_local_experts)) + [0]
    fc1 = [getattr(mlp.linear_fc1, f"weight{g}") for mlp, g in zip(experts, index)]
    fc2 = [getattr(mlp.linear_fc2, f"weight{g}") for mlp, g in zip(experts, index)]
    leaf = lambda w: w.detach().double().clone().requires_grad_()  # noqa: E731
    return leaf(m.router.weight), [leaf(w) for w in fc1], [leaf(w) for w in fc2]


def swiglu_mlp(x, w1, w2):
    h = w1 @ x
    half = h.shape[0] // 2
    return w2 @ (F.silu(h[:half]) * h[half:])


def score(logits, fn):
    return {"softmax": lambda v: torch.softmax(v, -1), "sigmoid": torch.sigmoid,
            "sqrtsoftplus": lambda v: F.softplus(v).sqrt()}[fn](logits)


def choose(logits, m: MoELayer):
    """(expert indices, their weights) of one token, as the router's documentation states."""
    r, k = m.router, m.topk
    if r.score_function == "softmax" and not r.use_pre_softmax:
        idx = logits.detach().topk(k).indices
        return idx, torch.softmax(logits[idx], 0) * (r.scaling_factor or 1.0)
    scores = score(logits, r.score_function)
    select = scores.detach() + (0 if r.expert_bias is None else r.expert_bias.double())
    if r.group_topk:
        groups = select.view(r.num_groups, -1)
        best = groups.topk(k // r.group_topk, dim=1).values.sum(1).topk(r.group_topk).indices
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep[best] = True
        select = select.masked_fill(~keep.view(-1), float("-inf"))
    idx = select.topk(k).indices
    p = scores[idx]
    if r.score_function != "softmax" and k > 1:
        p = p / (p.sum() + 1e-20)
    return idx, p * (r.scaling_factor or 1.0)


def reference(x, router, fc1, fc2, m: MoELayer):
    """(y [T, h], aux loss) in fp64, token by token."""
    x = x.reshape(-1, x.shape[-1])
    rows = []
    for t in range(x.shape[0]):
        idx, p = choose(router @ x[t], m)
        out = torch.zeros_like(x[t])
        for e, w in zip(idx.tolist(), p):
            out = out + w * swiglu_mlp(x[t], fc1[e], fc2[e])
        if m.shared_experts is not None:
            out = out + swiglu_mlp(x[t], fc1[-1], fc2[-1])
        rows.append(out)
    y = torch.stack(rows)
    aux = None
    if m.router.aux_loss_coeff:
        logits = x @ router.t()
        scores = score(logits, m.router.score_function)
        if m.router.score_function != "softmax":
            scores = scores / scores.sum(1, keepdim=True)
        counts = torch.zeros(m.num_experts, dtype=torch.float64)
        for t in range(x.shape[0]):
            counts[scores[t].detach().topk(m.topk).indices] += 1
        T, E = x.shape[0], m.num_experts
        aux = m.router.aux_loss_coeff * E / (m.topk * T * T) * (counts * scores.sum(0)).sum()
    return y, aux


def assert_close(got, want, what, tol=2e-5):
    want = torch.zeros_like(got, dtype=torch.float64) if want is None else want  # (an expert no token chose)
    got = torch.zeros_like(want) if got is None else got
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs max {scale:.3g}"


ROUTINGS = {
    "softmax": dict(),
    "softmax-pre-scaled": dict(use_pre_softmax=True, scaling_factor=2.0),
    "sigmoid-bias-groups": dict(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2),
    "sqrtsoftplus": dict(score_function="sqrtsoftplus", topk=3),
    "softmax-shared-expert": dict(shared_expert_ffn_hidden_size=64),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_matches_the_token_loop(name):
    kw = dict(ROUTINGS[name])
    topk = kw.pop("topk", 2)
    torch.manual_seed(1)
    m = MoELayer(H, FFN, 8, topk, aux_loss_coeff=0.05, device="cpu", **kw)
    if m.router.expert_bias is not None:
        m.router.expert_bias.copy_(torch.randn(8) * 0.05)
    x = torch.randn(5, 3, H, requires_grad=True)
    grad = torch.randn(5, 3, H)
    y = m(x)
    ((y * grad).sum() + m.aux_loss).backward()
    router, fc1, fc2 = full_weights(m)
    x64 = x.detach().double().requires_grad_()
    y_ref, aux_ref = reference(x64, router, fc1, fc2, m)
    ((y_ref * grad.double().view(-1, H)).sum() + aux_ref).backward()
    assert_close(y.detach().view(-1, H), y_ref.detach(), "output")
    assert_close(m.aux_loss.detach(), aux_ref.detach(), "aux loss")
    assert_close(x.grad, x64.grad, "input gradient")
    assert_close(m.router.weight.grad, router.grad, "router gradient")
    for g in range(8):
        assert_close(getattr(m.experts.linear_fc1, f"weight{g}").grad, fc1[g].grad, f"fc1 gradient of expert {g}")
        assert_close(getattr(m.experts.linear_fc2, f"weight{g}").grad, fc2[g].grad, f"fc2 gradient of expert {g}")
    if m.shared_experts is not None:
        assert_close(m.shared_experts.linear_fc1.weight0.grad, fc1[8].grad, "shared expert's fc1 gradient")
        assert_close(m.shared_experts.linear_fc2.weight0.grad, fc2[8].grad, "shared expert's fc2 gradient")


def test_aux_loss_alone_and_its_gradient():
    """The load-balancing loss: its value and its gradient to the router weight, with no other loss."""
    torch.manual_seed(2)
    m = MoELayer(H, FFN, 4, 2, aux_loss_coeff=0.1, device="cpu")
    x = torch.randn(16, H)
    m(x)
    m.aux_loss.backward()
    router, fc1, fc2 = full_weights(m)
    _, aux_ref = reference(x.double(), router, fc1, fc2, m)
    aux_ref.backward()
    assert_close(m.aux_loss.detach(), aux_ref.detach(), "aux loss")
    assert_close(m.router.weight.grad, router.grad, "router gradient of the aux loss")
    other = MoELayer(H, FFN, 4, 1, aux_loss_coeff=0.2, device="cpu")
    other(x)
    quiet = MoELayer(H, FFN, 4, 2, device="cpu")
    quiet(x)
    assert quiet.aux_loss is None and moe_aux_loss(quiet) is None
    assert torch.equal(moe_aux_loss(torch.nn.Sequential(m, other, quiet)), m.aux_loss + other.aux_loss)


def test_experts_without_tokens():
    """2 tokens, top-1 of 8 experts: at least 6 experts get no rows; their weights get zero gradients."""
    torch.manual_seed(3)
    m = MoELayer(H, FFN, 8, 1, device="cpu")
    x = torch.randn(2, H, requires_grad=True)
    y = m(x)
    y.sum().backward()
    router, fc1, fc2 = full_weights(m)
    x64 = x.detach().double().requires_grad_()
    y_ref, _ = reference(x64, router, fc1, fc2, m)
    y_ref.sum().backward()
    assert_close(y.detach(), y_ref.detach(), "output")
    assert_close(x.grad, x64.grad, "input gradient")
    idle = [g for g in range(8) if fc1[g].grad is None or not fc1[g].grad.any()]
    assert len(idle) >= 6
    for g in idle:
        w = getattr(m.experts.linear_fc1, f"weight{g}")
        assert w.grad is None or not w.grad.any(), f"expert {g} got a gradient without tokens"


# --- FP8: each expert's rows padded ----------------------------------------------------------------------
@pytest.mark.parametrize("on_host", [True, False])
def test_pad_rows_layout(on_host):
    counts = [3, 0, 130, 5]
    x = torch.randn(sum(counts), 4, requires_grad=True)
    rows = ExpertRows(torch.tensor(counts), tuple(counts) if on_host else None, sum(counts))
    padded, splits, index = pad_rows(x, rows, 128)
    sizes = splits.tolist()
    assert all(s % 128 == 0 for s in sizes) and sum(sizes) == padded.shape[0]
    if on_host:
        assert sizes == [128, 0, 256, 128]
    else:  # the bound: (138 + 4·127) // 128 · 128 = 640, the spare rows on the last expert
        assert sizes == [128, 0, 256, 256] and padded.shape[0] == 640
    start, pstart = 0, 0
    for c, s in zip(counts, sizes):
        assert torch.equal(padded[pstart:pstart + c], x[start:start + c])
        assert not padded[pstart + c:pstart + s].any()
        start, pstart = start + c, pstart + s
    back = unpad_rows(padded * 2, index)
    assert torch.equal(back, 2 * x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    aligned = ExpertRows(torch.tensor([16, 32]), (16, 32), 48)
    same, _, none = pad_rows(torch.randn(48, 4), aligned, 16)
    assert none is None and same.shape[0] == 48


@pytest.mark.parametrize("recipe_name, align", [("block", 128), ("current", 16), ("delayed", 16)])
def test_fp8_pads_each_expert(recipe_name, align):
    """Under FP8 the grouped GEMMs see each expert's rows padded to the recipe's alignment (128 for block
    scaling's 1x128 wgrad tiles, 16 per-tensor), and the layer stays within FP8 error of the fp64 reference
    (relative Frobenius error under 15%: E4M3 operands, E5M2 gradients under HYBRID)."""
    recipes = {"block": R.Float8BlockScaling, "current": R.Float8CurrentScaling, "delayed": R.DelayedScaling}
    torch.manual_seed(4)
    m = MoELayer(H, FFN, 4, 2, device="cpu")
    seen = []
    hook = m.experts.linear_fc1.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
    x = torch.randn(40, H, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipes[recipe_name]()):
        y = m(x)
    y.sum().backward()
    hook.remove()
    splits = seen[0].tolist() if torch.is_tensor(seen[0]) else seen[0]
    assert all(s % align == 0 for s in splits), splits
    router, fc1, fc2 = full_weights(m)
    x64 = x.detach().double().requires_grad_()
    y_ref, _ = reference(x64, router, fc1, fc2, m)
    y_ref.sum().backward()
    for got, want, what in ((y.detach(), y_ref.detach(), "output"), (x.grad, x64.grad, "input gradient"),
                            (m.experts.linear_fc1.weight0.grad, fc1[0].grad, "fc1 gradient")):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 0.15, f"{recipe_name} {what}: relative error {rel:.3g}"  # (measured: 5-9%)


@pytest.mark.parametrize("recipe_name", ["block", "current"])
def test_fp8_exact_and_bounded_padding_agree(recipe_name):
    """The two padded layouts (counts on the host: exact; on the device: a fixed bound, spare zero rows on the
    last expert) give the same experts' outputs and gradients bit for bit: zero rows change no tile's or
    tensor's scale and add nothing to any sum."""
    make = {"block": R.Float8BlockScaling, "current": R.Float8CurrentScaling}[recipe_name]
    torch.manual_seed(7)
    m = MoELayer(H, FFN, 4, 2, device="cpu")
    counts = [7, 0, 140, 21]
    x = torch.randn(sum(counts), H)
    results = []
    for host in (tuple(counts), None):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=make()):
            y = m.experts(xi, ExpertRows(torch.tensor(counts), host, sum(counts)))
        y.backward(torch.ones_like(y))
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in m.experts.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU has no host/device boundary)")
@pytest.mark.parametrize("recipe_name", ["bf16", "block"])
def test_no_host_sync_without_expert_parallelism(recipe_name):
    """On CUDA a forward and backward without expert parallelism read nothing back (bf16 grouped GEMMs; the
    per-expert counts, the padded splits and the permutation stay on the device)."""
    if recipe_name == "block" and not te.is_fp8_block_scaling_available():
        pytest.skip("Float8BlockScaling needs a GPU of compute capability 9.0 and CUDA 12.9")
    torch.manual_seed(9)
    m = MoELayer(128, 256, 8, 2, aux_loss_coeff=0.01, shared_expert_ffn_hidden_size=128, device="cuda",
                 params_dtype=torch.bfloat16)
    x = torch.randn(64, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    def step():
        with te.fp8_autocast(enabled=recipe_name == "block", fp8_recipe=R.Float8BlockScaling()):
            y = m(x)
        (y.float().sum() + m.aux_loss).backward()

    step()  # (first calls: lazy initialisation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- the transformer layer ---------------------------------------------------------------------------------
def test_transformer_layer_with_moe():
    torch.manual_seed(5)
    cfg = MoEConfig(num_experts=4, topk=2, aux_loss_coeff=0.01)
    layer = te.TransformerLayer(H, FFN, 4, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                                activation="swiglu", bias=False, moe=cfg, device="cpu")
    assert isinstance(layer.layernorm_mlp, LayerNormMoE)
    x = torch.randn(6, 2, H, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and layer.aux_loss is not None
    (y.sum() + moe_aux_loss(layer)).backward()
    assert layer.layernorm_mlp.moe.router.weight.grad is not None and x.grad is not None
    # the MLP block is x + moe(norm(x))
    block = layer.layernorm_mlp
    h = torch.randn(6, 2, H)
    assert torch.allclose(block(h, residual=h), h + block.moe(block.layer_norm(h)))
    torch.manual_seed(8)  # reset_parameters draws as the constructor did
    built = te.TransformerLayer(H, FFN, 4, normalization="RMSNorm", activation="swiglu", bias=False, moe=cfg,
                                device="cpu")
    torch.manual_seed(8)
    layer.reset_parameters()
    for (name, p), q in zip(layer.named_parameters(), built.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="experts are SwiGLU MLPs"):
        te.TransformerLayer(H, FFN, 4, activation="gelu", moe=cfg, device="cpu")


def test_same_seed_same_weights_and_reset():
    torch.manual_seed(6)
    a = MoELayer(H, FFN, 4, 2, device="cpu")
    after_a = torch.randn(3)
    torch.manual_seed(6)
    b = MoELayer(H, FFN, 4, 2, device="cpu")
    assert torch.equal(torch.randn(3), after_a)
    torch.manual_seed(6)
    b.reset_parameters()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_expert_bias_update():
    m = MoELayer(H, FFN, 4, 1, score_function="sigmoid", expert_bias=True, device="cpu")
    m.router.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 2.0, 0.0]))
    m.router.update_expert_bias(0.01)
    assert torch.allclose(m.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))
    assert not m.router.tokens_per_expert.any()
    m(torch.randn(7, H))
    assert m.router.tokens_per_expert.sum() == 7


BAD = [
    (dict(topk=5), "topk=5 must be an int in [1, num_experts=4]"),
    (dict(score_function="relu"), "score_function must be one of"),
    (dict(expert_bias=True), "expert_bias=True needs score_function 'sigmoid'"),
    (dict(num_groups=3, group_topk=1), "num_groups=3 must be an int dividing num_experts=4"),
    (dict(num_groups=2), "takes both num_groups and group_topk"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff=-1.0 must be a number >= 0"),
    (dict(tp_size=5), "ffn_hidden_size=48 is not divisible by tp_size=5"),
    (dict(router_dtype=torch.float64), "router_dtype must be"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_arguments_are_one_line(kwargs, message):
    kw = dict(topk=2) | kwargs
    topk = kw.pop("topk")
    with pytest.raises(ValueError) as info:
        MoELayer(H, FFN, 4, topk, device="cpu", **kw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_input_is_one_line():
    m = MoELayer(H, FFN, 4, 2, device="cpu")
    with pytest.raises(ValueError, match=r"last dim must be 32"):
        m(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"hidden_states must be \[seq, batch, hidden\] or \[tokens, hidden\]"):
        m(torch.randn(2, 2, 2, H))
    with pytest.raises(TypeError, match="input must be float32"):
        m(torch.ones(3, H, dtype=torch.int64))


# --- the trainer -------------------------------------------------------------------------------------------
TINY = ["--steps", "3", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "2",
        "--eval-every", "3", "--eval-batches", "1", "--warmup", "1", "--corpus-bytes", "65536", "--device", "cpu",
        "--quiet", "--no-plot", "--fp8", "off"]


def _run(args, cwd, timeout=300):
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_trainer_with_experts(tmp_path):
    """--experts 4 --topk 2: 3 steps on 2 CPU processes (tp=2, sequence parallel); the loss holds the aux loss."""
    out = tmp_path / "o"
    result = _run(TINY + ["--experts", "4", "--topk", "2", "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train_gpt: MoE: experts=4 topk=2 per layer" in result.stdout.splitlines()[1], result.stdout
    log = json.loads((out / "log.json").read_text())
    assert len(log["log"]) == 3 and all(math.isfinite(r["loss"]) for r in log["log"])
    assert log["config"]["experts"] == 4 and log["config"]["topk"] == 2
    assert all(0 < r["aux_loss"] < 0.1 for r in log["log"])


def test_trainer_expert_parallel_matches_one_rank_experts(tmp_path):
    """--ep 2 over 2 data-parallel replicas (each holds 2 of the 4 experts) trains the same model as --ep 1
    (every replica holds all of them): the same losses, load-balancing losses and gradient norms."""
    logs = []
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}"
        result = _run(TINY + ["--experts", "4", "--nproc", "2", "--tp", "1", "--ep", str(ep), "--steps", "2",
                              "--eval-every", "2", "--out", str(out)],
                      tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        logs.append(json.loads((out / "log.json").read_text())["log"])
    for a, b in zip(*logs):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a[key], b[key])


MOE_MISTAKES = [
    (["--experts", "4", "--topk", "5"], 1, "--topk 5 must be between 1 and --experts 4"),
    (["--topk", "2"], 1, "--topk 2 is for MoE layers; add --experts N"),
    (["--ep", "2"], 2, "--ep 2 is for MoE layers; add --experts N"),
    (["--experts", "1"], 1, "--experts 1 must be at least 2"),
    (["--experts", "4", "--ep", "4"], 2, "--ep 4 must divide the 2 data-parallel replica(s)"),
    (["--experts", "6", "--ep", "4"], 4, "and --experts 6; use --ep 1"),
    (["--experts", "4", "--ep", "2", "--dp-engine", "ddp"], 2, "--ep 2 needs --dp-engine fsdp2"),
    (["--experts", "4", "--aux-loss-coeff", "-1"], 1, "--aux-loss-coeff -1.0 must be a number >= 0"),
]


@pytest.mark.parametrize("args, dp, needle", MOE_MISTAKES, ids=[m[2][:32] for m in MOE_MISTAKES])
def test_trainer_moe_mistakes(args, dp, needle):
    from te_parallel.examples.cli import CliError, build_parser
    from te_parallel.examples.train_gpt import check_moe

    with pytest.raises(CliError) as info:
        check_moe(build_parser("").parse_args(args), dp)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_trainer_moe_mistake_stops_before_any_process(tmp_path):
    result = _run(TINY + ["--experts", "4", "--topk", "5", "--out", str(tmp_path / "o")], tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("train_gpt.py: error: --topk 5 must be between 1 and --experts 4"), lines[-1]
    assert result.stdout == "" and not (tmp_path / "o").exists()
