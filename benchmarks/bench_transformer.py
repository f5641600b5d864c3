"""TransformerLayer fwd+bwd time and memory: plain PyTorch vs te_parallel (eager, compiled, CUDA graph) vs TE.

Plain PyTorch bf16 + SDPA vs te.TransformerLayer bf16 / FP8 (eager; torch.compile and CUDA graph rows on
request), and NVIDIA Transformer Engine's TransformerLayer beside them when it is installed.

    python benchmarks/bench_transformer.py [--model gpt|llama] [--hidden --ffn --heads --gqa --seq --batch]
        [--ablate] [--compile [--compile-warmup 5] [--compile-mode reduce-overhead]] [--graph] [--packed]
        [--fp8-dpa] [--energy SECONDS] [--json out.json]

--model gpt (default): the GPT layer h4096 ffn16384 32 heads, LayerNorm, GELU, biases, dropout 0.1, s2048 b4.
--model llama: the Llama-3-8B layer h4096 ffn14336 SwiGLU, 32 heads / 8 KV groups, RMSNorm, no biases, no
dropout, RoPE, s4096 b1. Any size flag overrides the model's.
--packed (llama): 8 documents of 4096, 1024, 3072, 512, 2048, 1536, 2560 and 1536 tokens packed into one
16384-token sequence (qkv_format "thd", cu_seqlens, causal within each document, RoPE positions restarting
per document); the torch row runs SDPA once per document. Eager rows only.
--compile adds torch.compile(layer, dynamic=False) rows: the torch layer, and te_parallel FP8 delayed and
current (each on its own copy of the layer), under fp8_autocast as the eager rows; --compile-mode passes
torch.compile's `mode` (reduce-overhead: inductor's CUDA graphs, replayed from the third step). Each compiled row first
runs --compile-warmup untimed steps (the compilations); the JSON rows of the compiled cases hold those
steps' seconds (compile_s), the dynamo graphs and graph breaks they made, recompiles_after_warmup (the
dynamo graphs compiled by the row's later steps, torch._dynamo.utils.counters["stats"]["unique_graphs"];
0 when the warm-up reached every path) and recompile_limit_hits (code objects that reached dynamo's
recompile limit during the row's steps and run eager from then on; dynamo keeps one cache per code
object, so a row can meet the limit that an earlier compiled row's entries filled), also printed as a
second table.
--graph adds te.make_graphed_callables rows, FP8 delayed (DelayedScaling interval 1) and FP8 current, each
over its own copy of the layer: captured before the timing, replayed outside fp8_autocast, gradients
cleared by setting them to None. A recipe make_graphed_callables refuses is left out with the reason printed.
The compiled and graphed rows are timed in the same rounds as the others.
--fp8-dpa adds "FP8 delayed_dpa" rows for te_parallel and TE: the delayed recipe with fp8_dpa=True, attention
in cuDNN's FP8 kernels (te_parallel: docs/attention.md, "FP8 attention"; TE: its FP8 fused attention).
--energy SECONDS adds each row's energy per step (common.energy_interleaved, NVML through nvidia-ml-py):
joules, watts and SM clock over SECONDS of back-to-back steps, in 2 interleaved rounds, and ms_at_limit, the
joules divided by the GPU's power limit: where a row's ms meets its ms_at_limit, the power limit sets its speed.

"ms": steps issued back to back (a training loop), the median of 5 rounds that each time every row
(common.time_interleaved); "ms_synced": each step started on an idle GPU.
Same run, same GPU, bf16 parameters, dropout 0.1 (gpt), causal attention.
Each step starts from cleared gradients (optimizer.zero_grad(set_to_none=True)), so no .grad
accumulation is timed. Peak memory: torch.cuda.max_memory_allocated during one fwd+bwd from cleared
gradients and no FP8 weight copies, minus the memory held before it: it counts activations, every FP8
copy the step makes (weights included) and the new gradients. held_GiB: what the step leaves allocated
besides its gradients (the FP8 weight copies kept for the next forward).
`--ablate` adds FP8 rows with one choice changed each (same run): the MLP activation's own FP8 casts
switched off (te_parallel/ops/mlp.py), the forward GEMMs with the exact sum (the recipe's
fp8_gemm_fprop=MMParams(use_split_accumulator=True); the default, as TE, is fast accumulation), the fused MLP backward in one
piece instead of row chunks (LayerNormMLP's bwd_chunk_bytes), attention on SDPA's cuDNN kernels
(backend="cudnn") instead of the cuDNN frontend's graphs, the FP8 weights
kept from forward to backward and for the next forward (is_first_microbatch=True, TE's micro-batch
flag). The row with every FP8 GEMM through the non-default GEMM (torch._scaled_mm) is always there.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import (OTHER_GEMM_LABEL, Parser, energy_interleaved, nvml_missing, report,  # noqa: E402
                    report_energy, te_training_step, time_cuda, time_cuda_stream, time_interleaved, training_step,
                    transformer_engine, with_torch_gemm)
from te_parallel import recipe  # noqa: E402
from te_parallel.native import gemm as gemm_kernels  # noqa: E402


class TorchLayer(torch.nn.Module):
    """The GPT layer in plain PyTorch (the baseline of the te rows), attention through SDPA (flash)."""

    def __init__(self, h: int, ffn: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, ffn), torch.nn.Linear(ffn, h)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, self.heads, 3, h // self.heads).unbind(3)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + F.dropout(self.proj(a), 0.1)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")), 0.1)


class TorchLlamaLayer(torch.nn.Module):
    """The Llama layer in plain PyTorch: RMSNorm, RoPE, GQA attention through SDPA, SwiGLU, no biases."""

    def __init__(self, h: int, ffn: int, heads: int, groups: int) -> None:
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, h // heads
        self.n1, self.n2 = torch.nn.RMSNorm(h, eps=1e-5), torch.nn.RMSNorm(h, eps=1e-5)
        self.qkv = torch.nn.Linear(h, h + 2 * groups * self.d, bias=False)
        self.proj = torch.nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = torch.nn.Linear(h, 2 * ffn, bias=False), torch.nn.Linear(ffn, h, bias=False)

    def forward(self, x, rope):  # x [s, b, h]; rope [s, 1, 1, d] (angles)
        s, b, h = x.shape
        q, k, v = self.qkv(self.n1(x)).split([h, self.groups * self.d, self.groups * self.d], dim=-1)
        q = _rotate(q.view(s, b, self.heads, self.d), rope)
        k = _rotate(k.view(s, b, self.groups, self.d), rope)
        a = self._attend(q, k, v.view(s, b, self.groups, self.d)).reshape(s, b, h)
        x = x + self.proj(a)
        gate, up = self.fc1(self.n2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)

    def _attend(self, q, k, v):  # [s, b, heads | groups, d] -> [s, b, heads, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).permute(2, 0, 1, 3)


def _rotate(t, rope):
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * rope.cos().to(t.dtype) + rotated * rope.sin().to(t.dtype)


class WithKwargs(torch.nn.Module):
    """layer(x, **kwargs) as a one-argument module (make_graphed_callables takes positional samples)."""

    def __init__(self, layer: torch.nn.Module, kwargs: dict) -> None:
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, x):
        return self.layer(x, **self.kwargs)


DOCS = (4096, 1024, 3072, 512, 2048, 1536, 2560, 1536)


class TorchPackedLlamaLayer(TorchLlamaLayer):
    """TorchLlamaLayer on packed documents: x [T, 1, h], attention causal within each document (SDPA per
    document), RoPE angles per token ([T, 1, 1, d], positions restarting per document)."""

    def __init__(self, *args, docs=DOCS) -> None:
        super().__init__(*args)
        self.docs = list(docs)

    def _attend(self, q, k, v):  # [T, 1, heads | groups, d] -> [T, 1, heads, d], causal per document
        q, k, v = (t[:, 0].transpose(0, 1) for t in (q, k, v))  # [heads | groups, T, d]
        outs = [F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                for qd, kd, vd in zip(q.split(self.docs, 1), k.split(self.docs, 1), v.split(self.docs, 1))]
        return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(1)


def packed_rows(a, dt) -> dict:
    """The --packed steps: torch (SDPA per document), te_parallel and TE in "thd" with cu_seqlens."""
    total, d = sum(DOCS), a.hidden // a.heads
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    x = torch.randn(total, a.hidden, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    freqs = te.RotaryPositionEmbedding(d).to("cuda")(max(DOCS))  # [max_doc, 1, 1, d]
    per_token = torch.cat([freqs[:n] for n in DOCS])  # positions restart per document
    seqs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCS), max_seqlen_kv=max(DOCS))
    kw = dict(layer_kwargs("llama", a), attn_input_format="thd", self_attn_mask_type="padding_causal")
    layer = te.TransformerLayer(a.hidden, a.ffn, a.heads, **kw)
    base = TorchPackedLlamaLayer(a.hidden, a.ffn, a.heads, a.gqa).to("cuda", dt)
    x3, dy3 = x.view(total, 1, a.hidden), dy.view(total, 1, a.hidden)
    steps = {"torch bf16 + SDPA per document": training_step(base, x3, dy3, rope=per_token)}
    for kind in KINDS:
        steps[f"te {'bf16' if kind is None else 'FP8 ' + kind}"] = training_step(
            layer, x, dy, fp8_recipe(kind), rotary_pos_emb=freqs, **seqs)
    te_peer = transformer_engine()
    if te_peer is not None:
        from transformer_engine.pytorch.attention import RotaryPositionEmbedding
        peer = te_peer.TransformerLayer(a.hidden, a.ffn, a.heads, **kw)
        peer_freqs = RotaryPositionEmbedding(d).to("cuda")(max(DOCS))
        for kind in KINDS:
            steps[f"TE {'bf16' if kind is None else 'FP8 ' + kind}"] = te_training_step(
                peer, x, dy, kind, rotary_pos_emb=peer_freqs, **seqs)
    return steps


MODELS = {"gpt": dict(hidden=4096, ffn=16384, heads=32, gqa=32, seq=2048, batch=4),
          "llama": dict(hidden=4096, ffn=14336, heads=32, gqa=8, seq=4096, batch=1)}


def model_config(model: str, **sizes) -> argparse.Namespace:
    """The model's sizes (MODELS) as the builders below take them, any of `sizes` given (not None) overriding."""
    given = {k: v for k, v in sizes.items() if v is not None}
    return argparse.Namespace(model=model, **dict(MODELS[model], **given))


