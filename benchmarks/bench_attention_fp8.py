"""FP8 attention (recipe fp8_dpa) fwd+bwd vs bf16 attention kernels, same run, same GPU.

    python benchmarks/bench_attention_fp8.py [--shapes s8192b1h32g8d128 s4096b2h32g32d128] [--no-causal]
        [--energy SECONDS] [--json out.json]

Rows per shape (bf16 q, k, v in sbhd; the gradient of the output given):
  bf16 cuDNN (te cudnn_fe)    te.DotProductAttention(backend="cudnn_fe"): cuDNN's bf16 flash attention
                              through the cuDNN frontend graphs
  torch SDPA flash            torch.nn.functional.scaled_dot_product_attention under the FLASH_ATTENTION backend
                              on [b, h, s, d] views (enable_gqa; K/V expanded before the timing where flash
                              refuses GQA, which the row's name then says)
  te FP8 delayed / current    te.DotProductAttention under fp8_autocast(DelayedScaling(fp8_dpa=True, HYBRID,
                              history 16) / Float8CurrentScaling(fp8_dpa=True)): the q/k/v casts, cuDNN's FP8
                              kernels, the dO cast, the dequantization of O and dQ/dK/dV and the scale
                              bookkeeping, all inside the timing
"ms": fwd+bwd per step issued back to back, median of 7 interleaved rounds (common.time_interleaved);
"fwd_ms": the forward alone (no autograd), timed likewise; TFLOPS counts 4·b·h·s²·d forward (half of it
causal) and 2.5 times that backward. "out_vs_bf16" / "dq_vs_bf16": ‖x − x_bf16‖/‖x_bf16‖ of the output and of
dq against the bf16 cuDNN row (the FP8 error; the fp64 comparisons are tests/gpu/test_attention_fp8_cuda.py's).
A row whose FP8 attention fell back to bf16 says so in its name (the reason is printed). "fp8_outputs": what the
FP8 graphs write, "bf16" (cuDNN's high-precision-output FP8 graphs, nothing after them) or "fp8" (FP8 outputs,
then one dequantizing launch each for O, dQ, dK, dV).
--energy SECONDS adds joules per step, watts and SM clock (common.energy_interleaved, nvidia-ml-py).
"""
from __future__ import annotations

import os
import re
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import Parser, energy_interleaved, nvml_missing, report, report_energy, time_interleaved  # noqa: E402
from te_parallel import recipe  # noqa: E402
from te_parallel.ops import attention_fp8_graphs  # noqa: E402

SHAPE = re.compile(r"s(\d+)b(\d+)h(\d+)g(\d+)d(\d+)$")
DEFAULT_SHAPES = ("s8192b1h32g8d128", "s4096b2h32g32d128")
RECIPES = {"delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                            amax_compute_algo="max", fp8_dpa=True),
           "current": recipe.Float8CurrentScaling(fp8_dpa=True)}


def parse_args(argv=None):
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="s<seq>b<batch>h<heads>g<groups>d<dim>")
    ap.add_argument("--no-causal", action="store_true", help="no mask instead of the causal mask")
    ap.add_argument("--energy", type=float, default=None, metavar="SECONDS")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.parsed = []
    for s in a.shapes:
        m = SHAPE.match(s)
        if m is None:
            ap.error(f"--shapes {s!r}: expected s<seq>b<batch>h<heads>g<groups>d<dim>, e.g. s8192b1h32g8d128")
        seq, b, h, g, d = map(int, m.groups())
        if min(seq, b, h, g, d) < 1 or h % g:
            ap.error(f"--shapes {s!r}: sizes must be positive and groups must divide heads")
        a.parsed.append((s, seq, b, h, g, d))
    if a.energy is not None and not 0.5 <= a.energy <= 60:
        ap.error(f"--energy {a.energy}: seconds per measurement window, between 0.5 and 60")
    if a.energy is not None and nvml_missing():
        ap.error(f"--energy {nvml_missing()}")
    return a


def _dpa_step(dpa, q, k, v, dy, rec=None):
    def step():
        for t in (q, k, v):
            t.grad = None
        with te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
            out = dpa(q, k, v)
        out.backward(dy)

    def forward():
        with torch.no_grad(), te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
            return dpa(q, k, v)
    return step, forward


