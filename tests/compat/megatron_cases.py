"""Megatron-core's GPTModel with `get_gpt_layer_with_transformer_engine_spec()`, trained through the compat
package in spawned workers (gloo on the CPU); rank 0 writes each case's losses and checks to a file.
`train(name, tp, device=...)` also runs a case on a CUDA device (tests/gpu/test_compat_cuda.py): the model
is then built as Megatron builds it on a GPU (`use_cpu_initialization=False`, TE modules given
`device=torch.cuda.current_device()`) and moved there, as Megatron's `get_model` does.

MOE_CASES are Mixture-of-Experts GPTs (TE's GroupedLinear experts, the alltoall dispatcher with TE's fused
permutation, TE's fused router and aux loss); `moe_worker` runs them at several (TP, EP) layouts in one launch.
CP_CASES run at Megatron's context_parallel_size 2 and 1 (`cp_worker`, one launch): the batch cut as Megatron's
get_batch_on_this_cp_rank cuts it, TE's DotProductAttention given Megatron's cp_group, cp_global_ranks, cp_stream
and cp_comm_type.

Megatron's own code (not TE's) allocates with `torch.cuda.current_device()` in its RoPE, its sequence-
parallel mappings and its global memory buffer, and its MoE token dispatcher makes CUDA index tensors,
streams and events (docs/compat.md lists the places); `cpu_shim()` maps those to the CPU in the worker, so
those paths run there (`_context_parallel_on_cpu()` likewise for the CUDA stream Megatron makes for TE's
attention under context parallelism and the CUDA index of its RoPE's per-rank rows). Nothing of compat or
te_parallel is patched.
"""
from __future__ import annotations

import contextlib
import types
from collections import Counter

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
# The MoE settings under test: 4 experts of TE's GroupedLinear, top-2 routing, the alltoall dispatcher with TE's
# fused permutation, TE's fused router and load-balancing loss. No biases (Megatron's usual MoE setting).
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=True,
           moe_permute_fusion=True, moe_router_fusion=True, moe_token_dispatcher_type="alltoall",
           moe_aux_loss_coeff=1e-2, add_bias_linear=False)
MOE_CASES = {
    "moe": dict(CASES["rmsnorm-swiglu"], **MOE),
    "moe-bf16": dict(CASES["bf16"], **MOE),
    "moe-fp8-delayed": dict(CASES["fp8-delayed"], **MOE),
    "moe-fp8-tensorwise": dict(CASES["fp8-tensorwise"], **MOE),
    "moe-fp8-blockwise": dict(CASES["fp8-blockwise"], **MOE),
    # Megatron pads each expert's routed tokens to its FP8 alignment in the router (moe_router_padding_for_fp8)
    "moe-fp8-router-padding": dict(CASES["fp8-delayed"], **MOE, moe_router_padding_for_fp8=True),
}
# TE's functions Megatron's MoE calls with moe_permute_fusion / moe_router_fusion (and its router's GEMM),
# as megatron.core.transformer.moe.moe_utils names them
TE_MOE_CALLS = ("fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                "fused_unpermute", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
                "fused_moe_aux_loss", "te_general_gemm")
SEQ, BATCH, VOCAB, STEPS = 32, 2, 128, 4
EXPERT_STD = 0.02  # the experts' full weights (_place_expert_weights)


def cpu_shim() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # TEGroupedLinear's _encode_extra_state (nothing to wait for)
    _moe_dispatcher_on_cpu()