def layer_kwargs(model: str, a, device="cuda") -> dict:
    """TransformerLayer keywords (the same for te_parallel and TE) of the model."""
    common = dict(params_dtype=torch.bfloat16, device=device, fuse_qkv_params=True)
    if model == "gpt":
        return dict(common, hidden_dropout=0.1, attention_dropout=0.1)
    return dict(common, num_gqa_groups=a.gqa, normalization="RMSNorm", activation="swiglu", bias=False,
                hidden_dropout=0.0, attention_dropout=0.0)


KINDS = (None, "delayed", "current", "block")  # the eager rows' recipes (None: bf16)


def fp8_recipe(kind: str | None):
    """te_parallel's recipe of the benchmarks' name (None: bf16): "delayed" is HYBRID, history 16, max (as
    common.te_recipe's TE recipe; "delayed_dpa" with fp8_dpa=True), "current" current scaling, "block" Float8BlockScaling's defaults (1x128
    tiles for inputs and gradients, 128x128 blocks for weights, power-of-two scales, E4M3)."""
    if kind is None:
        return None
    if kind == "block":
        return recipe.Float8BlockScaling()
    if kind in ("delayed", "delayed_dpa"):
        return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
                                     fp8_dpa=kind == "delayed_dpa")
    return recipe.Float8CurrentScaling()


