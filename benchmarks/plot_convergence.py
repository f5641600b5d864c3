"""Combine train_gpt logs into one plot (validation loss, and its % difference to the first run) and a table.

    python benchmarks/plot_convergence.py OUT.png NAME=path/log.json [NAME=path/log.json ...]

The title names the model from the first log's config (architecture, layers x hidden).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _val(log):
    return {r["step"]: r["val_loss"] for r in log if "val_loss" in r}


def main() -> None:
    out, specs = Path(sys.argv[1]) if len(sys.argv) > 1 else None, sys.argv[2:]
    if out is None or not specs or any("=" not in s for s in specs):
        sys.exit(f"plot_convergence: got {sys.argv[1:]}; need OUT.png NAME=path/log.json [NAME=path/log.json ...]")
    runs, rows = {}, []
    for spec in specs:
        name, path = spec.rsplit("=", 1)
        data = json.loads(Path(path).read_text())
        log = runs[name] = data["log"]
        tok = sorted(r["tokens_per_s"] for r in log[len(log) // 2:])
        last = max(_val(log))
        rows.append(f"| {name} | {last} | {_val(log)[last]:.4f} | {log[-1]['loss']:.4f} | {tok[len(tok) // 2]:.0f} | "
                    f"{data['config'].get('gpu', data['config']['device'])} |")
    fig, (ax, rel) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = _val(next(iter(runs.values())))
    for i, (name, log) in enumerate(runs.items()):
        v = _val(log)
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], color=f"C{i}", alpha=0.25, linewidth=0.7)
        ax.plot(list(v), list(v.values()), "o-", color=f"C{i}", markersize=3, label=f"{name} (val)")
        steps = [s for s in v if s in base]
        rel.plot(steps, [100 * (v[s] / base[s] - 1) for s in steps], "o-", color=f"C{i}", markersize=3, label=name)
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_ylim(0.5, 3.0)
    cfg = json.loads(Path(specs[0].rsplit("=", 1)[1]).read_text())["config"]
    model = "Llama-style" if cfg.get("arch") == "llama" else "GPT"
    ax.set_title(f"{model} {cfg.get('layers', '?')}x{cfg.get('hidden', '?')} on stdlib bytes: train (thin), "
                 "validation (dots)")
    rel.axhspan(-1, 1, color="0.9")
    rel.set_ylabel(f"val loss vs {next(iter(runs))} (%)")
    rel.set_xlabel("step")
    for a in (ax, rel):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("| run | steps | final val loss | final train loss | tokens/s (median) | device |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