def _moe_dispatcher_on_cpu() -> None:
    """Megatron's alltoall dispatcher keeps its chunk-sort indices on torch.device("cuda") (with
    moe_permute_fusion) and moves its split sizes to the host on a CUDA side stream, synchronised by an
    event, as numpy arrays for the all-to-all (maybe_move_tensor_to_cpu, which leaves CPU tensors as they
    are). The dispatcher module is given a `torch` whose "cuda" device is the CPU and whose streams and events
    do nothing, and a maybe_move_tensor_to_cpu that makes the numpy arrays of CPU tensors too."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    class Event:
        def synchronize(self) -> None:
            pass

    class Stream:
        def wait_stream(self, other) -> None:
            pass

        def record_event(self) -> Event:
            return Event()

    current = Stream()
    cpu_torch = types.ModuleType("torch")
    cpu_torch.__getattr__ = lambda name: getattr(torch, name)
    cpu_torch.device = lambda kind, *args: torch.device("cpu" if str(kind).startswith("cuda") else kind, *args)
    cpu_torch.cuda = types.SimpleNamespace(Stream=lambda *a, **k: Stream(), current_stream=lambda *a: current,
                                           stream=lambda s: contextlib.nullcontext())
    token_dispatcher.torch = cpu_torch
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _case(name: str) -> dict:
    return dict(CASES[name] if name in CASES else MOE_CASES[name] if name in MOE_CASES else CP_CASES[name])


def _model(name: str, tp: int, device="cpu", ep: int = 1, cp: int = 1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    case = _case(name)
    qk_layernorm = case.pop("qk_layernorm", False)
    case.setdefault("params_dtype", torch.float32)
    on_cpu = torch.device(device).type == "cpu"
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                            use_cpu_initialization=on_cpu, tensor_model_parallel_size=tp,
                            expert_model_parallel_size=ep, context_parallel_size=cp, sequence_parallel=tp > 1,
                            hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
                            persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, **case)
    torch.manual_seed(1234)  # the same full weights at every TP size (Megatron's CPU init splits a master weight)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=case.get("num_moe_experts"),
                                                      moe_grouped_gemm=case.get("moe_grouped_gemm", False),
                                                      qk_layernorm=qk_layernorm)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    return model if on_cpu else model.to(device)


def _place_expert_weights(model) -> None:
    """Give every expert its full weights, the same at every (TP, EP) layout, and keep this rank's part.

    Megatron's CPU initialisation splits a master weight for its dense layers only: TE's GroupedLinear draws
    each local expert's local shard from the expert-parallel RNG stream, which differs per EP and TP rank.
    Expert g of each layer has fc1 [ffn·(2 with a GLU), h] and fc2 [h, ffn] drawn from its own seed. An EP rank
    holds experts ep_rank·n .. ep_rank·n + n-1; an expert-TP rank r of t holds rows r/t of fc1 (of the gate
    and of the up half separately under a GLU: Megatron's SwiGLU shard is [gate_r; up_r]) and columns r/t of
    fc2."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    glu = model.config.gated_linear_unit
    with torch.no_grad():
        for number, layer in enumerate(model.decoder.layers):
            experts = layer.mlp.experts
            for which, fc in enumerate((experts.linear_fc1, experts.linear_fc2)):
                for i in range(fc.num_gemms):
                    g = ep_rank * fc.num_gemms + i
                    local = getattr(fc, f"weight{i}")
                    rows, cols = local.shape
                    shape = (rows * tp, cols) if which == 0 else (rows, cols * tp)  # fc1 column-, fc2 row-parallel
                    gen = torch.Generator().manual_seed(1000 * number + 100 * which + g)
                    full = torch.randn(shape, generator=gen, dtype=torch.float64) * EXPERT_STD
                    if which == 1:  # row-parallel: columns r/t
                        part = full.chunk(tp, dim=1)[r]
                    elif glu:  # column-parallel GLU: [gate_r; up_r]
                        gate, up = full.chunk(2, dim=0)
                        part = torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]])
                    else:
                        part = full.chunk(tp, dim=0)[r]
                    local.copy_(part)


@contextlib.contextmanager
def _count_te_moe_calls(counts: Counter):
    """Count the calls Megatron's MoE makes to TE's functions (pass-through wrappers on moe_utils' names)."""
    from megatron.core.transformer.moe import moe_utils

    real = {name: getattr(moe_utils, name) for name in TE_MOE_CALLS}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(moe_utils, name, counted(name, fn) if fn is not None else None)
    try:
        yield counts
    finally:
        for name, fn in real.items():
            setattr(moe_utils, name, fn)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal = torch.ones(1, 1, SEQ, SEQ).tril() < 0.5  # Megatron's mask (True = masked); TE ignores it for "causal"
    return tokens, pos, causal, torch.roll(tokens, -1, 1)


def _fp8_modules(model):
    return [m for m in model.modules() if "fp8_state" in m._modules]