@dataclasses.dataclass
class Layers:
    """One layer of the model three ways, one config: te_parallel, plain PyTorch (the torch rows' baseline),
    NVIDIA TE (None where it is not installed)."""

    te: torch.nn.Module
    base: torch.nn.Module
    peer: torch.nn.Module | None


def te_layer(a, device="cuda") -> torch.nn.Module:
    """te_parallel's TransformerLayer of the model at a's sizes."""
    return te.TransformerLayer(a.hidden, a.ffn, a.heads, **layer_kwargs(a.model, a, device))


def build_layers(a, device="cuda", peer: bool = True) -> Layers:
    """The model's te_parallel, torch and (when installed and `peer`) TE layers, bf16 parameters."""
    if a.model == "llama":
        base = TorchLlamaLayer(a.hidden, a.ffn, a.heads, a.gqa)
    else:
        base = TorchLayer(a.hidden, a.ffn, a.heads)
    te_peer = transformer_engine() if peer else None
    other = None if te_peer is None else te_peer.TransformerLayer(a.hidden, a.ffn, a.heads,
                                                                   **layer_kwargs(a.model, a, device))
    return Layers(te=te_layer(a, device), base=base.to(device, torch.bfloat16), peer=other)


def forward_kwargs(a, seq: int, device="cuda", peer: bool = False) -> tuple:
    """(te_parallel's, torch's, TE's) forward keywords for a sequence of `seq`: the RoPE angles of llama
    ([seq, 1, 1, head dim]; TE's from its own RotaryPositionEmbedding when `peer`), none for gpt."""
    if a.model != "llama":
        return {}, {}, {}
    freqs = te.RotaryPositionEmbedding(a.hidden // a.heads).to(device)(seq)
    peer_fwd = {}
    if peer:
        from transformer_engine.pytorch.attention import RotaryPositionEmbedding
        peer_fwd = {"rotary_pos_emb": RotaryPositionEmbedding(a.hidden // a.heads).to(device)(seq)}
    return {"rotary_pos_emb": freqs}, {"rope": freqs}, peer_fwd


def measure(name, step, rows, ms=None, base=None):
    """One row: ms back to back (timed here unless given: common.time_interleaved's), synced ms, and the
    step's peak and held memory."""
    ms = time_cuda_stream(step, warmup=5, iters=10) if ms is None else ms
    synced = time_cuda(step, warmup=2, iters=20)
    step.clear_grads()  # the step starts from zero_grad(set_to_none=True): its gradients count in its peak
    getattr(step, "drop_fp8_weights", lambda: None)()  # ... and without FP8 weight copies: they count too
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    grads = sum(p.grad.numel() * p.grad.element_size() for p in step.params if p.grad is not None)
    held = (torch.cuda.memory_allocated() - before - grads) / 2**30  # kept between steps besides the gradients
    base_ms, base_synced = base or (ms, synced)
    rows.append({"case": name, "ms": ms, "peak_GiB": peak, "held_GiB": held, "speedup_vs_torch": base_ms / ms, "ms_synced": synced,
                 "synced_speedup": base_synced / synced})
    return ms, synced


def under(what: str, layer, step):
    """`step` run with switched_off(what, layer) around each call (keeping its clear_grads / params helpers)."""
    def run():
        with switched_off(what, layer):
            step()
    return _helpers_of(step, run)


def _helpers_of(step, run):
    """`run` (a wrapper of `step`) given step's clear_grads, params and drop_fp8_weights helpers."""
    run.clear_grads, run.params = step.clear_grads, step.params
    if hasattr(step, "drop_fp8_weights"):
        run.drop_fp8_weights = step.drop_fp8_weights
    return run


@contextlib.contextmanager
def switched_off(what: str, layer):
    """One optimisation off for an ablation row: "fused activation" (the MLP activation in high
    precision, each GEMM casting its input: ops/mlp.fp8_activation answers False), "mlp chunks"
    (the layer's MLP backward in one piece: its bwd_chunk_bytes made unbounded) or "sdpa attention"
    (attention on SDPA's cuDNN kernels instead of the cuDNN frontend's graphs). The other ablations
    are recipes (exact fprop accumulation, the torch._scaled_mm GEMM)."""
    from te_parallel.ops import mlp

    if what == "fused activation":
        owner, name, value = mlp, "fp8_activation", lambda *args: False
    elif what == "sdpa attention":
        owner, name, value = layer.self_attention.core_attention, "backend", "cudnn"
    else:
        owner, name, value = layer.layernorm_mlp, "bwd_chunk_bytes", 1 << 62
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def eager_steps(a, layers: Layers, x, dy, fwd: dict, base_fwd: dict, peer_fwd: dict) -> dict:
    """The rows every run has: torch, te_parallel bf16 / FP8 delayed / FP8 current, the other GEMM, TE's three
    (when installed), and with --ablate one choice changed each."""
    layer, fp8 = layers.te, fp8_recipe("delayed")
    steps = {"torch bf16 + SDPA": training_step(layers.base, x, dy, **base_fwd)}
    for kind in KINDS:
        steps[f"te {'bf16' if kind is None else 'FP8 ' + kind}"] = training_step(layer, x, dy, fp8_recipe(kind), **fwd)
    if gemm_kernels.usable():  # every FP8 GEMM through torch._scaled_mm instead of te_parallel's cuBLASLt call
        steps[f"te FP8 delayed, {OTHER_GEMM_LABEL}"] = training_step(layer, x, dy, with_torch_gemm(fp8), **fwd)
    for kind in KINDS if layers.peer is not None else ():
        steps[f"TE {'bf16' if kind is None else 'FP8 ' + kind}"] = te_training_step(layers.peer, x, dy, kind,
                                                                                      **peer_fwd)
    if a.fp8_dpa:  # FP8 attention rows (te_parallel, then TE)
        steps["te FP8 delayed_dpa"] = training_step(layer, x, dy, fp8_recipe("delayed_dpa"), **fwd)
        if layers.peer is not None:
            steps["TE FP8 delayed_dpa"] = te_training_step(layers.peer, x, dy, "delayed_dpa", **peer_fwd)
    if not a.ablate:
        return steps
    labels = {"fused activation": "fused activation off", "mlp chunks": "MLP backward in one piece",
              "sdpa attention": "attention on SDPA's cuDNN"}
    for what, label in labels.items():
        steps[f"te FP8 delayed, {label}"] = under(what, layer, training_step(layer, x, dy, fp8, **fwd))
    exact = dataclasses.replace(fp8, fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=True))
    steps["te FP8 delayed, fprop exact accumulation"] = training_step(layer, x, dy, exact, **fwd)
    steps["te FP8 delayed, FP8 weights kept (is_first_microbatch=True)"] = \
        training_step(layer, x, dy, fp8, is_first_microbatch=True, **fwd)
    return steps


def te_copy(a, layers: Layers, device="cuda") -> torch.nn.Module:
    """A second te_parallel layer holding layers.te's state (taken before any step has run)."""
    layer = te_layer(a, device)
    layer.load_state_dict(layers.te.state_dict())
    return layer


def compile_layer(module: torch.nn.Module, mode: str = "default", backend: str = "inductor"):
    """torch.compile(module, dynamic=False) in `mode` ("default": torch's default mode)."""
    return torch.compile(module, dynamic=False, backend=backend, mode=None if mode == "default" else mode)


def compile_label(mode: str) -> str:
    """The row-name suffix of a compiled row in `mode`."""
    return "torch.compile" if mode == "default" else f"torch.compile {mode}"


def compiled_steps(a, layers: Layers, x, dy, fwd: dict, base_fwd: dict, warmup: int, device="cuda",
                   backend="inductor", mode: str = "default") -> tuple:
    """--compile's rows: torch.compile(layer, dynamic=False, mode=mode) of the torch layer and of a te_parallel copy per
    FP8 recipe (its own copy, so that no other row changes the state its compiled code was guarded on).
    Each is warmed up here (`warmup` steps: the compilations), and afterwards counts the dynamo graphs it
    compiles (recompilations). Returns (steps, {row: record}), a record holding warmup_steps, compile_s (the
    warm-up's seconds), graphs and graph_breaks (made during the warm-up), recompiles_after_warmup and
    recompile_limit_hits (code that dynamo stopped compiling and runs eager: over the warm-up and after), the
    last two kept up to date as the step runs. A row whose compilation fails is left out, its reason printed."""
    label = compile_label(mode)
    made = {f"torch bf16 + SDPA, {label}": training_step(compile_layer(layers.base, mode, backend), x, dy, **base_fwd)}
    for kind in ("delayed", "current"):
        made[f"te FP8 {kind}, {label}"] = training_step(compile_layer(te_copy(a, layers, device), mode, backend), x,
                                                        dy, fp8_recipe(kind), **fwd)
    steps, records = {}, {}
    for name, step in made.items():
        before, t0 = dynamo_counts(), time.perf_counter()
        try:
            for _ in range(warmup):
                step()
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as e:  # a compiler's failure on this layer: the other rows still run
            print(f"skipping row {name!r}: torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        made_now = {k: v - before[k] for k, v in dynamo_counts().items()}
        records[name] = {"warmup_steps": warmup, "compile_s": time.perf_counter() - t0, "graphs": made_now["graphs"],
                         "graph_breaks": made_now["graph_breaks"], "recompiles_after_warmup": 0,
                         "recompile_limit_hits": made_now["recompile_limit_hits"]}
        steps[name] = counting_recompiles(step, records[name])
    return steps, records


def dynamo_counts() -> dict:
    """torch._dynamo's running totals: graphs compiled, graph breaks, and code objects that reached the
    recompile limit (torch._dynamo.config.recompile_limit; dynamo runs them eager from then on). The limit's
    entry is an "unimplemented" counter ("Dynamo recompile limit exceeded ...") in recent torch, a graph
    break naming recompile_limit or cache_size_limit in older releases: the larger of the two counts."""
    from torch._dynamo.utils import counters

    def limit_hits(category):
        return sum(n for msg, n in counters[category].items()
                   if any(w in str(msg).lower() for w in ("recompile limit", "recompile_limit", "cache_size_limit")))

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "recompile_limit_hits": max(limit_hits("unimplemented"), limit_hits("graph_break"))}


def counting_recompiles(step, record: dict):
    """`step` adding the dynamo graphs it compiles to record["recompiles_after_warmup"], and the code objects
    that reach the recompile limit to record["recompile_limit_hits"] (reading the counters costs tens of
    microseconds of host time at most, against a step's milliseconds)."""
    def run():
        before = dynamo_counts()
        step()
        after = dynamo_counts()
        record["recompiles_after_warmup"] += after["graphs"] - before["graphs"]
        record["recompile_limit_hits"] += after["recompile_limit_hits"] - before["recompile_limit_hits"]
    return _helpers_of(step, run)


def graphed_steps(a, layers: Layers, x, dy, fwd: dict, device="cuda", kinds=("delayed", "current")) -> dict:
    """--graph's rows: te.make_graphed_callables(layer, fp8_enabled=True, fp8_recipe=...) over a te_parallel
    copy per FP8 recipe (its own copy: a replay reads and writes the FP8 state tensors it captured, which no
    eager row may replace under it), called outside fp8_autocast, gradients cleared by setting them to None.
    A recipe make_graphed_callables refuses (or a capture that fails) is left out with its reason printed."""
    steps = {}
    for kind in kinds:
        name, layer = f"te FP8 {kind}, CUDA graph", te_copy(a, layers, device)
        try:
            graphed = te.make_graphed_callables(WithKwargs(layer, fwd), (x,), fp8_enabled=True,
                                                fp8_recipe=fp8_recipe(kind))
        except (ValueError, RuntimeError) as e:  # a refused recipe, or a capture that failed: the other rows run
            print(f"skipping row {name!r}: make_graphed_callables: {str(e).splitlines()[0]}")
            continue
        clear = training_step(layer, x, dy).clear_grads

        def step(graphed=graphed, clear=clear):
            clear()
            graphed(x).backward(dy)
        step.clear_grads, step.params = clear, list(layer.parameters())
        steps[name] = step
    return steps


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COLUMNS = ["case", "ms", "peak_GiB", "held_GiB", "speedup_vs_torch", "ms_synced", "synced_speedup"]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (one-line errors) and the model's sizes filled in."""
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    for k in MODELS["gpt"]:
        ap.add_argument(f"--{k}", type=int, default=None, help="overrides the model's size")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ablate", action="store_true", help="add FP8 rows with one optimisation off each")
    ap.add_argument("--packed", action="store_true", help="llama: 8 packed documents in 16k tokens (thd)")
    ap.add_argument("--compile", action="store_true",
                    help="add torch.compile rows: the torch layer, te_parallel FP8 delayed and current")
    ap.add_argument("--compile-warmup", type=int, default=5,
                    help="untimed steps of each compiled row before its recompilations are counted")
    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                    help="torch.compile's mode for the --compile rows")
    ap.add_argument("--graph", action="store_true",
                    help="add te.make_graphed_callables rows (FP8 delayed and current), timed with the others")
    ap.add_argument("--energy", type=float, default=None, metavar="SECONDS",
                    help="also measure each row's energy per step over SECONDS of back-to-back steps (NVML)")
    ap.add_argument("--fp8-dpa", action="store_true",
                    help="add FP8 delayed_dpa rows (DelayedScaling(fp8_dpa=True): FP8 attention) for te_parallel and TE")
    a = ap.parse_args(argv)
    if a.energy is not None and not 0.5 <= a.energy <= 60:
        ap.error(f"--energy {a.energy}: seconds per measurement window, between 0.5 and 60")
    if a.energy is not None and nvml_missing():
        ap.error(f"--energy {nvml_missing()}")
    if a.model == "gpt" and a.gqa is not None:
        ap.error(f"--gqa {a.gqa}: the gpt layer has no KV groups (--gqa goes with --model llama)")
    for k, v in MODELS[a.model].items():
        given = getattr(a, k)
        if given is not None and given < 1:
            ap.error(f"--{k} {given}: sizes are positive")
        setattr(a, k, v if given is None else given)
    a.gqa = a.heads if a.model == "gpt" else a.gqa
    if a.hidden % a.heads:
        ap.error(f"--heads {a.heads}: must divide --hidden {a.hidden}")
    if a.heads % a.gqa:
        ap.error(f"--gqa {a.gqa}: must divide --heads {a.heads}")
    if a.packed and a.model != "llama":
        ap.error(f"--packed takes --model llama, got --model {a.model}")
    if a.packed and (a.compile or a.graph or a.ablate or a.fp8_dpa):
        ap.error("--packed times the eager rows only; drop --compile, --graph, --ablate and --fp8-dpa")
    if a.compile_mode != "default" and not a.compile:
        ap.error(f"--compile-mode {a.compile_mode}: goes with --compile")
    if a.compile_warmup < 1:
        ap.error(f"--compile-warmup {a.compile_warmup}: at least one step (the compilation)")
    return a


def add_energy(a, steps: dict, times: dict, rows: list) -> None:
    """--energy: each row's joules per step, watts and SM clock (common.energy_interleaved), into its row."""
    if a.energy is None:
        return
    got = energy_interleaved(steps, times, seconds=a.energy)
    base = got[rows[0]["case"]]["J_per_step"]  # (the first row is torch's)
    for row in rows:
        row.update(got[row["case"]], J_vs_torch=got[row["case"]]["J_per_step"] / base)


def run_packed(a) -> None:
    steps = packed_rows(a, torch.bfloat16)
    times = time_interleaved(steps, warmup=5, iters=5, rounds=5)
    rows, base = [], None
    for name, step in steps.items():
        got = measure(name, step, rows, times[name], base)
        base = base or got
    add_energy(a, steps, times, rows)
    report(f"TransformerLayer fwd+bwd (llama, {len(DOCS)} packed documents, {sum(DOCS)} tokens, thd; ms per step "
           "back to back)", rows, COLUMNS, a.json)
    if a.energy is not None:
        report_energy(rows, a.energy, ["case"], ["J_vs_torch"])


def main() -> None:
    a = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_transformer needs a CUDA GPU")
    if a.packed:
        return run_packed(a)
    x = torch.randn(a.seq, a.batch, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    layers = build_layers(a)
    fwd, base_fwd, peer_fwd = forward_kwargs(a, a.seq, peer=layers.peer is not None)
    steps, records = eager_steps(a, layers, x, dy, fwd, base_fwd, peer_fwd), {}
    if a.compile:
        made, records = compiled_steps(a, layers, x, dy, fwd, base_fwd, a.compile_warmup, mode=a.compile_mode)
        steps.update(made)
    if a.graph:
        steps.update(graphed_steps(a, layers, x, dy, fwd))
    # every row in each of 5 rounds (no row gains from its place in the sequence)
    times = time_interleaved(steps, warmup=5, iters=10, rounds=5)
    rows, base = [], None
    for name, step in steps.items():
        got = measure(name, step, rows, times[name], base)
        base = base or got
        rows[-1].update(records.get(name, {}))  # a compiled row's warm-up and recompilations (final by now)
    add_energy(a, steps, times, rows)
    shape = f"{a.model}: h{a.hidden} ffn{a.ffn} heads{a.heads}/{a.gqa} s{a.seq} b{a.batch}"
    report(f"TransformerLayer fwd+bwd ({shape}, bf16 params; ms per step back to back, ms_synced from an idle GPU)",
           rows, COLUMNS, a.json)
    if a.energy is not None:
        report_energy(rows, a.energy, ["case"], ["J_vs_torch"])
    if records:
        report("torch.compile rows: warm-up (the compilations) and dynamo graphs compiled after it",
               [dict(case=name, **r) for name, r in records.items()],
               ["case", "warmup_steps", "compile_s", "graphs", "graph_breaks", "recompiles_after_warmup",
                "recompile_limit_hits"], None)


if __name__ == "__main__":
    main()
