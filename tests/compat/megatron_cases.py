"""Megatron-core's GPTModel with `get_gpt_layer_with_transformer_engine_spec()`, trained through the compat
package in spawned workers (gloo on the CPU); rank 0 writes each case's losses and checks to a file.
`train(name, tp, device=...)` also runs a case on a CUDA device (tests/gpu/test_compat_cuda.py): the model
is then built as Megatron builds it on a GPU (`use_cpu_initialization=False`, TE modules given
`device=torch.cuda.current_device()`) and moved there, as Megatron's `get_model` does.

Megatron's own code (not TE's) allocates with `torch.cuda.current_device()` in its RoPE, its sequence-
parallel mappings and its global memory buffer (docs/compat.md lists the places); `cpu_shim()` maps
that call to "cpu" in the worker, so those paths run on the CPU. Nothing of compat or te_parallel is
patched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CASES = {
    "rmsnorm-swiglu": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu),
    "layernorm-gelu": dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu),
    "bf16": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, bf16=True,
                 params_dtype=torch.bfloat16),
    "fp8-delayed": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, fp8="hybrid",
                        fp8_recipe="delayed", fp8_amax_history_len=8),
    "fp8-tensorwise": dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu, fp8="hybrid",
                           fp8_recipe="tensorwise"),
    "fp8-blockwise": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, fp8="e4m3",
                          fp8_recipe="blockwise"),
    "fp8-full-recompute": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, fp8="hybrid",
                               fp8_recipe="delayed", recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1),
    "qk-layernorm-cpu-offload": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                                     qk_layernorm=True, cpu_offloading=True, cpu_offloading_num_layers=1),
}
SEQ, BATCH, VOCAB, STEPS = 32, 2, 128, 4


def cpu_shim() -> None:
    torch.cuda.current_device = lambda: "cpu"


def _model(name: str, tp: int, device="cpu"):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    case = dict(CASES[name])
    qk_layernorm = case.pop("qk_layernorm", False)
    case.setdefault("params_dtype", torch.float32)
    on_cpu = torch.device(device).type == "cpu"
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                            use_cpu_initialization=on_cpu, tensor_model_parallel_size=tp,
                            sequence_parallel=tp > 1, hidden_dropout=0.0, attention_dropout=0.0,
                            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False, **case)
    torch.manual_seed(1234)  # the same full weights at every TP size (Megatron's CPU init splits a master weight)
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    return model if on_cpu else model.to(device)


def _batch():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal = torch.ones(1, 1, SEQ, SEQ).tril() < 0.5  # Megatron's mask (True = masked); TE ignores it for "causal"
    return tokens, pos, causal, torch.roll(tokens, -1, 1)


def _fp8_modules(model):
    return [m for m in model.modules() if "fp8_state" in m._modules]


def train(name: str, tp: int, device="cpu") -> dict:
    """STEPS steps through Megatron's own gradient path: its DistributedDataParallel (gradients in
    main_grad buffers) and finalize_model_grads (which sums the sequence-parallel partial gradients
    TE leaves marked); then torch's Adam (Megatron's optimizer wrappers allocate on CUDA).
    device: where the model and batch live ("cpu": the CPU suite, with cpu_shim() in the worker)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    gpt = _model(name, tp, device)
    model = DistributedDataParallel(config=gpt.config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens, pos, mask, labels = (t.to(device) for t in _batch())
    losses, grad_norms = [], []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([model])
        for p in model.parameters():
            p.grad = p.main_grad
        grad_norms.append(_grad_norm(model))
        opt.step()
        losses.append(loss.item())
    fp8 = _fp8_modules(gpt)
    return {"losses": losses, "grad_norms": grad_norms, "fp8_modules": len(fp8),
            "fwd_updates": [m.fp8_state.updates()[0] for m in fp8],
            "checkpoint": _checkpoint_round_trip(gpt, name, tp, device), "split": _split_fused_norm_linear(gpt, tp)}


def _grad_norm(model) -> float:
    """The gradient norm as Megatron counts it: a parameter marked tensor_model_parallel (TE's
    attribute) on every TP rank, an unmarked one (whole on every rank) once."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = sum(p.grad.float().square().sum() for p in model.parameters() if param_is_not_tensor_parallel_duplicate(p))
    sq = torch.as_tensor(sq, dtype=torch.float64).reshape(1)
    torch.distributed.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
    return sq.sqrt().item()


def _split_fused_norm_linear(model, tp: int) -> str:
    """Megatron's split_te_layernorm_column_parallel_linear (it reads TE's module attributes: eps, use_bias,
    ub_name, tp_size, fp8_meta, ...) gives a TENorm + TEColumnParallelLinear computing what the fused
    module computes; returns "" or the difference."""
    from megatron.core.extensions.transformer_engine import split_te_layernorm_column_parallel_linear

    fused = model.decoder.layers[0].mlp.linear_fc1
    norm, linear = split_te_layernorm_column_parallel_linear(fused, fused.config, tp_group=fused._tp_group)
    x = torch.randn(SEQ // tp, BATCH, 64, generator=torch.Generator().manual_seed(1))
    x = x.to(device=fused.weight.device, dtype=fused.weight.dtype)
    with torch.no_grad():
        want, got = fused(x)[0], linear(norm(x))[0]
    err = ((want - got).norm() / want.norm()).item()
    return "" if err < 1e-2 else f"split module differs from the fused one: relative error {err:.3g}"


def _checkpoint_round_trip(model, name: str, tp: int, device="cpu") -> str:
    """The model's state dict (TE's layout: `_extra_state` per TE module) loads strictly into a fresh
    model, FP8 state included; returns "" or what differs."""
    sd = model.state_dict()
    extra = [k for k in sd if k.endswith("._extra_state")]
    if not extra or any("fp8_state" in k for k in sd):
        return f"not TE's layout: {len(extra)} _extra_state keys"
    fresh = _model(name, tp, device)
    fresh.load_state_dict(sd, strict=True)
    for a, b in zip(_fp8_modules(model), _fp8_modules(fresh)):
        for key in ("fwd_scale", "fwd_amax_history", "bwd_scale", "bwd_amax_history"):
            if not torch.equal(getattr(a.fp8_state, key), getattr(b.fp8_state, key)):
                return f"{key} differs after the round trip"
    return ""


def worker(rank: int, world: int, device, out_path: str, names) -> None:
    cpu_shim()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234, te_rng_tracker=True)  # TE's tracker (te_parallel's) runs on the CPU
    try:
        results = {name: train(name, world) for name in names}
    finally:
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out_path)