def train(name: str, tp: int, device="cpu", ep: int = 1) -> dict:
    """STEPS steps through Megatron's own gradient path: its DistributedDataParallel (gradients in
    main_grad buffers) and finalize_model_grads (which sums the sequence-parallel partial gradients
    TE leaves marked); then torch's Adam (Megatron's optimizer wrappers allocate on CUDA).
    device: where the model and batch live ("cpu": the CPU suite, with cpu_shim() in the worker).
    ep: Megatron's expert_model_parallel_size (MoE cases); each data-parallel rank trains on its own batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    moe = name in MOE_CASES
    gpt = _model(name, tp, device, ep)
    if moe:
        _place_expert_weights(gpt)
    model = DistributedDataParallel(config=gpt.config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens, pos, mask, labels = (t.to(device) for t in _batch(ps.get_data_parallel_rank()))
    losses, grad_norms, te_calls = [], [], Counter()
    with _count_te_moe_calls(te_calls) if moe else contextlib.nullcontext():
        for _ in range(STEPS):
            model.zero_grad_buffer()
            opt.zero_grad(set_to_none=True)
            gpt.set_is_first_microbatch()  # as Megatron's schedule does: FP8 weights are cast again after each step
            loss = model(tokens, pos, mask, labels=labels).float().mean()
            loss.backward()
            finalize_model_grads([model])
            for p in model.parameters():
                p.grad = p.main_grad
            grad_norms.append(_grad_norm(model))
            opt.step()
            losses.append(loss.item())
    fp8 = _fp8_modules(gpt)
    out = {"losses": losses, "grad_norms": grad_norms, "fp8_modules": len(fp8),
           "fwd_updates": [m.fp8_state.updates()[0] for m in fp8],
           "checkpoint": _checkpoint_round_trip(gpt, name, tp, device, ep),
           "split": "" if moe else _split_fused_norm_linear(gpt, tp)}
    if moe:
        out.update(_moe_facts(gpt), te_calls=dict(te_calls))
    return out


def _moe_facts(gpt) -> dict:
    """What Megatron's MoE used: its load-balancing loss per layer (summed over the steps; Megatron's logging
    tracker, cleared here) and the row alignment of its experts' Fp8Padding (None without FP8)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss", {})
    aux = tracker["values"].tolist() if "values" in tracker else []
    clear_aux_losses_tracker()
    padding = getattr(gpt.decoder.layers[0].mlp.experts, "quantization_padding", None)
    return {"aux_losses": aux, "padding": None if padding is None else (type(padding).__module__, padding.align_size),
            "sharded": _sharded_experts(gpt)}


def _sharded_experts(gpt) -> str:
    """Megatron's sharded_state_dict (its distributed checkpoints) of the experts: TEGroupedLinear gives each local
    expert its weight and an `_extra_state` of its own, split from the module's (TE's pickle, TE's slot layout:
    under delayed scaling 3 forward and 2 backward slots per GEMM). Returns "" or what is wrong."""
    sd = gpt.sharded_state_dict()
    for number, layer in enumerate(gpt.decoder.layers):
        for fc_name in ("linear_fc1", "linear_fc2"):
            fc = getattr(layer.mlp.experts, fc_name)
            prefix = f"decoder.layers.{number}.mlp.experts.{fc_name}."
            for i in range(fc.num_gemms):
                keys = (f"{prefix}weight{i}", f"{prefix}_extra_state{i or ''}")
                if any(k not in sd for k in keys):
                    return f"sharded_state_dict lacks {[k for k in keys if k not in sd]}"
                state = fc._decode_extra_state(sd[keys[1]].data)
                if fc.fp8_meta["fp8_checkpoint"] != (state is not None):
                    return f"{keys[1]}: decoded {state!r} with fp8_checkpoint={fc.fp8_meta['fp8_checkpoint']}"
                if state is not None and "scale_fwd" in state and tuple(state["scale_fwd"].shape) != (3,):
                    return f"{keys[1]}: scale_fwd of shape {tuple(state['scale_fwd'].shape)}, not TE's 3 slots"
    return ""


