"""Loss curves of one or several runs (train loss thin, validation loss with markers), as a PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List


def plot_runs(runs: Dict[str, List[dict]], path: Path, title: str = "GPT on Python's stdlib (bytes)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, log) in enumerate(runs.items()):
        color = f"C{i}"
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], color=color, alpha=0.35, linewidth=0.8)
        val = [r for r in log if "val_loss" in r]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color=color, markersize=3, label=f"{name} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