def _sdpa_step(q, k, v, dy, causal: bool):
    """SDPA flash on [b, h, s, d] views of the sbhd tensors; (step, forward, label)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, g = q.shape[2], k.shape[2]
    label, kw = "torch SDPA flash", dict(is_causal=causal, enable_gqa=h != g)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(qb, kb, vb, **kw)
    except RuntimeError:  # flash without GQA: K/V repeated to every head, outside the timing
        kb, vb = (t.repeat_interleave(h // g, dim=1) for t in (kb, vb))
        kw["enable_gqa"], label = False, "torch SDPA flash (K/V expanded)"

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qb, kb, vb, **kw)
        return out.permute(2, 0, 1, 3).reshape(dy.shape)

    def step():
        for t in (q, k, v):
            t.grad = None
        run().backward(dy)

    def forward():
        with torch.no_grad():
            return run()
    return step, forward, label


def shape_rows(name, seq, b, h, g, d, causal: bool):
    """{row: (step, forward, dpa or None)} for one shape."""
    mask = "causal" if causal else "no_mask"
    mk = lambda n: torch.randn(seq, b, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(h), mk(g), mk(g)
    dy = torch.randn(seq, b, h * d, device="cuda", dtype=torch.bfloat16)
    rows = {}
    dpa = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type=mask, backend="cudnn_fe")
    rows["bf16 cuDNN (te cudnn_fe)"] = (*_dpa_step(dpa, q, k, v, dy), dpa)
    step, fwd, label = _sdpa_step(q, k, v, dy, causal)
    rows[label] = (step, fwd, None)
    for kind, rec in RECIPES.items():
        dpa = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type=mask)
        rows[f"te FP8 {kind}"] = (*_dpa_step(dpa, q, k, v, dy, rec), dpa)
    return rows, (q, k, v)


def _accuracy(rows, qkv):
    """{row: (out_vs_bf16, dq_vs_bf16)} after one step of each row."""
    got = {}
    for name, (step, forward, _) in rows.items():
        step()
        got[name] = (forward().float(), qkv[0].grad.float().clone())
    ref_out, ref_dq = got["bf16 cuDNN (te cudnn_fe)"]
    rel = lambda a, r: ((a - r).norm() / r.norm()).item()  # noqa: E731
    return {n: (rel(o, ref_out), rel(dq, ref_dq)) for n, (o, dq) in got.items()}


def main() -> None:
    a = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention_fp8 needs a CUDA GPU")
    causal = not a.no_causal
    out_rows, all_steps, all_ms = [], {}, {}
    for name, seq, b, h, g, d in a.parsed:
        rows, qkv = shape_rows(name, seq, b, h, g, d, causal)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc = _accuracy(rows, qkv)
        for w in caught:
            print(f"warning ({name}): {w.message}")
        fp8_outputs = attention_fp8_graphs.outputs_of(qkv[0], qkv[1], True) or "-"
        renamed = {}
        for row, (step, forward, dpa) in rows.items():
            if row.startswith("te FP8") and dpa.last_backend != "cudnn_fe_fp8":
                row = f"{row} (fell back to {dpa.last_backend})"
            renamed[row] = (step, forward, acc[next(r for r in rows if row.startswith(r))])
        steps = {r: s for r, (s, _, _) in renamed.items()}
        times = time_interleaved(steps, warmup=3, iters=10, rounds=7)
        fwd_times = time_interleaved({r: f for r, (_, f, _) in renamed.items()}, warmup=3, iters=10, rounds=7)
        flops_fwd = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
        base = times["bf16 cuDNN (te cudnn_fe)"]
        for row, (_, _, (out_err, dq_err)) in renamed.items():
            out_rows.append({"shape": name, "case": row, "ms": times[row], "fwd_ms": fwd_times[row],
                             "TFLOPS": 3.5 * flops_fwd / times[row] / 1e9, "speedup_vs_bf16_cudnn": base / times[row],
                             "out_vs_bf16": out_err, "dq_vs_bf16": dq_err,
                             "fp8_outputs": fp8_outputs if row.startswith("te FP8") else "-"})
            key = f"{name} {row}"
            all_steps[key], all_ms[key] = steps[row], times[row]
    if a.energy is not None:
        got = energy_interleaved(all_steps, all_ms, seconds=a.energy)
        for row in out_rows:
            row.update(got[f"{row['shape']} {row['case']}"])
    mask = "causal" if causal else "no mask"
    report(f"Attention fwd+bwd, bf16 inputs (sbhd, {mask}; ms per step back to back, median of 7 interleaved rounds)",
           out_rows, ["shape", "case", "ms", "fwd_ms", "TFLOPS", "speedup_vs_bf16_cudnn", "out_vs_bf16", "dq_vs_bf16",
            "fp8_outputs"],
           a.json)
    if a.energy is not None:
        report_energy(out_rows, a.energy, ["shape", "case"])


if __name__ == "__main__":
    main()