def _grad_norm(model) -> float:
    """The gradient norm as Megatron's optimizers count it: dense parameters (`allreduce` True) once per TP
    group unless marked tensor_model_parallel (TE's attribute), summed over the TP group; expert-parallel
    parameters (`allreduce` False) once per expert-TP group unless marked, summed over the expert TP x EP
    group; the two combined as Megatron's ChainedOptimizer does (the root of the sum of squares)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    groups = {True: (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_group()),
              False: (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_model_pipeline_parallel_group())}
    total = 0.0
    for dense, (tp_group, norm_group) in groups.items():
        params = [p for p in model.parameters() if getattr(p, "allreduce", True) == dense]
        sq = sum(p.grad.float().square().sum() for p in params if param_is_not_tensor_parallel_duplicate(p, tp_group))
        sq = torch.as_tensor(sq, dtype=torch.float64).reshape(1)
        torch.distributed.all_reduce(sq, group=norm_group)
        total += sq.item()
    return total ** 0.5


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


def _checkpoint_round_trip(model, name: str, tp: int, device="cpu", ep: int = 1) -> str:
    """The model's state dict (TE's layout: `_extra_state` per TE module) loads strictly into a fresh
    model, FP8 state included; returns "" or what differs."""
    sd = model.state_dict()
    extra = [k for k in sd if k.endswith("._extra_state")]
    if not extra or any("fp8_state" in k for k in sd):
        return f"not TE's layout: {len(extra)} _extra_state keys"
    fresh = _model(name, tp, device, ep)
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


def moe_worker(rank: int, world: int, device, out_path: str, runs) -> None:
    """runs: [((tp, ep), names), ...]: the MoE cases `names` at each layout (tp and ep dividing world; the rest of
    it is data parallel), one after the other in this launch; rank 0 writes {(tp, ep): {name: result}}."""
    cpu_shim()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    results = {}
    for (tp, ep), names in runs:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1234, te_rng_tracker=True)
        try:
            results[(tp, ep)] = {name: train(name, tp, ep=ep) for name in names}
        finally:
            ps.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out_path)


# -- context parallelism -------------------------------------------------------------------------------------------

# Megatron's context_parallel_size on the TE spec, with each of its cp_comm_types TE takes on one CP group, and FP8
CP_CASES = {
    "cp-p2p": dict(CASES["rmsnorm-swiglu"], cp_comm_type="p2p"),
    "cp-all-gather": dict(CASES["layernorm-gelu"], cp_comm_type="all_gather"),
    "cp-a2a": dict(CASES["rmsnorm-swiglu"], cp_comm_type="a2a"),
    "cp-fp8-delayed": dict(CASES["fp8-delayed"], cp_comm_type="p2p"),
}


def _context_parallel_on_cpu() -> None:
    """Megatron gives TE's attention a CUDA stream of its own under context parallelism (TEDotProductAttention.
    cp_stream, made once when it is None), and its RoPE picks a CP rank's rows with an index it moves to the GPU
    (rope_utils.get_pos_emb_on_this_cp_rank: torch.tensor(..., pin_memory=True).cuda()). On the CPU the stream is a
    stand-in (te_parallel keeps cp_stream for TE's signature and runs on the current stream), and rope_utils is
    given a `torch` whose tensors are made unpinned and stay on the CPU when asked for .cuda()."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.models.common.embeddings import rope_utils

    class HostTensor(torch.Tensor):
        def cuda(self, *args, **kwargs):
            return self.as_subclass(torch.Tensor)

    def tensor(*args, pin_memory: bool = False, **kwargs):
        return torch.tensor(*args, **kwargs).as_subclass(HostTensor)

    TEDotProductAttention.cp_stream = types.SimpleNamespace(name="cp_stream (CPU stand-in)")
    cpu_torch = types.ModuleType("torch")
    cpu_torch.__getattr__ = lambda name: getattr(torch, name)
    cpu_torch.tensor = tensor
    rope_utils.torch = cpu_torch


def train_cp(name: str, cp: int) -> dict:
    """STEPS steps at Megatron's context_parallel_size=cp, the other ranks data-parallel, every replica on the same
    batch (so that every layout trains the same model). Each CP rank takes the chunks of the batch that Megatron's
    get_batch_on_this_cp_rank gives it (2·cp chunks of the sequence, chunks r and 2·cp−1−r) and backpropagates the
    mean loss of its tokens: Megatron's DistributedDataParallel averages the gradients over dp x cp, which makes
    them those of the mean over the whole sequences (every CP rank holds as many tokens). The loss recorded is that
    mean: the sum of the per-token losses over the CP group divided by the global token count."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_batch_on_this_cp_rank

    import te_parallel

    gpt = _model(name, 1, cp=cp)
    model = DistributedDataParallel(config=gpt.config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens, pos, mask, labels = _batch(0)
    local = get_batch_on_this_cp_rank(dict(tokens=tokens, position_ids=pos, attention_mask=mask, labels=labels))
    losses, grad_norms = [], []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        gpt.set_is_first_microbatch()
        per_token = model(local["tokens"], local["position_ids"], local["attention_mask"],
                          labels=local["labels"]).float()  # [b, s/cp]
        per_token.mean().backward()
        finalize_model_grads([model])
        for p in model.parameters():
            p.grad = p.main_grad
        grad_norms.append(_grad_norm(model))
        opt.step()
        total = per_token.detach().sum().reshape(1)
        torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
        losses.append(total.item() / labels.numel())
    attention = [(m.cp_config.comm_type, m.cp_config.size, m.cp_global_ranks) for m in gpt.modules()
                 if isinstance(m, te_parallel.DotProductAttention) and m.cp_config is not None]
    return {"losses": losses, "grad_norms": grad_norms, "attention": attention, "tokens": local["tokens"].shape[1],
            "fp8_modules": len(_fp8_modules(gpt))}


def cp_worker(rank: int, world: int, device, out_path: str, names) -> None:
    """The CP_CASES `names` at context_parallel_size=world, then at 1 (world data-parallel ranks on one batch), in
    one launch; rank 0 writes {cp: {name: result}}."""
    cpu_shim()
    _context_parallel_on_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    results = {}
    for cp in (world, 1):
        ps.initialize_model_parallel(context_parallel_size=cp)
        model_parallel_cuda_manual_seed(1234, te_rng_tracker=True)
        try:
            results[cp] = {name: train_cp(name, cp) for name in names}
        finally:
            ps.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out_path)
