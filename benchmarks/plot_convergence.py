"""Combine train_gpt logs into one loss plot and a markdown table.

    python benchmarks/plot_convergence.py OUT.png NAME=path/log.json [NAME=path/log.json ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from te_parallel.examples.plot import plot_runs


def main() -> None:
    out, specs = Path(sys.argv[1]), sys.argv[2:]
    runs, rows = {}, []
    for spec in specs:
        name, path = spec.split("=", 1)
        data = json.loads(Path(path).read_text())
        log = data["log"]
        runs[name] = log
        val = [r for r in log if "val_loss" in r]
        tok = sorted(r["tokens_per_s"] for r in log[len(log) // 2:])
        rows.append(f"| {name} | {val[-1]['step']} | {val[-1]['val_loss']:.4f} | {log[-1]['loss']:.4f} | "
                    f"{tok[len(tok) // 2]:.0f} | {data['config'].get('gpu', data['config']['device'])} |")
    plot_runs(runs, out, title="GPT (6 layers, h512) on Python's stdlib bytes: validation loss")
    print("| run | steps | final val loss | final train loss | tokens/s (median) | device |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
