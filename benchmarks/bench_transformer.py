"""TransformerLayer fwd+bwd: plain PyTorch bf16 + SDPA vs te.TransformerLayer bf16 / FP8 (+ CUDA graph), and
NVIDIA Transformer Engine's TransformerLayer beside them when it is installed.

    python benchmarks/bench_transformer.py [--model gpt|llama] [--hidden --ffn --heads --gqa --seq --batch] [--json out.json]

--model gpt (default): the GPT layer h4096 ffn16384 32 heads, LayerNorm, GELU, biases, dropout 0.1, s2048 b4.
--model llama: the Llama-3-8B layer h4096 ffn14336 SwiGLU, 32 heads / 8 KV groups, RMSNorm, no biases, no
dropout, RoPE, s4096 b1. Any size flag overrides the model's.
--packed (llama): 8 documents of 4096, 1024, 3072, 512, 2048, 1536, 2560 and 1536 tokens packed into one
16384-token sequence (qkv_format "thd", cu_seqlens, causal within each document, RoPE positions restarting
per document); the torch row runs SDPA once per document.

"ms": steps issued back to back (a training loop), the median of 5 rounds that each time every row
(common.time_interleaved; the CUDA graph row is timed after them); "ms_synced": each step started on an
idle GPU.
Same run, same GPU, bf16 parameters, dropout 0.1, causal attention.
Each step starts from cleared gradients (optimizer.zero_grad(set_to_none=True)), so no .grad
accumulation is timed. Peak memory: torch.cuda.max_memory_allocated during one fwd+bwd from cleared
gradients and no FP8 weight copies, minus the memory held before it: it counts activations, every FP8
copy the step makes (weights included) and the new gradients. held_GiB: what the step leaves allocated
besides its gradients (the FP8 weight copies kept for the next forward).
`--ablate` adds FP8 rows with one choice changed each (same run): the MLP activation's own FP8 casts
switched off (te_parallel/ops/mlp.py), the forward GEMMs with fast accumulation (the recipe's
fp8_gemm_fprop=MMParams(use_split_accumulator=False), TE's choice), the fused MLP backward in one
piece instead of row chunks (LayerNormMLP's bwd_chunk_bytes), the FP8 weights
kept from forward to backward and for the next forward (is_first_microbatch=True, TE's micro-batch
flag). The row with every FP8 GEMM through the non-default GEMM (torch._scaled_mm) is always there.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import (OTHER_GEMM_LABEL, report, te_training_step, time_cuda, time_cuda_stream,  # noqa: E402
                    time_interleaved, training_step, transformer_engine, with_torch_gemm)
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
    fp8 = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    for name, rec in (("te bf16", None), ("te FP8 delayed", fp8), ("te FP8 current", recipe.Float8CurrentScaling())):
        steps[name] = training_step(layer, x, dy, rec, rotary_pos_emb=freqs, **seqs)
    te_peer = transformer_engine()
    if te_peer is not None:
        from transformer_engine.pytorch.attention import RotaryPositionEmbedding
        peer = te_peer.TransformerLayer(a.hidden, a.ffn, a.heads, **kw)
        peer_freqs = RotaryPositionEmbedding(d).to("cuda")(max(DOCS))
        for kind in (None, "delayed", "current"):
            steps[f"TE {'bf16' if kind is None else 'FP8 ' + kind}"] = te_training_step(
                peer, x, dy, kind, rotary_pos_emb=peer_freqs, **seqs)
    return steps


MODELS = {"gpt": dict(hidden=4096, ffn=16384, heads=32, gqa=32, seq=2048, batch=4),
          "llama": dict(hidden=4096, ffn=14336, heads=32, gqa=8, seq=4096, batch=1)}


def layer_kwargs(model: str, a) -> dict:
    """TransformerLayer keywords (the same for te_parallel and TE) of the model."""
    common = dict(params_dtype=torch.bfloat16, device="cuda", fuse_qkv_params=True)
    if model == "gpt":
        return dict(common, hidden_dropout=0.1, attention_dropout=0.1)
    return dict(common, num_gqa_groups=a.gqa, normalization="RMSNorm", activation="swiglu", bias=False,
                hidden_dropout=0.0, attention_dropout=0.0)


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
    run.clear_grads, run.params = step.clear_grads, step.params
    if hasattr(step, "drop_fp8_weights"):
        run.drop_fp8_weights = step.drop_fp8_weights
    return run


@contextlib.contextmanager
def switched_off(what: str, layer):
    """One optimisation off for an ablation row: "fused activation" (the MLP activation in high
    precision, each GEMM casting its input: ops/mlp.fp8_activation answers False), or "mlp chunks"
    (the layer's MLP backward in one piece: its bwd_chunk_bytes made unbounded). The other ablations
    are recipes (fast fprop accumulation, the torch._scaled_mm GEMM)."""
    from te_parallel.ops import mlp

    if what == "fused activation":
        owner, name, value = mlp, "fp8_activation", lambda *args: False
    else:
        owner, name, value = layer.layernorm_mlp, "bwd_chunk_bytes", 1 << 62
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    for k in MODELS["gpt"]:
        ap.add_argument(f"--{k}", type=int, default=None, help="overrides the model's size")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ablate", action="store_true", help="add FP8 rows with one optimisation off each")
    ap.add_argument("--packed", action="store_true", help="llama: 8 packed documents in 16k tokens (thd)")
    a = ap.parse_args()
    for k, v in MODELS[a.model].items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    if not torch.cuda.is_available():
        sys.exit("bench_transformer needs a CUDA GPU")
    dt = torch.bfloat16
    if a.packed:
        if a.model != "llama":
            sys.exit(f"--packed takes --model llama, got --model {a.model}")
        steps = packed_rows(a, dt)
        times = time_interleaved(steps, warmup=5, iters=5, rounds=5)
        rows, base = [], None
        for name, step in steps.items():
            got = measure(name, step, rows, times[name], base)
            base = base or got
        report(f"TransformerLayer fwd+bwd (llama, {len(DOCS)} packed documents, {sum(DOCS)} tokens, thd; ms per step "
               "back to back)", rows, ["case", "ms", "peak_GiB", "held_GiB", "speedup_vs_torch", "ms_synced",
                                      "synced_speedup"], a.json)
        return
    x = torch.randn(a.seq, a.batch, a.hidden, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    fp8 = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    kw = layer_kwargs(a.model, a)
    layer = te.TransformerLayer(a.hidden, a.ffn, a.heads, **kw)
    fwd = {}
    if a.model == "llama":
        fwd = {"rotary_pos_emb": te.RotaryPositionEmbedding(a.hidden // a.heads).to("cuda")(a.seq)}
        baseline = TorchLlamaLayer(a.hidden, a.ffn, a.heads, a.gqa).to("cuda", dt)
        steps = {"torch bf16 + SDPA": training_step(baseline, x, dy, rope=fwd["rotary_pos_emb"])}
    else:
        steps = {"torch bf16 + SDPA": training_step(TorchLayer(a.hidden, a.ffn, a.heads).to("cuda", dt), x, dy)}
    steps.update({"te bf16": training_step(layer, x, dy, **fwd),
                  "te FP8 delayed": training_step(layer, x, dy, fp8, **fwd),
                  "te FP8 current": training_step(layer, x, dy, recipe.Float8CurrentScaling(), **fwd)})
    if gemm_kernels.usable():  # every FP8 GEMM through torch._scaled_mm instead of te_parallel's cuBLASLt call
        steps[f"te FP8 delayed, {OTHER_GEMM_LABEL}"] = training_step(layer, x, dy, with_torch_gemm(fp8), **fwd)
    te_peer = transformer_engine()
    if te_peer is not None:
        peer = te_peer.TransformerLayer(a.hidden, a.ffn, a.heads, **kw)
        peer_fwd = {}
        if a.model == "llama":
            from transformer_engine.pytorch.attention import RotaryPositionEmbedding
            peer_fwd = {"rotary_pos_emb": RotaryPositionEmbedding(a.hidden // a.heads).to("cuda")(a.seq)}
        for kind in (None, "delayed", "current"):
            steps[f"TE {'bf16' if kind is None else 'FP8 ' + kind}"] = te_training_step(peer, x, dy, kind, **peer_fwd)
    labels = {"fused activation": "fused activation off", "mlp chunks": "MLP backward in one piece"}
    for what, label in labels.items() if a.ablate else ():
        steps[f"te FP8 delayed, {label}"] = under(what, layer, training_step(layer, x, dy, fp8, **fwd))
    if a.ablate:
        fast = dataclasses.replace(fp8, fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=False))
        steps["te FP8 delayed, fprop fast accumulation"] = training_step(layer, x, dy, fast, **fwd)
        steps["te FP8 delayed, FP8 weights kept (is_first_microbatch=True)"] = \
            training_step(layer, x, dy, fp8, is_first_microbatch=True, **fwd)
    # every row in each of 5 rounds (no row gains from its place in the sequence)
    times = time_interleaved(steps, warmup=5, iters=10, rounds=5)
    rows, base = [], None
    for name, step in steps.items():
        got = measure(name, step, rows, times[name], base)
        base = base or got
    graphed = te.make_graphed_callables(WithKwargs(layer, fwd), (x,), fp8_enabled=True, fp8_recipe=fp8)
    graph_clear = training_step(layer, x, dy).clear_grads

    def graph_step():
        graph_clear()
        graphed(x).backward(dy)
    graph_step.clear_grads = graph_clear
    graph_step.params = list(layer.parameters())
    measure("te FP8 delayed, CUDA graph (timed after the other rows)", graph_step, rows, None, base)
    shape = f"{a.model}: h{a.hidden} ffn{a.ffn} heads{a.heads}/{a.gqa} s{a.seq} b{a.batch}"
    report(f"TransformerLayer fwd+bwd ({shape}, bf16 params; ms per step back to back, ms_synced from an idle GPU)",
           rows, ["case", "ms", "peak_GiB", "held_GiB", "speedup_vs_torch", "ms_synced", "synced_speedup"], a.json)


if __name__ == "__main__":
    main()
